#!/usr/bin/env bash
# Issue 11 part 2: the TCP path at 2, 4 and 8 ranks with and without the send thread
# (ACOLL_SOCKET_SEND_THREADS=0/1), then acoll-perf --vs gloo with the default (auto).
# OUT=dir bash bench/tcp_threads.sh   (CPU only; on the 16-core GPU host)
set -u
OUT=${OUT:-$PWD/tcp_threads_out}
mkdir -p "$OUT"
SITE=${GPU_SITE:-/tmp/acoll-site}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1; fi
export PYTHONPATH="$PWD/src:$SITE" PATH="$SITE/bin:$PATH" CUDA_VISIBLE_DEVICES=
export ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
{ date -u; nproc; python3 --version; git log --oneline -1 2>/dev/null; } >"$OUT/machine.txt" 2>&1
for n in ${RANKS:-2 4 8}; do
  for size in 2M 16M 64M; do
    for t in 0 1; do
      echo "## $n ranks, $size, ACOLL_SOCKET_SEND_THREADS=$t" >>"$OUT/breakdown.txt"
      ACOLL_SOCKET_SEND_THREADS=$t timeout 120 python3 -m acoll.run -n "$n" -- \
        python3 bench/tcp_rank_loop.py "$size" 20 2>&1 | sort >>"$OUT/breakdown.txt"
    done
  done
done
for n in ${PERF_RANKS:-4 8}; do
  timeout 150 python3 -m acoll.perf all_reduce -N "$n" -b 256K -e 64M -f 4 -n 10 -w 3 --vs gloo \
    >"$OUT/tcp_vs_gloo_${n}.txt" 2>&1
  echo "== tcp vs gloo, $n ranks: exit $?" >>"$OUT/tcp_vs_gloo_${n}.txt"
done
echo "tcp_threads: done" >>"$OUT/breakdown.txt"
