#!/usr/bin/env bash
# Session 36's second run (16-core GPU host): the shaped network (4 namespace hosts,
# 10 Gbit/s tbf links, 16 to 64 MiB) in 3 alternating rounds of acoll with the host's
# congestion control (bbr there), acoll with cubic on its sockets
# (ACOLL_SOCKET_CONGESTION=cubic) and Gloo; each run's queue sampled (bench/qdisc_backlog.py).
# OUT=dir NETBIN=.netbin bash bench/session36_device2.sh
set -u
OUT=${OUT:-$PWD/session36_device2}
. bench/device_steps.sh
device_start "$OUT"
sampled() {  # NAME ARGS...: device_netns NAME ARGS with the queue sampler beside it
  local name=$1; shift
  PATH="$PWD/${NETBIN:-.netbin}:$PATH" python3 bench/qdisc_backlog.py --rate 10gbit \
    --every 0.05 --seconds 95 >"$OUT/backlog.tmp" 2>&1 &
  local sampler=$!
  device_netns "$OUT" "$name" "$@"
  wait $sampler
  { echo "## queues during $name"; grep -v "tcp_congestion_control" "$OUT/backlog.tmp"
    grep -m1 "tcp_congestion_control" "$OUT/backlog.tmp"; } >>"$OUT/netns.txt"
  rm -f "$OUT/backlog.tmp"
}
for round in 1 2 3; do
  sampled "acoll_$round" --libs acoll
  sampled "acoll_cubic_$round" --libs acoll --acoll-env ACOLL_SOCKET_CONGESTION=cubic
  sampled "gloo_$round" --libs gloo
done
grep -v "^#   \|^# acoll 0.1\|^# gloo: torch\|^# 4 hosts\|acoll-perf all_reduce:\|ranks 4 | net" \
  "$OUT/netns.txt" > "$OUT/summary.txt"
rm -f "$OUT/build.txt"
