#!/usr/bin/env bash
# Session 24, issue 11 part 3 on the 16-core GPU host after the TCP changes (send thread by
# queued bytes, ring chunks capped per segment): 4 network-namespace hosts on 10 Gbit/s tbf
# links, acoll then Gloo, 16 to 256 MiB. The device has no iproute2: NETBIN names a folder
# with `ip`, `tc` and `bridge` (carried).   OUT=dir NETBIN=.netbin bash bench/session24_netns.sh
set -u
OUT=${OUT:-$PWD/session24_netns}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export PATH="$PWD/${NETBIN:-.netbin}:$PATH" CUDA_VISIBLE_DEVICES=
{ date -u; nproc; python3 --version; ip -V; tc -V; uname -r; } >"$OUT/machine.txt" 2>&1
t0=$SECONDS
timeout 60 python3 bench/netns_shaped.py --check >"$OUT/check.txt" 2>&1
echo "== check: exit $?" | tee -a "$OUT/check.txt"
timeout 170 python3 bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -f 4 -n 10 -w 3 \
  --out "$OUT/netns_shaped_10g.txt" >"$OUT/run.log" 2>&1
echo "== 10gbit sweep: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/run.log"
grep -A8 "vs\|line rate" "$OUT/netns_shaped_10g.txt" | tail -30
