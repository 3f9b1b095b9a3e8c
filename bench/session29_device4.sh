#!/usr/bin/env bash
# Session 29, 16-core GPU host, CPU only, TCP only, ring all-reduce: is a hop's latency
# (1.2 ms per 512 KiB chunk at 16 MiB with 8 ranks, bench/results/session29_h200/3_threads)
# the GIL's switch interval, the send thread's hand-over, or the chunk size?
# bench/tcp_ab.py variants, paired in the same processes.
# OUT=dir bash bench/session29_device4.sh
set -u
OUT=${OUT:-$PWD/session29_device4}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab.txt
t0=$SECONDS
for ns in 8:16M 8:4M 4:16M 8:64M; do
  n=${ns%%:*}; s=${ns##*:}
  case $s in 4M) it=20;; 16M) it=8;; *) it=3;; esac
  GLOO_PORT=$((29500 + n)) timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 5 --variants chunks=8 switch=0.0005 switch=0.0001 offload=1G \
    chunk=256K+chunks=0 chunk=128K+chunks=0 gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
cat "$A"
