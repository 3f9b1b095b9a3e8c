#!/usr/bin/env bash
# Session 22 (2x H200): prepared P2P calls (issue 10). The P2P and GPU tests, then the
# prepared route against the general route (interleaved) and against NCCL, one process
# and two. OUT=dir bash bench/session22_prepared.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/prep; mkdir -p "$S"
device_machine "$S"
timeout 250 make test-gpu PYTEST_ARGS="-q -n 8 --dist loadgroup -p no:randomly \
  -p no:benchmark -rs --timeout 200 tests/test_p2p_gpu.py tests/test_p2p.py tests/test_gpu.py" \
  >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 3 "$S/tests.txt"
export PYTHONUNBUFFERED=1
timeout 100 python3 bench/p2p_prepared_ab.py inproc --rounds 5 --profile >"$S/ab_inproc.txt" 2>&1
echo "== exit $?" >>"$S/ab_inproc.txt"
timeout 100 python3 -m acoll.run -n 2 -- python3 bench/p2p_prepared_ab.py procs --rounds 5 \
  --profile --uvloop >"$S/ab_procs.txt" 2>&1
echo "== exit $?" >>"$S/ab_procs.txt"
grep -h "B  awaited\|exit\|bare" "$S"/ab_*.txt
for where in inproc procs; do
  timeout 110 python3 bench/p2p_bench.py $where --sizes 8,1K,32K,256K,16M,64M --iters 1000 \
    --json "$S/bench_$where.json" >"$S/bench_$where.txt" 2>&1
  echo "== exit $?" >>"$S/bench_$where.txt"
  grep -h "all_reduce\|exit" "$S/bench_$where.txt"
done
tar czf "$OUT/prep.tgz" -C "$S" . && rm -rf "$S"
