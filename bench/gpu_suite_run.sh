#!/usr/bin/env bash
# The whole suite on the GPU host (its python3 3.12 + carried wheels), then the registered
# P2P benchmark across processes. OUT=dir bash bench/gpu_suite_run.sh
set -u
OUT=${OUT:-$PWD/gpu_suite_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 --version; git log -1 --oneline 2>/dev/null; } >"$OUT/machine.txt" 2>&1
t0=$SECONDS
timeout --kill-after=10 ${SUITE_LIMIT:-420} make test-gpu \
  PYTEST_ARGS="-q -n ${WORKERS:-12} --dist loadgroup -p no:randomly -p no:benchmark -rs --timeout 300 ${SUITE_ARGS:-}" \
  >"$OUT/suite.txt" 2>&1
echo "== suite: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/suite.txt"
tail -n 15 "$OUT/suite.txt"
if [ -n "${BENCH:-1}" ]; then
  PYTHONPATH=$PWD/src:$PWD/tests timeout ${BENCH_LIMIT:-100} python3 bench/p2p_bench.py procs --register \
    --iters 50 --sizes 16M,64M,128M,256M,1G --json "$OUT/procs_registered_64m.json" >"$OUT/procs_registered_64m.txt" 2>&1
  cat "$OUT/procs_registered_64m.txt"
fi
