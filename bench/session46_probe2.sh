#!/usr/bin/env bash
# Session 46, second device call: stream memory operations under load without acoll
# (bench/memops_stress.py, 1 and 2 processes), then counters_probe.py cases that split
# ring.c's staged mode from the stream memory operations, and count-vs-size runs.
#   OUT=dir bash bench/session46_probe2.sh
set -u
. bench/device_steps.sh
device_start "$OUT"
cc -O1 -g -shared -fPIC -o /tmp/segv_bt.so bench/native/segv_bt.c -ldl
export PYTHONFAULTHANDLER=1
for args in "write 4000" "wait 4000" "late 2000" "none 4000" "--procs 2 write 4000" \
            "--procs 2 wait 4000" "--procs 2 late 2000"; do
  echo "## stress $args" >>"$OUT/stress.txt"
  LD_PRELOAD=/tmp/segv_bt.so timeout 120 python3 bench/memops_stress.py $args \
    >>"$OUT/stress.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/stress.txt"
done
grep "^## \|^== exit\|done\|segv_bt: signal\|CUresult\|Error" "$OUT/stress.txt" | head -40
CASES=${CASES:-mp-up-ringonly mp-up-ringonly-big mp-down-many mp-down-big mp-up-many} \
  bash bench/session46_cases.sh
