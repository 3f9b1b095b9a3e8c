#!/usr/bin/env bash
# Issue 11 on the 16-core GPU host, CPU only: host-buffer all_reduce with 2, 4 and 8 ranks over
# shared memory (vs Open MPI) and over TCP only (vs Gloo). OUT=dir bash bench/cpu16_sweep.sh
set -u
OUT=${OUT:-$PWD/cpu16_out}
mkdir -p "$OUT"
SITE=${GPU_SITE:-/tmp/acoll-site}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1; fi
export PYTHONPATH="$PWD/src:$SITE" PATH="$SITE/bin:$PATH" CUDA_VISIBLE_DEVICES=
{ date -u; nproc; python3 --version; mpirun --version | head -1; } >"$OUT/machine.txt" 2>&1
for n in ${RANKS:-2 4 8}; do
  timeout 100 python3 -m acoll.perf all_reduce -N $n -b 8 -e 64M -f 8 -n 10 -w 3 --vs mpi \
    >"$OUT/shm_vs_mpi_${n}.txt" 2>&1
  echo "== shm vs mpi, $n ranks: exit $?" | tee -a "$OUT/shm_vs_mpi_${n}.txt"
  ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 100 python3 -m acoll.perf all_reduce -N $n -b 8 \
    -e 64M -f 8 -n 10 -w 3 --vs gloo >"$OUT/tcp_vs_gloo_${n}.txt" 2>&1
  echo "== tcp vs gloo, $n ranks: exit $?" | tee -a "$OUT/tcp_vs_gloo_${n}.txt"
done
