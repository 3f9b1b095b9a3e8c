#!/usr/bin/env bash
# Session 22 (2x H200): the GPU loop-lag test alone, four times (it failed once at 15.8 ms
# against its 15 ms bound in the 12-worker suite run of review/), printing the worst gap.
# OUT=dir bash bench/session22_lag.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/lag; mkdir -p "$S"
device_machine "$S"
for i in 1 2 3 4; do
  timeout 100 python3 -m pytest -q -s -p no:randomly -p no:benchmark -p no:cacheprovider \
    "tests/test_gpu.py::test_loop_lag_during_large_gpu_all_reduces" >>"$S/lag.txt" 2>&1
  echo "== run $i exit $?" >>"$S/lag.txt"
done
grep -h "worst loop gap\|== run\|passed\|failed" "$S/lag.txt"
tar czf "$OUT/lag.tgz" -C "$S" . && rm -rf "$S"
