#!/usr/bin/env bash
# Session 39, the 16-core GPU host, CPU only: issue 11's targets on the code as it stands.
#  1. all_reduce against Open MPI over shared memory, in the same processes
#     (bench/lane_vs_mpi_pair.py), NumPy arrays and registered buffers, 1 to 16 MiB,
#     2 / 4 / 8 ranks, three passes (rank counts interleaved), 6 rounds each;
#  2. TCP only (ACOLL_SHM_DISABLE=1 ACOLL_NET=socket) against Gloo, 8 B to 128 MiB,
#     2 / 4 / 8 ranks (acoll-perf --vs gloo).
# OUT=dir bash bench/session39_device1.sh
set -u
OUT=${OUT:-$PWD/session39_device1}
. bench/device_steps.sh
device_start "$OUT"
P=$OUT/pair.txt
for pass in 1 2 3; do
  for n in 2 4 8; do
    echo "## $n ranks, pass $pass" >>"$P"
    CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n \
      python3 bench/lane_vs_mpi_pair.py 1M 2M 4M 8M 16M --rounds 6 \
      --variants mpi,acoll,acoll-R 2>&1 | grep -v "^# all_reduce" >>"$P"
    echo "== exit $? at $SECONDS s" >>"$P"
  done
done
for n in 2 4 8; do device_perf "$OUT" ar_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
