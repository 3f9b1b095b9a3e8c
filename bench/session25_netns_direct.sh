#!/usr/bin/env bash
# Session 25: the direct all-reduce on 4 namespace hosts joined by 10 Gbit/s tbf links
# (incast on every host's link?), against the ring and Gloo, 16 to 256 MiB.
# OUT=dir NETBIN=.netbin bash bench/session25_netns_direct.sh
set -u
OUT=${OUT:-$PWD/session25_netns_direct}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export PATH="$PWD/${NETBIN:-.netbin}:$PATH" CUDA_VISIBLE_DEVICES=
run() {
  local name=$1; shift
  timeout 100 python3 bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -f 4 -n 10 -w 3 \
    --timeout 90 --out "$OUT/$name.txt" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?" >>"$OUT/$name.log"
  { echo "## $name"; grep -A4 "acoll_busbw\|gloo_busbw" "$OUT/$name.txt" | grep -v "^#" ; } >>"$OUT/summary.txt"
}
run ring --libs acoll --acoll-env ACOLL_ALGO=all_reduce:ring
run direct --libs acoll --acoll-env ACOLL_ALGO=all_reduce:direct
run gloo --libs gloo
cat "$OUT/summary.txt"
