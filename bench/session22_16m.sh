#!/usr/bin/env bash
# Session 22 (2x H200), 128 blocks: 16 and 64 MiB of every collective with more
# iterations (250 and 62) than the large sweeps (12 and 5) against NCCL; one process, two
# processes registered and not. OUT=dir bash bench/session22_16m.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/m16; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1
for round in 1 2; do
  timeout 80 python3 bench/p2p_bench.py inproc --sizes 16M,64M --iters 1000 \
    --json "$S/inproc_$round.json" >"$S/inproc_$round.txt" 2>&1
  timeout 80 python3 bench/p2p_bench.py procs --sizes 16M,64M --iters 1000 \
    --json "$S/procs_$round.json" >"$S/procs_$round.txt" 2>&1
  timeout 80 python3 bench/p2p_bench.py procs --register --sizes 16M,64M --iters 1000 \
    --json "$S/procs_reg_$round.json" >"$S/procs_reg_$round.txt" 2>&1
done
for f in "$S"/*.txt; do echo "## $(basename $f)"; grep -h "^all\|^red" "$f" | cut -c1-80; done
tar czf "$OUT/m16.tgz" -C "$S" . && rm -rf "$S"
