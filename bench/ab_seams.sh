#!/usr/bin/env bash
# Issue 8 A/B: the code before the seams (ab_pre8/src, an untracked copy of commit 5e355ab)
# against this tree, alternating, same machine and hour. CPU only, separate processes
# (acoll-perf -N) and ranks of one loop (bench/one_loop.py). Output: $OUT/ab_seams.txt
set -u
OUT=${OUT:-$PWD/ab_out}
mkdir -p "$OUT"
log="$OUT/ab_seams.txt"
{ date -u; hostname; nproc; python3 --version; } >"$log"
for round in 1 2; do
  for side in before after; do
    src=$([ $side = before ] && echo "$PWD/ab_pre8/src" || echo "$PWD/src")
    for n in 2 4 8; do
      echo "### $side round $round: acoll-perf all_reduce -N $n" >>"$log"
      PYTHONPATH=$src timeout 150 python3 -m acoll.perf all_reduce -N $n -b 8 -e 64M -f 8 \
        -n 20 -w 5 -d float32 -o sum >>"$log" 2>&1
    done
    for n in 2 4; do
      echo "### $side round $round: one_loop -N $n" >>"$log"
      PYTHONPATH=$src timeout 120 python3 bench/one_loop.py -N $n -e 64M >>"$log" 2>&1
    done
  done
done
echo "### after, in-process transport off: one_loop -N 2 / 4" >>"$log"
for n in 2 4; do
  ACOLL_INPROC_DISABLE=1 PYTHONPATH=$PWD/src timeout 120 python3 bench/one_loop.py -N $n \
    -e 64M >>"$log" 2>&1
done
echo done >>"$log"
