#!/usr/bin/env bash
# Session 25, the 16-core host, CPU only (issue 11 part 2): receive threads (a thread reads
# large payloads bound for acoll's scratch out of the kernel while the loop reduces), paired
# in the same processes with the loop thread reading everything (recvoff) and with Gloo.
# OUT=dir bash bench/session25_recv.sh
set -u
OUT=${OUT:-$PWD/session25_recv}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab_recv.txt
for n in 4 8 2; do for s in 2M 16M 64M; do
  case $s in 2M) it=40;; 16M) it=8;; *) it=3;; esac
  GLOO_PORT=$((29500 + n)) timeout 55 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 4 --variants chunks=8 recvoff gloo 2>&1 \
    | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]}" >>"$A"
done; done
cat "$A"
