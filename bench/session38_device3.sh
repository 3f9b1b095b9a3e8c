#!/usr/bin/env bash
# Session 38, one H200: issue 9's loop-lag target without the stack watchdog (its re-arming
# at every tick lengthened the gaps it measured): five uvloop runs, then two asyncio runs
# whose slow-step log names where each step over 1 ms ran.
# OUT=dir bash bench/session38_device3.sh
set -u
OUT=${OUT:-$PWD/session38_device3}
. bench/device_steps.sh
device_start "$OUT"
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for i in 1 2 3 4 5; do
  timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --gc collect \
    --iters 16 --json "$OUT/clean_$i.json" >/dev/null 2>&1
  echo "== clean $i: exit $? at $SECONDS s"
done
for i in 1 2; do
  timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --loop asyncio \
    --slow-ms 1 --gc collect --iters 16 --json "$OUT/slow_$i.json" >/dev/null 2>&1
  echo "== slow $i: exit $? at $SECONDS s"
done
