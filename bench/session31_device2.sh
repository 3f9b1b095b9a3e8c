#!/usr/bin/env bash
# Session 31, 16-core GPU host, CPU only (issue 11 parts 2 and 3) at the native ring with
# 256 KiB pieces and ACOLL_NATIVE_MIN=0: (1) native / python / gloo paired in the same
# processes (bench/tcp_ab.py) where session 31's first run was short (128 KiB to 1 MiB) or
# even (64 MiB); (2) acoll-perf sweeps --vs gloo with 2, 4, 8 ranks; (3) 4 namespace hosts
# on 10 Gbit/s tbf links (bench/netns_shaped.py), acoll, Gloo, acoll.
# OUT=dir NETBIN=.netbin bash bench/session31_device2.sh
set -u
OUT=${OUT:-$PWD/session31_device2}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
python3 -m acoll._native >"$OUT/build.txt" 2>&1
t0=$SECONDS
A=$OUT/ab.txt
for ns in ${SIZES:-8:128K 8:512K 8:1M 8:64M 4:128K 4:512K 4:64M 2:64M}; do
  n=${ns%%:*}; s=${ns##*:}
  case $s in 64M) it=4;; *) it=20;; esac
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) \
    timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py \
    $s --iters $it --rounds ${ROUNDS:-4} --variants native python gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
grep -v "^#" "$A"
for n in ${PERF_N:-2 4 8}; do
  device_perf "$OUT" perf_$n.txt all_reduce -N $n -b 8 -e 128M -f 4
done
if [ -z "${NO_NETNS:-}" ]; then
  device_netns "$OUT" acoll1 --libs acoll
  device_netns "$OUT" gloo1 --libs gloo
  device_netns "$OUT" acoll2 --libs acoll
  cat "$OUT/netns.txt"
fi
