#!/usr/bin/env bash
# Session 23 (one H200): the whole suite after the second review's fixes, then the GPU tests with
# ACOLL_GPU_WAIT=thread. OUT=dir bash bench/session23_after_review2.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/after_review2; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=220 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
ACOLL_GPU_WAIT=thread timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
  -p no:benchmark -n 8 tests/test_gpu.py tests/test_p2p_gpu.py tests/test_cuda_kernels.py \
  >"$S/tests_thread.txt" 2>&1
echo "== tests exit $?" >>"$S/tests_thread.txt"
tail -3 "$S/tests_thread.txt"
tar czf "$OUT/after_review2.tgz" -C "$S" . && rm -rf "$S"
