#!/usr/bin/env bash
# Session 36's last run (16-core GPU host, one H200): the whole suite with the GPU tests on
# the host's Python 3.12 at the final code (ACOLL_SOCKET_CONGESTION=auto: cubic on the data
# sockets there, where the system's default is bbr).
# OUT=dir bash bench/session36_device4.sh
set -u
OUT=${OUT:-$PWD/session36_device4}
. bench/device_steps.sh
device_start "$OUT"
SUITE_LIMIT=420 device_suite "$OUT"
rm -f "$OUT/build.txt"
