#!/usr/bin/env bash
# Session 21, issue 9 (2x H200), after the direct path took every size: the GPU tests of
# the staged path, the via-host paths side by side (2 ranks; 4 ranks one per process and
# two per process), and the loop's lag during 64 MiB GPU all_reduces.
# OUT=dir bash bench/session21_paths.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/paths; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=200 timeout 210 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 150 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 2 "$S/tests.txt"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 150 python3 -m acoll.run -n "$1" -- "${@:2}"; }
P="python3 bench/via_host_paths.py --mib 1 4 16 64"
run 2 $P >"$S/paths_2.txt" 2>&1; grep -v "^\[rank [1-9]" "$S/paths_2.txt" | tail -n 70
run 4 $P >"$S/paths_4.txt" 2>&1
ACOLL_INPROC_DISABLE=1 run 2 $P --per-proc 2 >"$S/paths_4_shared.txt" 2>&1
grep -h "ranks\|##\|  gpu " "$S/paths_4.txt" "$S/paths_4_shared.txt"
run 2 python3 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --gc collect \
  --json "$S/lag_collect.json" >"$S/lag_collect.txt" 2>&1; tail -n 6 "$S/lag_collect.txt"
tar czf "$OUT/paths.tgz" -C "$S" . && rm -rf "$S"
