#!/usr/bin/env bash
# Session 22 (2x H200), final code: the whole suite; the in-process large sizes with 32,
# 64 (default) and 128 blocks per kernel; small and 16 MiB sizes against NCCL, one
# process and two. OUT=dir bash bench/session22_final.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/final; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=240 WORKERS=12 device_suite "$S"
export PYTHONUNBUFFERED=1
for b in 32 64 128; do
  ACOLL_P2P_BLOCKS=$b timeout 60 python3 bench/p2p_bench.py inproc --sizes 16M,64M,256M \
    --iters 50 >"$S/blocks_$b.txt" 2>&1
  echo "== blocks $b exit $?" >>"$S/blocks_$b.txt"
  grep -h "^all\|^red\|exit" "$S/blocks_$b.txt" | cut -c1-80
done
for where in inproc procs; do
  timeout 100 python3 bench/p2p_bench.py $where --sizes 8,1K,32K,256K,2M,16M --iters 1000 \
    --json "$S/small_$where.json" >"$S/small_$where.txt" 2>&1
  echo "== exit $?" >>"$S/small_$where.txt"
  grep -h "all_reduce\|exit" "$S/small_$where.txt"
done
tar czf "$OUT/final.tgz" -C "$S" . && rm -rf "$S"
