#!/usr/bin/env bash
# Session 39, the 16-core GPU host, CPU only: a zero-copy all_reduce copies rank k's part
# once rank k finished phase 1 (not once every rank did), starting with the next rank's.
# Against the code before it (oldsrc/: src/ at 6f51edf, carried untracked):
# the lane and registered-lane tests on Python 3.12, registered-buffer all_reduce against
# Open MPI alternating old and new with 8, 4 and 2 ranks, twice, and the new code's waits.
# (Run in session 40: the device was not lent at the end of session 39.)
# Carry .whl/ (bench/prepare_device.sh): the host's own pytest-asyncio cannot read the suite's
# config. OUT=dir bash bench/session39_device4.sh
set -u
OUT=${OUT:-$PWD/session39_device4}
. bench/device_steps.sh
device_start "$OUT"
device_lane_tests "$OUT"
RANKS="8 4 2" device_lane_mpi_ab "$OUT"
for n in 8 4; do
  echo "## new, $n ranks, REG=1, BIND=core" >>"$OUT/waits.txt"
  CUDA_VISIBLE_DEVICES= timeout 60 python3 -m acoll.run -n $n -- env REG=1 BIND=core K=200 \
    python3 bench/lane_waits.py 512K 1M 2M >>"$OUT/waits.txt" 2>&1
done
