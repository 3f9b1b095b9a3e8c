#!/usr/bin/env bash
# Session 29's last device run (16-core GPU host, one H200, Python 3.12) at the final code:
# (1) halving-doubling after the review's fixes (hellos, chunk-first steps) against the
# ring and Gloo, TCP only, paired (bench/tcp_ab.py), 8 ranks at 4 and 16 MiB, 4 ranks at
# 16 MiB; (2) the whole suite with the GPU tests (pytest-asyncio carried in .whl/).
# OUT=dir bash bench/session29_device6.sh
set -u
OUT=${OUT:-$PWD/session29_device6}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
A=$OUT/ab.txt
t0=$SECONDS
for ns in 8:4M 8:16M 4:16M; do
  n=${ns%%:*}; s=${ns##*:}
  case $s in 4M) it=20;; *) it=8;; esac
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) \
    timeout 60 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters $it \
    --rounds 4 --variants chunks=8 algo=hd gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
cat "$A"
SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
