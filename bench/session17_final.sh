#!/usr/bin/env bash
# Final device check of session 17 (2x H200, Python 3.12): the whole suite; the P2P path
# against NCCL; issue 9's 8 B latency over the staged path (GPU vs host buffers).
# OUT=dir bash bench/session17_final.sh   (writes $OUT/final.tgz and a few text files)
set -u
OUT=${OUT:-$PWD/session17_final}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 ACOLL_TIMEOUT=${ACOLL_TIMEOUT:-60}
SITE=${GPU_SITE:-/tmp/acoll-site}
W=$(mktemp -d)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 --version; git log -1 --oneline 2>/dev/null; } >"$W/machine.txt" 2>&1
t0=$SECONDS
timeout --kill-after=10 ${SUITE_LIMIT:-300} make test-gpu \
  PYTEST_ARGS="-q -n ${WORKERS:-12} --dist loadgroup -p no:randomly -p no:benchmark -rs --timeout 300" \
  >"$W/suite.txt" 2>&1
echo "== suite: exit $? after $((SECONDS - t0)) s" | tee -a "$W/suite.txt"
tail -n 3 "$W/suite.txt"
export PYTHONPATH="$PWD/src:$PWD/tests:$SITE" PATH="$SITE/bin:$PATH"
for where in inproc procs; do
  timeout 120 python3 bench/p2p_bench.py $where --iters 50 --json "$W/p2p_$where.json" \
    >"$W/p2p_$where.txt" 2>&1
  echo "== p2p $where: exit $?" >>"$W/p2p_$where.txt"
done
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for round in 1 2; do
  for dev in cuda cpu; do
    timeout 60 python3 -m acoll.perf all_reduce -b 8 -e 8 -n 300 -w 30 -N 2 --device $dev \
      --timeout 55 >"$W/lat_${dev}_2ranks_round$round.txt" 2>&1
  done
done
grep -h -E "^ +8 " "$W"/lat_*_2ranks_round*.txt /dev/null | head
tar czf "$OUT/final.tgz" -C "$W" . && cp "$W/suite.txt" "$W/p2p_inproc.txt" "$W/p2p_procs.txt" "$OUT/"
for f in "$W"/lat_*; do echo "== $(basename $f)"; grep -E "^ +8 |ranks" "$f"; done >"$OUT/lat_summary.txt"
cat "$OUT/lat_summary.txt"
echo "== final batch done after $((SECONDS - t0)) s"
