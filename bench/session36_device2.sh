#!/usr/bin/env bash
# Session 36's second run (16-core GPU host): the shaped network (4 namespace hosts,
# 10 Gbit/s tbf links, 16 to 64 MiB) in 3 alternating rounds of acoll with the host's
# congestion control (bbr there), acoll with cubic on its sockets
# (ACOLL_SOCKET_CONGESTION=cubic) and Gloo; each run's queues sampled (bench/qdisc_backlog.py).
# (It ran before auto became the default: the bbr runs now say ACOLL_SOCKET_CONGESTION=system.)
# OUT=dir NETBIN=.netbin bash bench/session36_device2.sh
set -u
OUT=${OUT:-$PWD/session36_device2}
. bench/device_steps.sh
device_start "$OUT"
for round in 1 2 3; do
  device_netns_queues "$OUT" "acoll_$round" --libs acoll --acoll-env ACOLL_SOCKET_CONGESTION=system
  device_netns_queues "$OUT" "acoll_cubic_$round" --libs acoll \
    --acoll-env ACOLL_SOCKET_CONGESTION=cubic
  device_netns_queues "$OUT" "gloo_$round" --libs gloo
done
rm -f "$OUT"/backlog_*.txt
grep -v "^#   \|^# acoll 0.1\|^# gloo: torch\|^# 4 hosts\|acoll-perf all_reduce:\|ranks 4 | net" \
  "$OUT/netns.txt" > "$OUT/summary.txt"
rm -f "$OUT/build.txt"
