#!/usr/bin/env bash
# Session 31 on the 16-core GPU host, CPU only, TCP only (issue 11 part 2): the native ring
# (C code on a worker thread, acoll/_native/ring.c) paired in the same processes with the
# Python ring and Gloo (bench/tcp_ab.py native python gloo), then acoll-perf sweeps
# against Gloo with the native ring as it is by default.
# OUT=dir bash bench/session31_device.sh
set -u
OUT=${OUT:-$PWD/session31_device}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
{ command -v cc; cc --version | head -1; time python3 -m acoll._native; } >"$OUT/build.txt" 2>&1
cat "$OUT/build.txt"
A=$OUT/ab.txt
t0=$SECONDS
for ns in ${SIZES:-8:1M 8:4M 8:16M 8:64M 4:1M 4:4M 4:16M 4:64M 2:4M 2:64M}; do
  n=${ns%%:*}; s=${ns##*:}
  case $s in 1M|4M) it=20;; 64M) it=4;; *) it=8;; esac
  GLOO_PORT=$((29500 + n)) timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py \
    $s --iters $it --rounds ${ROUNDS:-4} --variants native python gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
cat "$A"
for n in ${PERF_N:-4 8}; do
  timeout 150 python3 -m acoll.perf all_reduce -N $n -b 8 -e 64M -f 4 -n 20 -w 5 --vs gloo \
    >"$OUT/perf_$n.txt" 2>&1
  echo "== perf $n: exit $? at $((SECONDS - t0)) s" >>"$OUT/perf_$n.txt"
  grep -v "^#  \|Warning\|UFUNCS" "$OUT/perf_$n.txt" | tail -25
done
