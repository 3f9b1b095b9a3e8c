#!/usr/bin/env bash
# Issue 11 part 3 on the 16-core GPU host: 4 ranks as 4 network-namespace hosts on
# 10 Gbit/s tbf-shaped links, acoll then Gloo (bench/netns_shaped.py). The device has no
# iproute2: NETBIN names a folder with `ip` and `tc` (carried; see the closing note).
# OUT=dir NETBIN=.netbin bash bench/session18_netns.sh
set -u
OUT=${OUT:-$PWD/session18_netns}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export PATH="$PWD/${NETBIN:-.netbin}:$PATH" CUDA_VISIBLE_DEVICES=
{ date -u; nproc; python3 --version; ip -V; tc -V; uname -r
  python3 -c "import torch; print('torch', torch.__version__)"; } >"$OUT/machine.txt" 2>&1
t0=$SECONDS
timeout 120 python3 bench/netns_shaped.py --check >"$OUT/check.txt" 2>&1
echo "== check: exit $?" | tee -a "$OUT/check.txt"
tail -5 "$OUT/check.txt"
timeout 400 python3 bench/netns_shaped.py --rate 10gbit -b 1M -e 256M -n 10 -w 3 --repeat 2 \
  --out "$OUT/netns_shaped_10g.txt" >"$OUT/run.log" 2>&1
echo "== 10gbit sweep: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/run.log"
tail -40 "$OUT/netns_shaped_10g.txt"
