#!/usr/bin/env bash
# Session 20, last check on 2x H200 at the final code: the GPU tests of the staged path,
# then the small-op latency (interleaved) and its stages.
# OUT=dir bash bench/session20_last.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/last; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=200 timeout 210 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 150 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_cuda_kernels.py tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 2 "$S/tests.txt"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run2() { timeout 150 python3 -m acoll.run -n "$1" -- python3 "${@:2}"; }
run2 2 bench/gpu_latency_ab.py --bytes 8 --rounds 20 --json "$S/ab_8.json" >"$S/ab_8.txt" 2>&1
run2 2 bench/via_host_stages.py --ops 3000 >"$S/stages.txt" 2>&1
tail -n 7 "$S/stages.txt"; tail -n 1 "$S/ab_8.txt"
tar czf "$OUT/last.tgz" -C "$S" . && rm -rf "$S"
