#!/usr/bin/env bash
# Session 38, the 16-core GPU host, CPU only: lane ops that yield at the same (even) op on
# every rank (Lane.yields_before), against the code before it (oldsrc/: src/ at ba2e8fc,
# carried untracked): the lane and loop-lag tests, then registered-buffer all_reduce
# against Open MPI, alternating, 2 and 8 ranks.
# OUT=dir bash bench/session38_device5.sh
set -u
OUT=${OUT:-$PWD/session38_device5}
. bench/device_steps.sh
device_start "$OUT"
PYTHONPATH="$PWD/src:$PWD/tests:$SITE" CUDA_VISIBLE_DEVICES= timeout 200 python3 -m pytest -q \
  -n 12 -p no:randomly -p no:benchmark -p no:cacheprovider --timeout 150 tests/test_lane.py \
  tests/test_lane_registered.py tests/test_loop_lag.py >"$OUT/tests.txt" 2>&1
echo "== tests: exit $? at $SECONDS s" | tee -a "$OUT/tests.txt"; tail -n 3 "$OUT/tests.txt"
device_lane_mpi_ab "$OUT"
grep -v "^== " "$OUT/pair_ab.txt" | grep "##\|   [01] MiB"
