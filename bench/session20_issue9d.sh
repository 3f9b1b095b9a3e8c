#!/usr/bin/env bash
# Session 20, issue 9 (2x H200), after the ring's copies were pipelined with it: GPU tests
# of the staged path, busbw in alternating rounds (host, GPU), small-op latency, loop lag.
# OUT=dir bash bench/session20_issue9d.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/issue9d; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=200 timeout 210 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 150 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 2 "$S/tests.txt"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
perf() { timeout 100 python3 -m acoll.perf all_reduce --timeout 95 "$@"; }
for r in 1 2 3; do
  for n in 2 4; do
    for dev in cpu cuda; do
      perf -b 1M -e 64M -f 4 -n 16 -w 3 -N $n --device $dev >"$S/busbw_${n}_${dev}_r$r.txt" 2>&1
    done
  done
done
run2() { timeout 150 python3 -m acoll.run -n "$1" -- python3 "${@:2}"; }
run2 2 bench/via_host_stages.py --ops 3000 >"$S/stages.txt" 2>&1
run2 2 bench/gpu_latency_ab.py --bytes 8 --rounds 20 --json "$S/ab_8.json" >"$S/ab_8.txt" 2>&1
run2 2 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --gc collect \
  --json "$S/lag_collect.json" >"$S/lag_collect.txt" 2>&1
tail -n 8 "$S/stages.txt"; tail -n 1 "$S/ab_8.txt"
tar czf "$OUT/issue9d.tgz" -C "$S" . && rm -rf "$S"
