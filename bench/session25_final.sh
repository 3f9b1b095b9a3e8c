#!/usr/bin/env bash
# Session 25's last device run (16-core host, CPU only, issue 11) at the final code: receive
# threads from 768 KiB paired with recvoff and Gloo (TCP only), then the lane/SHM against
# Open MPI at 2, 4 and 8 ranks (acoll-perf --vs mpi --rounds 3).
# OUT=dir bash bench/session25_final.sh
set -u
OUT=${OUT:-$PWD/session25_final}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
A=$OUT/ab_recv.txt
for n in 4 8 2; do for s in 2M 16M 64M 256M; do
  case $s in 2M) it=40;; 16M) it=8;; 64M) it=3;; *) it=1;; esac
  [ $s = 256M ] && [ $n != 2 ] && continue
  ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) timeout 55 \
    python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 4 --variants chunks=8 recvoff gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]}" >>"$A"
done; done
for n in 2 4 8; do
  timeout 100 python3 -m acoll.perf all_reduce -N $n -b 1M -e 64M -f 4 -n 20 -w 5 --vs mpi \
    --rounds 3 >"$OUT/shm_vs_mpi_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/shm_vs_mpi_$n.txt"
done
cat "$A"; for n in 2 4 8; do grep -A7 "acoll vs mpi" "$OUT/shm_vs_mpi_$n.txt" | tail -5; done
