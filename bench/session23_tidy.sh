#!/usr/bin/env bash
# Session 23 (one H200): after the last tidy-up (group callers' completion, thread-wait
# set-up): the completion-wait and group GPU tests, thread waits on. OUT=dir bash bench/session23_tidy.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/tidy; mkdir -p "$S"
device_machine "$S"
ACOLL_GPU_WAIT=thread timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
  -p no:benchmark -n 8 tests/test_cuda_kernels.py tests/test_p2p_gpu.py tests/test_groups.py \
  >"$S/tests_thread.txt" 2>&1
echo "== tests exit $?" >>"$S/tests_thread.txt"
tail -3 "$S/tests_thread.txt"
tar czf "$OUT/tidy.tgz" -C "$S" . && rm -rf "$S"
