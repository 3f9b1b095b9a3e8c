#!/usr/bin/env bash
# Session 46, fourth device call: controls for the crash at the 16th counters call (the
# whole-copies path over 60 calls, with and without the setting; ring.c without the
# counters).   OUT=dir bash bench/session46_probe4.sh
set -u
. bench/device_steps.sh
device_start "$OUT"
cc -O1 -g -shared -fPIC -o /tmp/segv_bt.so bench/native/segv_bt.c -ldl
export PYTHONFAULTHANDLER=1
for c in ${CASES:-mp-up-whole-many mp-up-ringonly-nocheck-plainpage-nostage-many mp-up-ringonly-nocheck-plainpage-many}; do
  echo "## $c" >>"$OUT/mp.txt"
  LD_PRELOAD=/tmp/segv_bt.so timeout 90 python3 -m acoll.run -n 2 -- \
    python3 bench/counters_probe.py "$c" >>"$OUT/mp.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/mp.txt"
done
awk '/^## /{c=$2} / op [0-9]+$/{last[c]=$0} /^== exit/{print c, last[c], $0}' "$OUT/mp.txt"
