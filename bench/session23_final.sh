#!/usr/bin/env bash
# Session 23 (2x H200): the whole suite at the last code commit (acoll.group() after the
# review's fixes), then the group breakdown once more, and under cProfile.
# OUT=dir bash bench/session23_final.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/final; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=220 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
for b in 8 1024; do
  timeout 100 python3 bench/group_breakdown.py --bytes $b >"$S/breakdown_$b.txt" 2>&1
  echo "== exit $?" >>"$S/breakdown_$b.txt"
done
timeout 100 python3 bench/group_breakdown.py --bytes 8 --no-nccl --profile >"$S/profile_8.txt" 2>&1
cat "$S"/breakdown_*.txt; head -12 "$S/profile_8.txt"
tar czf "$OUT/final.tgz" -C "$S" . && rm -rf "$S"
