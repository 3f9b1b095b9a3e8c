#!/usr/bin/env bash
# Session 33 (for a later loan of the 16-core GPU host): the shaped network (4 namespace
# hosts, 10 Gbit/s tbf links) with the veths' receive steering that netns_shaped.py now
# sets up (RPS, as a NIC's RSS keeps a flow on one queue), alternating acoll and Gloo, then
# the old topology (--no-rps) once each; every run counts the packets the kernel dropped
# (--trace-drops) and the link-level packets sent and not received.
# OUT=dir NETBIN=.netbin bash bench/session33_device.sh
set -u
OUT=${OUT:-$PWD/session33_device}
. bench/device_steps.sh
device_start "$OUT"
for r in 1 2; do
  device_netns "$OUT" "rps_acoll_$r" --libs acoll --trace-drops
  device_netns "$OUT" "rps_gloo_$r" --libs gloo --trace-drops
done
device_netns "$OUT" norps_acoll --libs acoll --no-rps --trace-drops
device_netns "$OUT" norps_gloo --libs gloo --no-rps --trace-drops
cat "$OUT/netns.txt"
