#!/usr/bin/env bash
# Session 20, first device call (1x H200): where a small GPU all_reduce over TCP spends its
# time, the loop-lag stalls' causes, and the staged busbw with two processes on one GPU.
# OUT=dir bash bench/session20_probe.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/probe; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1
timeout 60 python3 bench/via_host_probe.py prims >"$S/prims.txt" 2>&1
timeout 120 python3 bench/via_host_probe.py ranks -n 2000 >"$S/ranks.txt" 2>&1
timeout 120 python3 bench/via_host_probe.py profile -n 3000 >"$S/profile.txt" 2>&1
timeout 120 py-spy record -r 2000 --format raw -o "$S/spy_ranks.raw" -- \
  python3 bench/via_host_probe.py ranks -n 3000 >"$S/spy_ranks.txt" 2>&1
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for dev in cpu cuda; do
  timeout 60 python3 -m acoll.perf all_reduce -b 8 -e 8 -n 1000 -w 100 -N 2 --device $dev \
    --timeout 55 >"$S/lat_procs_$dev.txt" 2>&1
  timeout 120 python3 -m acoll.perf all_reduce -b 1M -e 64M -f 4 -n 6 -w 2 -N 2 --device $dev \
    --timeout 110 >"$S/busbw_procs_$dev.txt" 2>&1
done
timeout 120 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --diagnose \
  --json "$S/lag.json" >"$S/lag.txt" 2>&1
tar czf "$OUT/probe.tgz" -C "$S" . && rm -rf "$S"
