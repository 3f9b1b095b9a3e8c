#!/usr/bin/env bash
# Session 20, issue 9 (2x H200), after the tight first poll: stages of the small direct
# via-host path, interleaved 8 B latency, and the GPU tests of the staged path.
# OUT=dir bash bench/session20_issue9c.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/issue9c; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run2() { timeout 150 python3 -m acoll.run -n "$1" -- python3 "${@:2}"; }
run2 2 bench/via_host_stages.py --ops 3000 >"$S/stages.txt" 2>&1
for r in 1 2; do
  run2 2 bench/gpu_latency_ab.py --bytes 8 --rounds 20 --json "$S/ab_8_r$r.json" >"$S/ab_8_r$r.txt" 2>&1
done
run2 2 bench/via_host_stages.py --ops 3000 >"$S/stages2.txt" 2>&1
unset ACOLL_P2P_DISABLE ACOLL_SHM_DISABLE ACOLL_NET
SUITE_LIMIT=240 timeout 250 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 200 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_cuda_kernels.py tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"
tail -3 "$S/tests.txt"; cat "$S/stages.txt" "$S/stages2.txt"; for f in "$S"/ab_8_r*.txt; do tail -n 1 "$f"; done
tar czf "$OUT/issue9c.tgz" -C "$S" . && rm -rf "$S"
