#!/usr/bin/env bash
# Session 36's third run (16-core GPU host), at the code with ACOLL_SOCKET_CONGESTION=auto
# (cubic on acoll's data sockets where the system's default is bbr, as there):
# (1) the shaped network (4 namespace hosts, 10 Gbit/s tbf links, 16 to 64 MiB), 3
#     alternating rounds of acoll, Gloo with the host's bbr and Gloo with the host's
#     default set to cubic (so both libraries are seen with either congestion control);
# (2) loopback TCP, 4 ranks, no shared memory: acoll with auto (cubic) against the
#     system's bbr (ACOLL_SOCKET_CONGESTION=system), 2 alternating rounds.
# OUT=dir NETBIN=.netbin bash bench/session36_device3.sh
set -u
OUT=${OUT:-$PWD/session36_device3}
. bench/device_steps.sh
device_start "$OUT"
CC=/proc/sys/net/ipv4/tcp_congestion_control
echo "system default: $(cat $CC)" >"$OUT/netns.txt"
for round in 1 2 3; do
  device_netns "$OUT" "acoll_$round" --libs acoll
  device_netns "$OUT" "gloo_$round" --libs gloo
  old=$(cat $CC); echo cubic >$CC
  device_netns "$OUT" "gloo_system_cubic_$round" --libs gloo
  echo "$old" >$CC
done
loop() {
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket ACOLL_SOCKET_CONGESTION=$2 \
    timeout 100 python3 -m acoll.perf all_reduce -N 4 -b 64K -e 64M -f 4 -n 20 -w 5 \
    >>"$OUT/loopback_$1.txt" 2>&1
  echo "== $1 exit $? at $SECONDS s" >>"$OUT/loopback_$1.txt"
}
for round in 1 2; do loop auto auto; loop system system; done
grep -v "^#   \|^# acoll 0.1\|^# gloo: torch\|^# 4 hosts\|acoll-perf all_reduce:\|ranks 4 | net" \
  "$OUT/netns.txt" > "$OUT/summary.txt"
rm -f "$OUT/build.txt"
