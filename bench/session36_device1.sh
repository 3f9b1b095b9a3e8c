#!/usr/bin/env bash
# Session 36's first run (16-core GPU host): why a 16 MiB all_reduce on the shaped network
# (4 namespace hosts, 10 Gbit/s tbf links) stays under 90% of the line. The host's TCP
# settings, then acoll and Gloo with a sampler of the links' tbf queues beside each run
# (bench/qdisc_backlog.py), and acoll with its sockets' congestion control set to cubic and
# to bbr (ACOLL_SOCKET_CONGESTION); then the same with 1 MB tbf bursts.
# (It ran before auto became the default: its system-default runs now say
# ACOLL_SOCKET_CONGESTION=system.)
# OUT=dir NETBIN=.netbin bash bench/session36_device1.sh
set -u
OUT=${OUT:-$PWD/session36_device1}
. bench/device_steps.sh
device_start "$OUT"
{ uname -r
  for k in tcp_congestion_control tcp_available_congestion_control \
      tcp_allowed_congestion_control tcp_wmem tcp_rmem tcp_slow_start_after_idle \
      tcp_limit_output_bytes tcp_notsent_lowat; do
    echo "net.ipv4.$k = $(cat /proc/sys/net/ipv4/$k)"; done
  echo "net.core.default_qdisc = $(cat /proc/sys/net/core/default_qdisc)"; } >"$OUT/sysctl.txt"
cat "$OUT/sysctl.txt"
device_netns_queues "$OUT" acoll --libs acoll --acoll-env ACOLL_SOCKET_CONGESTION=system
device_netns_queues "$OUT" gloo --libs gloo
device_netns_queues "$OUT" acoll_cubic --libs acoll --acoll-env ACOLL_SOCKET_CONGESTION=cubic
device_netns_queues "$OUT" acoll_bbr --libs acoll --acoll-env ACOLL_SOCKET_CONGESTION=bbr
device_netns_queues "$OUT" acoll_burst1m --libs acoll --burst 1mb \
  --acoll-env ACOLL_SOCKET_CONGESTION=system
device_netns_queues "$OUT" gloo_burst1m --libs gloo --burst 1mb
grep -v "^#   " "$OUT/netns.txt"
