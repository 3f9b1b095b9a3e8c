#!/usr/bin/env bash
# Issue 11 part 2: where does a large all_reduce's time go over TCP with 4 and 8 ranks?
# Per-rank breakdowns (bench/tcp_rank_loop.py), chunk sizes, and a py-spy profile of rank 0.
# OUT=dir bash bench/tcp_profile.sh   (CPU only; on the 16-core GPU host)
set -u
OUT=${OUT:-$PWD/tcp_profile_out}
mkdir -p "$OUT"
SITE=${GPU_SITE:-/tmp/acoll-site}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1; fi
export PYTHONPATH="$PWD/src:$SITE" PATH="$SITE/bin:$PATH" CUDA_VISIBLE_DEVICES=
export ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
{ date -u; nproc; python3 --version; git log --oneline -1 2>/dev/null; } >"$OUT/machine.txt" 2>&1
run() {  # label, ranks, size, iters, env...
  local label=$1 n=$2 size=$3 iters=$4; shift 4
  echo "## $label: $n ranks, $size, $* " >>"$OUT/breakdown.txt"
  env "$@" timeout 120 python3 -m acoll.run -n "$n" -- python3 bench/tcp_rank_loop.py "$size" "$iters" \
    2>&1 | sort >>"$OUT/breakdown.txt"
}
for n in ${RANKS:-4 8}; do
  for size in 2M 16M 64M; do run base "$n" "$size" 20; done
  for chunk in 128K 2M 8M; do run chunk "$n" 16M 20 ACOLL_CHUNK_SIZE=$chunk; done
  run asyncio "$n" 16M 20 LOOP=asyncio
done
for n in ${RANKS:-4 8}; do
  SPY_OUT="$OUT/spy_rank0_${n}.txt" timeout 120 python3 -m acoll.run -n "$n" -- \
    bash bench/spy_rank0.sh python3 bench/tcp_rank_loop.py 16M 40 >"$OUT/spy_run_${n}.txt" 2>&1
done
echo "tcp_profile: done" >>"$OUT/breakdown.txt"
