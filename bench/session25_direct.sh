#!/usr/bin/env bash
# Session 25, 16-core host, CPU only, TCP only: the direct all-reduce (every rank talks to
# every peer: 2 phases instead of 2 (n - 1) ring steps) paired with the ring and Gloo in the
# same processes (bench/tcp_ab.py), 4 and 8 ranks, 2 to 64 MiB.
# OUT=dir bash bench/session25_direct.sh
set -u
OUT=${OUT:-$PWD/session25_direct}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab_direct.txt
for n in 4 8; do for s in 2M 16M 64M; do
  case $s in 2M) it=40;; 16M) it=8;; *) it=3;; esac
  GLOO_PORT=$((29500 + n)) timeout 60 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 4 --variants chunks=8 algo=direct gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]}" >>"$A"
done; done
cat "$A"
