#!/usr/bin/env bash
# Session 20, issue 9 on the device (2x H200 or 1x): the staged path over TCP (P2P and SHM
# off). 8 B awaited latency (2 processes, GPU vs host buffers, alternating rounds), ranks in
# one loop, busbw 1-64 MiB (host; GPU as shipped; GPU with every size via host), the loop's
# lag during 64 MiB GPU all_reduces with the heap as is, collected, and frozen.
# OUT=dir bash bench/session20_issue9.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
device_site
S=$OUT/issue9; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
perf() { timeout 100 python3 -m acoll.perf all_reduce --timeout 95 "$@"; }
for r in 1 2 3; do
  for dev in cpu cuda; do
    perf -b 8 -e 8 -n 2000 -w 200 -N 2 --device $dev >"$S/lat_${dev}_r$r.txt" 2>&1
  done
done
timeout 120 python3 bench/via_host_probe.py ranks -n 2000 >"$S/ranks.txt" 2>&1
timeout 120 python3 bench/via_host_probe.py profile -n 3000 >"$S/profile.txt" 2>&1
for n in 2 4; do
  perf -b 1M -e 64M -f 4 -n 8 -w 2 -N $n --device cpu >"$S/busbw_${n}_host.txt" 2>&1
  perf -b 1M -e 64M -f 4 -n 8 -w 2 -N $n --device cuda >"$S/busbw_${n}_gpu.txt" 2>&1
  ACOLL_GPU_VIA_HOST_MAX=128M perf -b 1M -e 64M -f 4 -n 8 -w 2 -N $n --device cuda \
    >"$S/busbw_${n}_gpu_viahost.txt" 2>&1
done
for g in asis collect freeze; do
  timeout 120 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --diagnose \
    --iters 24 --gc $g --json "$S/lag_$g.json" >"$S/lag_$g.txt" 2>&1
done
tar czf "$OUT/issue9.tgz" -C "$S" . && rm -rf "$S"
