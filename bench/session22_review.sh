#!/usr/bin/env bash
# Session 22 (2x H200), after the review's fixes (awaited prepared calls launch on the
# communicator's stream; tickets; close/deregister gather launches): the whole suite, the
# prepared/general A/B and the small sizes against NCCL, one process and two.
# OUT=dir bash bench/session22_review.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/review; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=240 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
export PYTHONUNBUFFERED=1
timeout 60 python3 -m acoll.run -n 2 -- python3 bench/p2p_prepared_ab.py procs --uvloop \
  --rounds 5 --sizes 8,1024,32768,262144 >"$S/ab_procs.txt" 2>&1
timeout 60 python3 bench/p2p_prepared_ab.py inproc --uvloop --rounds 5 \
  --sizes 8,1024,32768,262144 >"$S/ab_inproc.txt" 2>&1
grep -h "B  awaited" "$S"/ab_*.txt | cut -c1-130
for where in procs inproc; do
  timeout 90 python3 bench/p2p_bench.py $where --sizes 8,1K,32K,256K,2M,16M --iters 1000 \
    --json "$S/small_$where.json" >"$S/small_$where.txt" 2>&1
  echo "== exit $?" >>"$S/small_$where.txt"
  grep -h "^#\|all_reduce\|exit" "$S/small_$where.txt"
done
tar czf "$OUT/review.tgz" -C "$S" . && rm -rf "$S"
