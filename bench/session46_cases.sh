#!/usr/bin/env bash
# Session 46: cases of bench/counters_probe.py (see its docstring), each under
# acoll.run -n 2 with bench/native/segv_bt.c preloaded and faulthandler on, into
# OUT/mp.txt; prints each case's last call and exit.
#   OUT=dir CASES="mp-up-many mp-up-whole-many" bash bench/session46_cases.sh
set -u
. bench/device_steps.sh
[ -f "$OUT/machine.txt" ] || device_start "$OUT"
[ -f /tmp/segv_bt.so ] || cc -O1 -g -shared -fPIC -o /tmp/segv_bt.so bench/native/segv_bt.c -ldl
export PYTHONFAULTHANDLER=1
for c in $CASES; do
  echo "## $c" >>"$OUT/mp.txt"
  LD_PRELOAD=/tmp/segv_bt.so timeout 90 python3 -m acoll.run -n 2 -- \
    python3 bench/counters_probe.py "$c" >>"$OUT/mp.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/mp.txt"
done
awk '/^## /{c=$2} / op [0-9]+$/{last[c]=$0} /^== exit/{print c, last[c], $0}' "$OUT/mp.txt"
