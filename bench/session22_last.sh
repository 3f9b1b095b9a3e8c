#!/usr/bin/env bash
# Session 22 (2x H200), final defaults (128 blocks, 256 MiB workspace): the whole suite;
# every collective against NCCL, one process (uvloop) and two (registered and not), 8 B to
# 1 GiB; the prepared/general A/B in one process on uvloop. OUT=dir bash bench/session22_last.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/last; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=240 WORKERS=12 device_suite "$S"
export PYTHONUNBUFFERED=1
timeout 60 python3 bench/p2p_prepared_ab.py inproc --uvloop --rounds 5 \
  --sizes 8,1024,32768,262144 >"$S/ab_inproc_uvloop.txt" 2>&1
grep -h "B  awaited" "$S/ab_inproc_uvloop.txt" | cut -c1-120
for where in inproc procs; do
  timeout 100 python3 bench/p2p_bench.py $where --sizes 8,1K,32K,256K,2M,16M,64M --iters 1000 \
    --json "$S/small_$where.json" >"$S/small_$where.txt" 2>&1
  echo "== exit $?" >>"$S/small_$where.txt"
done
timeout 100 python3 bench/p2p_bench.py inproc --sizes 128M,256M,1G --iters 2000 \
  --json "$S/big_inproc.json" >"$S/big_inproc.txt" 2>&1
for reg in "" --register; do
  f="$S/big_procs${reg:+_reg}"
  timeout 100 python3 bench/p2p_bench.py procs $reg --sizes 16M,64M,128M,256M,1G --iters 2000 \
    --json "$f.json" >"$f.txt" 2>&1
  echo "== exit $?" >>"$f.txt"
done
for f in "$S"/small_*.txt "$S"/big_*.txt; do echo "## $(basename $f)"; grep -h "^#\|^all\|^red\|exit" "$f" | cut -c1-132; done
tar czf "$OUT/last.tgz" -C "$S" . && rm -rf "$S"
