#!/usr/bin/env bash
# Session 31's last device runs (16-core GPU host, one H200, Python 3.12) at the final code.
# PART=a: the whole suite with the GPU tests, then acoll-perf reduce_scatter and
# all_gather --vs gloo with 4 and 8 ranks, TCP only. PART=b: acoll-perf all_reduce --vs
# gloo with 2, 4, 8 ranks, TCP only; the shaped network (acoll, Gloo).
# OUT=dir PART=a|b NETBIN=.netbin bash bench/session31_device3.sh
set -u
OUT=${OUT:-$PWD/session31_device3}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
python3 -m acoll._native >"$OUT/build.txt" 2>&1
if [ "${PART:-a}" = a ]; then
  SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
  grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
  for n in 4 8; do
    device_perf "$OUT" rs_$n.txt reduce_scatter -N $n -b 8K -e 128M -f 8
    device_perf "$OUT" ag_$n.txt all_gather -N $n -b 8K -e 128M -f 8
  done
else
  for n in 2 4 8; do device_perf "$OUT" ar_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
  for lib in acoll gloo; do device_netns "$OUT" $lib --libs $lib; done
  cat "$OUT/netns.txt"
fi
