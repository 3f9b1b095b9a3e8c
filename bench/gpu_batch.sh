#!/usr/bin/env bash
# Issue 9 on the GPU host (1 or 2 H200, python3 3.12 with CuPy 13 / NumPy / torch+NCCL, no
# package registry). Run from the repository root:
#
#     OUT=/some/dir bash bench/gpu_batch.sh        # OUT defaults to ./gpu_out
#
# Writes into $OUT/: pytest output of the GPU tests, acoll-perf tables and JSON (GPU vs
# host busbw at 1-64 MiB with 2 and 4 ranks over TCP, 8 B latency; --vs nccl where there
# is a GPU per rank), the loop-lag measurement and gpu_summary.txt against the targets.
# Every step has its own time limit; the whole batch stays under ~8 minutes. A failing
# step is recorded and the batch goes on (the exit code says whether any failed).
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export ACOLL_TIMEOUT=${ACOLL_TIMEOUT:-60}
SITE=${GPU_SITE:-/tmp/acoll-site}
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
PY=python3
failed=0

BUDGET=${BUDGET:-480}  # seconds; later steps are skipped (and say so) once it is spent

step() {  # step NAME SECONDS COMMAND...: run with a limit, tee into $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "== $name: SKIPPED (batch budget of $BUDGET s spent)" | tee "$OUT/$name.txt"
    failed=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name: $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  tail -n 25 "$OUT/$name.txt"
  [ "$rc" = 0 ] || failed=1
}

{
  date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, \
'numpy', numpy.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount())"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  git log -1 --oneline 2>/dev/null || true
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
NGPUS=$($PY -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)

# 1. The GPU tests except the collective matrices (make test-gpu installs the carried
#    wheels first): space, torch/DLPack, stream=, errors, bit-identity, loop lag, acoll-perf.
step tests_gpu 200 make test-gpu \
  PYTEST_ARGS="-m gpu -rs -v --durations=15 -k 'not matrix' tests/test_gpu.py tests/test_cuda_kernels.py"

# 2. busbw: GPU vs host buffers, 2 and 4 ranks in separate processes over TCP (~1 min each).
PERF="$PY -m acoll.perf all_reduce -b 1M -e 64M -f 4 -n 10 -w 3 -d float32 -o sum"
for n in 2 4; do
  for dev in cuda cpu; do
    tag=$([ $dev = cuda ] && echo gpu || echo host)
    step busbw_${tag}_${n}ranks 120 $PERF -N $n --device $dev --timeout 110 \
      --json "$OUT/busbw_${tag}_${n}ranks.json"
  done
done
# 8 B latency (awaited, per op).
for n in 2 4; do
  for dev in cuda cpu; do
    tag=$([ $dev = cuda ] && echo gpu || echo host)
    step lat_${tag}_${n}ranks 60 $PY -m acoll.perf all_reduce -b 8 -e 8 -n 300 -w 30 \
      -N $n --device $dev --timeout 55 --json "$OUT/lat_${tag}_${n}ranks.json"
  done
done
# NCCL on the same sizes needs a GPU per rank (NCCL refuses two ranks on one GPU).
if [ "$NGPUS" -ge 2 ]; then
  step busbw_gpu_2ranks_vs_nccl 150 $PERF -N 2 --device cuda --vs nccl --timeout 140 \
    --json "$OUT/busbw_gpu_2ranks_vs_nccl.json"
else
  echo "== vs nccl: skipped, $NGPUS GPU(s): NCCL needs one GPU per rank" | tee "$OUT/vs_nccl.txt"
fi

# 3. Loop lag during 64 MiB GPU all_reduces, and awaited 8 B latency, 2 processes.
step loop_lag 120 $PY -m acoll.run -n 2 -- $PY bench/gpu_loop_lag.py --json "$OUT/loop_lag.json"

# 4. The seed program on GPUs when MPI is there (one rank per visible GPU per process).
if command -v mpirun >/dev/null && $PY -c "import mpi4py" 2>/dev/null; then
  step seed_program 90 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 2 --oversubscribe $PY examples/seed_program.py --gpus --count 4194304
fi

# 5. The collective matrices (1 GPU shared by 2-4 ranks, 2 GPUs, processes), asyncio only,
#    with whatever the budget leaves (each test prints as it passes).
step tests_gpu_matrix 330 make test-gpu \
  PYTEST_ARGS="-m gpu -rs -v --durations=10 -k 'matrix and not uvloop' tests/test_gpu.py"

$PY bench/gpu_summary.py "$OUT"
# One archive: a remote runner may hand back only a few files.
tar czf /tmp/gpu_batch.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_batch.tgz "$OUT/"
echo "batch done: failed=$failed; results in $OUT/gpu_batch.tgz"
exit $failed
