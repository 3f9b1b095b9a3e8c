#!/usr/bin/env bash
# Session 25, issue 11 part 3 on the 16-core host: 4 namespace hosts on 10 Gbit/s tbf links,
# acoll's settings that shape the ring's traffic (chunks per segment, chunk cap, sockets per
# connection, the send thread), each its own acoll run, then Gloo, then acoll's defaults again.
# OUT=dir NETBIN=.netbin bash bench/session25_netns.sh
set -u
OUT=${OUT:-$PWD/session25_netns}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export PATH="$PWD/${NETBIN:-.netbin}:$PATH" CUDA_VISIBLE_DEVICES=
{ date -u; nproc; python3 --version; uname -r; } >"$OUT/machine.txt" 2>&1
timeout 60 python3 bench/netns_shaped.py --check >"$OUT/check.txt" 2>&1
run() {  # name, then --acoll-env / --libs arguments
  local name=$1; shift
  timeout 90 python3 bench/netns_shaped.py --rate 10gbit -b 64M -e 256M -f 4 -n 10 -w 3 \
    --timeout 80 --out "$OUT/$name.txt" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?" >>"$OUT/$name.log"
  { echo "## $name"; grep -A3 "acoll_busbw\|gloo_busbw" "$OUT/$name.txt" | grep -v "^#" ; } >>"$OUT/summary.txt"
}
run default --libs acoll
run chunks16 --libs acoll --acoll-env ACOLL_RING_CHUNKS=16
run cap1M --libs acoll --acoll-env ACOLL_RING_CHUNK_MAX=1M
run nsocks2 --libs acoll --acoll-env ACOLL_SOCKET_NSOCKS=2
run nothread --libs acoll --acoll-env ACOLL_SOCKET_SEND_THREADS=0
run gloo --libs gloo
run default2 --libs acoll
cat "$OUT/summary.txt"
