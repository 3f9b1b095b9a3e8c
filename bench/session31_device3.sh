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
t0=$SECONDS
perf() {  # file, then acoll-perf arguments
  local f=$1; shift
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 150 \
    python3 -m acoll.perf "$@" -n 20 -w 5 --vs gloo >"$OUT/$f" 2>&1
  echo "== $f: exit $? at $((SECONDS - t0)) s" >>"$OUT/$f"
  sed -n '/acoll vs gloo/,$p' "$OUT/$f"
}
if [ "${PART:-a}" = a ]; then
  SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
  grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
  for n in 4 8; do
    perf rs_$n.txt reduce_scatter -N $n -b 8K -e 128M -f 8
    perf ag_$n.txt all_gather -N $n -b 8K -e 128M -f 8
  done
else
  for n in 2 4 8; do perf ar_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
  S=$OUT/netns.txt
  for lib in acoll gloo; do
    CUDA_VISIBLE_DEVICES= PATH="$PWD/${NETBIN:-.netbin}:$PATH" timeout 100 python3 \
      bench/netns_shaped.py --rate 10gbit -b 16M -e 64M -f 2 -n 20 -w 5 --timeout 90 \
      --libs $lib >"$OUT/$lib.log" 2>&1
    { echo "## $lib: exit $? at $((SECONDS - t0)) s"; grep -A5 "acoll_busbw\|gloo_busbw" \
        "$OUT/$lib.log" | grep -v "^# target"; grep "TCP:" "$OUT/$lib.log"; } >>"$S"
  done
  cat "$S"
  rm -f "$OUT"/*.log
fi
