#!/usr/bin/env bash
# Session 23 (one H200): after the fix (no pair of local launches while a kernel module
# loads): the shared-GPU group tests three times each with CUDA_MODULE_LOADING=EAGER and
# LAZY (faulthandler dumps stacks 6 s into a test), the whole suite, the group breakdown.
# OUT=dir bash bench/session23_check.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/check; mkdir -p "$S"
device_machine "$S"
for mode in EAGER LAZY; do
  for i in 1 2 3; do
    CUDA_MODULE_LOADING=$mode ACOLL_TIMEOUT=10 PYTHONPATH="$PWD/src:$PWD/tests:$SITE" \
      timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
      -o faulthandler_timeout=6 tests/test_p2p_gpu.py \
      -k "one_task_drives or group_of_different" >"$S/${mode}_$i.txt" 2>&1
    echo "== exit $?" >>"$S/${mode}_$i.txt"
  done
done
grep -h "passed\|failed" "$S"/EAGER_*.txt "$S"/LAZY_*.txt
grep -l "Timeout (0:00:06)" "$S"/*.txt
SUITE_LIMIT=220 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
timeout 100 python3 bench/group_breakdown.py --bytes 8 >"$S/breakdown_8.txt" 2>&1
cat "$S/breakdown_8.txt"
tar czf "$OUT/check.tgz" -C "$S" . && rm -rf "$S"
