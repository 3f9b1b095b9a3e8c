#!/usr/bin/env bash
# Session 46, third device call: counters_probe.py variants that split the counters'
# first-use check, the page-locked page and ring.c's staged mode (see its docstring).
#   OUT=dir bash bench/session46_probe3.sh
set -u
. bench/device_steps.sh
device_start "$OUT"
cc -O1 -g -shared -fPIC -o /tmp/segv_bt.so bench/native/segv_bt.c -ldl
export PYTHONFAULTHANDLER=1
for c in ${CASES:-mp-up-ringonly-many mp-up-ringonly-nocheck-many mp-up-ringonly-nocheck-plainpage-many mp-up-ringonly-keepcheck-many mp-both-keepcheck-many}; do
  echo "## $c" >>"$OUT/mp.txt"
  LD_PRELOAD=/tmp/segv_bt.so timeout 90 python3 -m acoll.run -n 2 -- \
    python3 bench/counters_probe.py "$c" >>"$OUT/mp.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/mp.txt"
done
awk '/^## /{c=$2} / op [0-9]+$/{last[c]=$0} /^== exit/{print c, last[c], $0}' "$OUT/mp.txt"
