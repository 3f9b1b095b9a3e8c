#!/usr/bin/env bash
# Session 43, the 16-core GPU host, CPU only: a rank whose own buffers are not registered
# falls back from a zero-copy-sized lane call at once, without waiting for its peers' call
# records (before, every rank waited for every record: a barrier ahead of the steps).
# Against the code before it (oldsrc/: src/ at 81c6f54, untracked, travels with the tree):
# the lane and registered-lane tests on Python 3.12, then NumPy and registered-buffer
# all_reduce against Open MPI alternating old and new with 8, 4 and 2 ranks, three times.
# Carry .whl/ (bench/prepare_device.sh). OUT=dir bash bench/session43_device2.sh
set -u
OUT=${OUT:-$PWD/session43_device2}
. bench/device_steps.sh
device_start "$OUT"
device_lane_tests "$OUT"
PASSES=3 RANKS="8 4 2" device_lane_mpi_ab "$OUT"
echo "== done at $SECONDS s"
