#!/usr/bin/env bash
# Session 25, 16-core host, CPU only: the 2-rank lane after its change to 2 MiB slots and
# one-shot steps, against Open MPI (acoll-perf --vs mpi --rounds 3) and paired against
# two-shot steps in the same processes (bench/lane_pair_ab.py).
# OUT=dir bash bench/session25_pair.sh
set -u
OUT=${OUT:-$PWD/session25_pair}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
timeout 100 python3 -m acoll.perf all_reduce -N 2 -b 1M -e 64M -f 2 -n 20 -w 5 --vs mpi \
  --rounds 3 >"$OUT/shm_vs_mpi_2.txt" 2>&1
echo "== exit $?" >>"$OUT/shm_vs_mpi_2.txt"
timeout 120 python3 -m acoll.run -n 2 -- python3 bench/lane_pair_ab.py 2M 4M 16M 64M --rounds 6 \
  >"$OUT/pair_ab.txt" 2>&1
echo "== exit $?" >>"$OUT/pair_ab.txt"
grep -A9 "acoll vs mpi" "$OUT/shm_vs_mpi_2.txt" | tail -7; grep "rank 0" "$OUT/pair_ab.txt"
