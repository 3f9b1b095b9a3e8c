#!/usr/bin/env bash
# Session 39, the 16-core GPU host, CPU only, TCP only: is the TCP path slower than in
# session 32, or was session39_device1's sweep (run right after nine mpirun runs) disturbed?
#  1. acoll-perf all_reduce, TCP only, 8 B to 128 MiB, the code of session 32's final sweep
#     (oldsrc/: src/ at 4d7384e, carried untracked) and src/ alternating, 4 / 8 / 2 ranks, twice;
#  2. the same sweep against Gloo (src/), 4 and 8 ranks;
#  3. one lane-vs-MPI run with 8 ranks, then the 8-rank TCP sweep again.
# OUT=dir bash bench/session39_device2.sh
set -u
OUT=${OUT:-$PWD/session39_device2}
. bench/device_steps.sh
device_start "$OUT"
tcp() {  # FILE SRC RANKS
  PYTHONPATH="$2:$SITE" CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 100 \
    python3 -m acoll.perf all_reduce -N "$3" -b 8 -e 128M -f 8 -n 20 -w 5 >"$OUT/$1" 2>&1
  echo "== $1: exit $? at $SECONDS s" >>"$OUT/$1"
}
for pass in 1 2; do
  for n in 4 8 2; do
    tcp old_${n}_$pass.txt "$PWD/oldsrc" $n
    tcp new_${n}_$pass.txt "$PWD/src" $n
  done
done
for n in 4 8; do device_perf "$OUT" gloo_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe -np 8 \
  python3 bench/lane_vs_mpi_pair.py 1M 2M 4M 8M 16M --rounds 6 >"$OUT/pair8.txt" 2>&1
tcp new_8_after_mpi.txt "$PWD/src" 8
ps aux --sort=-%cpu | head -15 >"$OUT/ps_after.txt"
tcp old_8_after_mpi.txt "$PWD/oldsrc" 8
