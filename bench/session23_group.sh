#!/usr/bin/env bash
# Session 23 (2x H200): acoll.group() (one task drives both GPUs; prepared calls launched at
# the call, awaited at the exit) against NCCL's group calls, the breakdown of a small call,
# then the whole suite. OUT=dir bash bench/session23_group.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/group; mkdir -p "$S"
device_machine "$S"
for b in 8 262144; do
  timeout 100 python3 bench/group_breakdown.py --bytes $b >"$S/breakdown_$b.txt" 2>&1
  echo "== exit $?" >>"$S/breakdown_$b.txt"
done
timeout 100 python3 bench/group_breakdown.py --bytes 8 --loop asyncio >"$S/breakdown_8_asyncio.txt" 2>&1
timeout 200 python3 bench/p2p_bench.py inproc --sizes 8,1K,32K,256K,2M --json "$S/small_group.json" \
  >"$S/small_group.txt" 2>&1; echo "== exit $?" >>"$S/small_group.txt"
timeout 200 python3 bench/p2p_bench.py inproc --sizes 8,1K,32K,256K,2M --drive gather --no-nccl \
  --json "$S/small_gather.json" >"$S/small_gather.txt" 2>&1; echo "== exit $?" >>"$S/small_gather.txt"
timeout 250 python3 bench/p2p_bench.py inproc --sizes 16M,128M,1G --json "$S/big_group.json" \
  >"$S/big_group.txt" 2>&1; echo "== exit $?" >>"$S/big_group.txt"
head -20 "$S"/breakdown_*.txt "$S/small_group.txt" "$S/small_gather.txt" "$S/big_group.txt"
SUITE_LIMIT=220 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
tar czf "$OUT/group.tgz" -C "$S" . && rm -rf "$S"
