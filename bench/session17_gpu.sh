#!/usr/bin/env bash
# One device batch (2x H200, Python 3.12): the whole suite; the P2P path against NCCL
# (latency and busbw, one process and two); issue 9's staged path (GPU buffers over TCP with
# the intra-host GPU path and shared memory off) against host buffers, and the loop lag.
# OUT=dir bash bench/session17_gpu.sh
set -u
OUT=${OUT:-$PWD/session17_out}
mkdir -p "$OUT"
. bench/device_steps.sh
t0=$SECONDS
device_machine "$OUT"
device_suite "$OUT"     # 1. the whole suite
device_p2p "$OUT" 50    # 2. the P2P path vs NCCL
# 3. issue 9: staged over TCP, GPU vs host buffers
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
S=$OUT/issue9; mkdir -p "$S"
for n in 2 4; do
  for dev in cuda cpu; do
    tag=$([ $dev = cuda ] && echo gpu || echo host)
    timeout 60 python3 -m acoll.perf all_reduce -b 8 -e 8 -n 300 -w 30 -N $n --device $dev \
      --timeout 55 --json "$S/lat_${tag}_${n}ranks.json" >"$S/lat_${tag}_${n}ranks.txt" 2>&1
    timeout 90 python3 -m acoll.perf all_reduce -b 1M -e 64M -f 4 -n 6 -w 2 -N $n --device $dev \
      --timeout 85 --json "$S/busbw_${tag}_${n}ranks.json" >"$S/busbw_${tag}_${n}ranks.txt" 2>&1
  done
done
timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --json "$S/loop_lag.json" \
  >"$S/loop_lag.txt" 2>&1
python3 bench/gpu_summary.py "$S"
cat "$S/gpu_summary.txt"
# one archive: the device hands back a few files only
tar czf "$OUT/issue9.tgz" -C "$S" . && rm -rf "$S"
echo "== batch done after $((SECONDS - t0)) s"
