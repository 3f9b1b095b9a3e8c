#!/usr/bin/env bash
# Session 21 (2x H200), pipelined copies by default: the GPU, staging and CUDA-space tests,
# then the via-host paths with 4 ranks (two processes per GPU), 1 to 16 MiB.
# OUT=dir bash bench/session21_check2.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/check2; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=150 timeout 160 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 120 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 2 "$S/tests.txt"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 100 python3 -m acoll.run -n "$1" -- "${@:2}"; }
run 4 python3 bench/via_host_paths.py --mib 1 4 16 --rounds 4 >"$S/paths_4.txt" 2>&1
grep -h "ranks\|##\|  gpu" "$S/paths_4.txt"
tar czf "$OUT/check2.tgz" -C "$S" . && rm -rf "$S"
