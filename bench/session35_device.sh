#!/usr/bin/env bash
# Session 35's second device run (16-core GPU host, one H200, Python 3.12): the whole suite
# with the GPU tests at this commit (the slow-machine test changes), then all_reduce
# against Open MPI over shared memory with 8 ranks at 512 KiB to 4 MiB, NumPy arrays (R0)
# and registered buffers (R1), 5 alternating rounds each (session 32 ran 3: its single
# 1 MiB rounds dipped under MPI).
# OUT=dir bash bench/session35_device.sh
set -u
OUT=${OUT:-$PWD/session35_device}
. bench/device_steps.sh
device_start "$OUT"
SUITE_LIMIT=${SUITE_LIMIT:-280} WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
for R in 0 1; do
  CUDA_VISIBLE_DEVICES= timeout 110 python3 -m acoll.perf all_reduce -N 8 -b 512K -e 4M -f 2 \
    -n 20 -w 5 -R $R --vs mpi --rounds 5 >"$OUT/shm_mpi_R$R.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/shm_mpi_R$R.txt"
  grep -A8 "acoll vs mpi" "$OUT/shm_mpi_R$R.txt" | tail -7
done
