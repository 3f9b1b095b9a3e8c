#!/usr/bin/env bash
# Session 20, issue 9 (2x H200): the staged path over TCP (P2P and SHM off) after the
# changes. Interleaved 8 B latency (GPU vs host communicators in the same processes),
# ranks in one loop, busbw in alternating rounds (host, GPU), the loop's lag (heap as
# is, GPU first and host first; collected; frozen), and the GPU tests of the staged path.
# OUT=dir bash bench/session20_issue9b.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/issue9b; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run2() { timeout 150 python3 -m acoll.run -n "$1" -- python3 "${@:2}"; }
for b in 8 4096 65536; do
  run2 2 bench/gpu_latency_ab.py --bytes $b --rounds 20 --json "$S/ab_$b.json" >"$S/ab_$b.txt" 2>&1
done
timeout 120 python3 bench/via_host_probe.py ranks -n 2000 >"$S/ranks.txt" 2>&1
perf() { timeout 100 python3 -m acoll.perf all_reduce --timeout 95 "$@"; }
for r in 1 2 3; do
  for n in 2 4; do
    for dev in cpu cuda; do
      perf -b 1M -e 64M -f 4 -n 16 -w 3 -N $n --device $dev >"$S/busbw_${n}_${dev}_r$r.txt" 2>&1
    done
  done
done
for g in asis collect freeze; do
  run2 2 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --gc $g \
    --json "$S/lag_$g.json" >"$S/lag_$g.txt" 2>&1
done
run2 2 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --host-first \
  --json "$S/lag_asis_hostfirst.json" >"$S/lag_asis_hostfirst.txt" 2>&1
unset ACOLL_P2P_DISABLE ACOLL_SHM_DISABLE ACOLL_NET
SUITE_LIMIT=240 timeout 250 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark \
  -rs --timeout 200 tests/test_gpu.py tests/test_staging.py tests/test_cuda_space_cpu.py \
  tests/test_cuda_kernels.py tests/test_memory.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"
tail -3 "$S/tests.txt"
tar czf "$OUT/issue9b.tgz" -C "$S" . && rm -rf "$S"
