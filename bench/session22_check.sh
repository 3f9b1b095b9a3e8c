#!/usr/bin/env bash
# Session 22 (2x H200), after the shared-GPU fix: the whole suite, then the in-process
# prepared A/B with the eager task factory, and the large sizes of every collective
# against NCCL (one process; two processes, buffers registered and not).
# OUT=dir bash bench/session22_check.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/check; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=240 WORKERS=12 device_suite "$S"
export PYTHONUNBUFFERED=1
timeout 80 python3 bench/p2p_prepared_ab.py inproc --rounds 5 --eager \
  --sizes 8,1024,32768,262144 >"$S/ab_inproc_eager.txt" 2>&1
echo "== exit $?" >>"$S/ab_inproc_eager.txt"
grep -h "B  awaited\|exit" "$S/ab_inproc_eager.txt"
big=16M,64M,128M,256M,1G
timeout 100 python3 bench/p2p_bench.py inproc --sizes $big --iters 50 \
  --json "$S/big_inproc.json" >"$S/big_inproc.txt" 2>&1; echo "== exit $?" >>"$S/big_inproc.txt"
timeout 110 python3 bench/p2p_bench.py procs --sizes $big --iters 50 \
  --json "$S/big_procs.json" >"$S/big_procs.txt" 2>&1; echo "== exit $?" >>"$S/big_procs.txt"
timeout 110 python3 bench/p2p_bench.py procs --register --sizes $big --iters 50 \
  --json "$S/big_procs_reg.json" >"$S/big_procs_reg.txt" 2>&1
echo "== exit $?" >>"$S/big_procs_reg.txt"
for f in big_inproc big_procs big_procs_reg; do echo "## $f"; cut -c1-100 "$S/$f.txt"; done
tar czf "$OUT/check.tgz" -C "$S" . && rm -rf "$S"
