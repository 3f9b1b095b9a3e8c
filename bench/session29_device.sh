#!/usr/bin/env bash
# Session 29, 16-core GPU host, CPU only (issue 11 part 2 and 3): the halving-doubling
# all-reduce (ACOLL_ALGO=all_reduce:hd) against the ring, the direct all-reduce and Gloo.
#  1_tcp/   one host, TCP only, ranks as processes, paired in the same processes
#           (bench/tcp_ab.py), 4 and 8 ranks, 1 to 256 MiB
#  2_netns/ 4 namespace hosts on 10 Gbit/s tbf links (bench/netns_shaped.py), ring, hd and
#           Gloo, 16 to 256 MiB, each its own run (ring and hd twice)
# OUT=dir NETBIN=.netbin bash bench/session29_device.sh
set -u
OUT=${OUT:-$PWD/session29_device}
mkdir -p "$OUT/1_tcp" "$OUT/2_netns"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
A=$OUT/1_tcp/ab.txt
t0=$SECONDS
for n in 8 4; do for s in 1M 2M 4M 16M 64M 256M; do
  case $s in 1M) it=60;; 2M) it=40;; 4M) it=20;; 16M) it=8;; 64M) it=3;; *) it=1;; esac
  ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) timeout 60 \
    python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters $it --rounds 4 \
    --variants chunks=8 algo=hd algo=hd+hdchunks=4 algo=direct gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done; done
cat "$A"
export PATH="$PWD/${NETBIN:-.netbin}:$PATH"
{ ip -V; tc -V; uname -r; } >>"$OUT/machine.txt" 2>&1
N=$OUT/2_netns
run() {
  local name=$1; shift
  timeout 100 python3 bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -f 4 -n 10 -w 3 \
    --timeout 90 --out "$N/$name.txt" "$@" >"$N/$name.log" 2>&1
  echo "== $name: exit $? at $((SECONDS - t0)) s" >>"$N/$name.log"
  { echo "## $name"; grep -A4 "acoll_busbw\|gloo_busbw" "$N/$name.txt" | grep -v "^#"
    tail -1 "$N/$name.log"; } >>"$N/summary.txt"
}
if [ $((SECONDS - t0)) -lt 380 ]; then
  run ring1 --libs acoll --acoll-env ACOLL_ALGO=all_reduce:ring
  run hd1 --libs acoll --acoll-env ACOLL_ALGO=all_reduce:hd
  run gloo --libs gloo
  run hd2 --libs acoll --acoll-env ACOLL_ALGO=all_reduce:hd
  run ring2 --libs acoll --acoll-env ACOLL_ALGO=all_reduce:ring
fi
cat "$N/summary.txt"
