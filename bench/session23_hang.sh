#!/usr/bin/env bash
# Session 23 (one H200): where the loop thread blocks when a group test of two ranks on one
# GPU hangs (CUDA_MODULE_LOADING=EAGER made it fail 3 times in 5): pytest's faulthandler
# dumps every thread's stack 6 s into the test. OUT=dir bash bench/session23_hang.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/hang; mkdir -p "$S"
device_machine "$S"
export ACOLL_TIMEOUT=10 PYTHONPATH="$PWD/src:$PWD/tests:$SITE"
for mode in EAGER LAZY; do
  for i in 1 2 3; do
    CUDA_MODULE_LOADING=$mode timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
      -o faulthandler_timeout=6 tests/test_p2p_gpu.py \
      -k "one_task_drives or group_of_different" >"$S/${mode}_$i.txt" 2>&1
    echo "== exit $?" >>"$S/${mode}_$i.txt"
  done
done
grep -h "passed\|failed" "$S"/*.txt
grep -l "Timeout (0:00:06)" "$S"/*.txt
tar czf "$OUT/hang.tgz" -C "$S" . && rm -rf "$S"
