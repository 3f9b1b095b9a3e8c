#!/usr/bin/env bash
# Session 35's diagnostic run (16-core GPU host): the shaped network from 16 to 256 MiB
# (session 35's first run had both libraries at 84% of the line at 64 MiB, 89 to 91% at
# 16 and 32), acoll with and without acoll-perf's result check, Gloo between them; then
# 8-rank SHM all_reduce against Open MPI, NumPy arrays (R0) and registered buffers (R1),
# 5 alternating rounds each.
# OUT=dir NETBIN=.netbin bash bench/session35_device1.sh
set -u
OUT=${OUT:-$PWD/session35_device1}
. bench/device_steps.sh
device_start "$OUT"
big() {
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= PATH="$PWD/${NETBIN:-.netbin}:$PATH" timeout 120 python3 \
    bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -f 2 -n 10 -w 3 --timeout 110 "$@" \
    >"$OUT/$name.log" 2>&1
  { echo "## $name: exit $? at $SECONDS s"; grep -A6 "acoll_busbw\|gloo_busbw" "$OUT/$name.log" \
      | grep -v "^# target"; grep "^# \(acoll\|gloo\)\|TCP:" "$OUT/$name.log"; } >>"$OUT/netns.txt"
}
big acoll --libs acoll
big gloo --libs gloo
big acoll_nocheck --libs acoll --no-check
cat "$OUT/netns.txt" | grep -v "^#   "
device_shm_mpi "$OUT" 5
