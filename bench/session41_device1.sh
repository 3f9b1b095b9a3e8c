#!/usr/bin/env bash
# Session 41, the 16-core GPU host, CPU only: StepPlan folds (or copies) each peer's piece
# as soon as it arrived, in rank order, instead of waiting for every peer of a step first.
# Against the code before it (oldsrc/: src/ at e55e23f, untracked, travels with the tree):
# the lane and registered-lane tests on Python 3.12, then NumPy and registered-buffer
# all_reduce against Open MPI alternating old and new with 8, 4 and 2 ranks, three times.
# Carry .whl/ (bench/prepare_device.sh). OUT=dir bash bench/session41_device1.sh
set -u
OUT=${OUT:-$PWD/session41_device1}
. bench/device_steps.sh
device_start "$OUT"
device_lane_tests "$OUT"
PASSES=3 RANKS="8 4 2" device_lane_mpi_ab "$OUT"
echo "== done at $SECONDS s"
