#!/usr/bin/env bash
# Session 29, 16-core GPU host, CPU only: does the ring gain from fewer, larger chunks
# (ACOLL_RING_CHUNKS 8 -> 4, 2: 1 MiB chunks and up go to the receive thread) over TCP on
# one host, and what does that cost on 4 namespace hosts with 10 Gbit/s links?
#  1_tcp/   bench/tcp_ab.py, 4 and 8 ranks, 16 and 64 MiB, paired in the same processes
#  2_netns/ bench/netns_shaped.py, ring with 8 / 4 / 2 chunks and Gloo, 16 to 256 MiB
# OUT=dir NETBIN=.netbin bash bench/session29_device2.sh
set -u
OUT=${OUT:-$PWD/session29_device2}
mkdir -p "$OUT/1_tcp" "$OUT/2_netns"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
A=$OUT/1_tcp/ab.txt
t0=$SECONDS
for n in 8 4; do for s in 8M 16M 64M; do
  case $s in 8M) it=12;; 16M) it=8;; *) it=3;; esac
  ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) timeout 60 \
    python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters $it --rounds 5 \
    --variants chunks=8 chunks=4 chunks=2 algo=hd gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done; done
cat "$A"
export PATH="$PWD/${NETBIN:-.netbin}:$PATH"
N=$OUT/2_netns
run() {
  local name=$1; shift
  timeout 100 python3 bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -f 4 -n 10 -w 3 \
    --timeout 90 --out "$N/$name.txt" "$@" >"$N/$name.log" 2>&1
  echo "== $name: exit $? at $((SECONDS - t0)) s" >>"$N/$name.log"
  { echo "## $name"; grep -A4 "acoll_busbw\|gloo_busbw" "$N/$name.txt" | grep -v "^#"
    grep "wall" "$N/$name.txt"; tail -1 "$N/$name.log"; } >>"$N/summary.txt"
  rm -f "$N/$name.log"
}
if [ $((SECONDS - t0)) -lt 330 ]; then
  run chunks8 --libs acoll
  run chunks2 --libs acoll --acoll-env ACOLL_RING_CHUNKS=2
  run gloo --libs gloo
  run chunks4 --libs acoll --acoll-env ACOLL_RING_CHUNKS=4
  run chunks8b --libs acoll
fi
cat "$N/summary.txt"
