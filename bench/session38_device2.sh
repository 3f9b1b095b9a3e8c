#!/usr/bin/env bash
# Session 38, one H200: where the GPU stream's loop steps of 1 to 2 ms come from (issue 9's
# loop-lag target; session38_device1 found them on the loop thread's CPU): stacks of every
# gap over 0.9 ms (faulthandler), and asyncio's slow-callback log.
# OUT=dir bash bench/session38_device2.sh
set -u
OUT=${OUT:-$PWD/session38_device2}
. bench/device_steps.sh
device_start "$OUT"
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for i in 1 2; do
  timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --diagnose \
    --gc collect --dump-ms 0.9 --iters 16 --json "$OUT/stacks_$i.json" >/dev/null 2>&1
  echo "== stacks $i: exit $? at $SECONDS s"
done
timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --loop asyncio \
  --slow-ms 1 --gc collect --iters 16 --json "$OUT/slow.json" >/dev/null 2>&1
echo "== slow: exit $? at $SECONDS s"
