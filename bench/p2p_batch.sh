#!/usr/bin/env bash
# Issue 10 on the GPU host: P2P tests, the GPU suite's P2P-affected tests, and the
# acoll-vs-NCCL benchmarks (in one process and across processes). OUT=dir bash bench/p2p_batch.sh
set -u
OUT=${OUT:-$PWD/p2p_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
SITE=${GPU_SITE:-/tmp/acoll-site}
export PYTHONPATH="$PWD/src:$PWD/tests:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
BUDGET=${BUDGET:-560}
STEPS=${STEPS:-probe tests bench_inproc bench_procs}
failed=0
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -le 10 ]; then echo "== $name: SKIPPED (budget)" | tee "$OUT/$name.txt"; return; fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name: $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  tail -n 40 "$OUT/$name.txt"
  [ "$rc" = 0 ] || failed=1
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; git log -1 --oneline 2>/dev/null; } >"$OUT/machine.txt" 2>&1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1; fi
for s in $STEPS; do
  case $s in
    probe) step probe 60 python3 -c "
import cupy as cp, cupy.cuda.runtime as rt
print('cupy', cp.__version__, 'gpus', rt.getDeviceCount())
for n in ['hostAlloc','hostGetDevicePointer','freeHost','deviceGetPCIBusId','deviceGetByPCIBusId','ipcGetMemHandle','ipcOpenMemHandle','deviceCanAccessPeer','deviceEnablePeerAccess','memsetAsync','malloc']:
    print(n, hasattr(rt, n))
print('bus', rt.deviceGetPCIBusId(0))
try:
    from cupy.cuda import nccl; print('nccl', nccl.get_version())
except Exception as e: print('no cupy nccl', e)
" ;;
    tests) step tests 400 python3 -m pytest -p no:cacheprovider -p no:randomly ${XFLAG:--x} -q -rs --timeout 200 ${TESTS:-tests/test_p2p_gpu.py} ;;
    bench_inproc) step bench_inproc 150 python3 bench/p2p_bench.py inproc --json "$OUT/inproc.json" ${BENCH_ARGS:-} ;;
    bench_procs) step bench_procs 200 python3 bench/p2p_bench.py procs --json "$OUT/procs.json" ${BENCH_ARGS:-} ;;
    *) step "$s" 300 bash -c "$s" ;;
  esac
done
cd "$OUT" && tar czf "$OUT/../p2p_batch.tgz" . && mv "$OUT/../p2p_batch.tgz" "$OUT/"
exit $failed
