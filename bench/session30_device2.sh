#!/usr/bin/env bash
# Session 30, 16-core GPU host (one H200): (1) 4 namespace hosts on 10 Gbit/s tbf links,
# acoll, Gloo, acoll, 16 to 64 MiB, with each run's TCP counters (retransmits, timeouts,
# loss probes: bench/netns_shaped.py now reports them), and once more with tbf bursts of
# 1 MB (a diagnosis, not the target's network); (2) the P2P tests with 8 ranks on the GPU
# (issue 13's correctness, as far as one GPU allows) and the rest of tests/test_p2p_gpu.py.
# OUT=dir NETBIN=.netbin bash bench/session30_device2.sh
set -u
OUT=${OUT:-$PWD/session30_device2}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
S=$OUT/netns.txt
run() {  # name, then netns_shaped.py arguments
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= PATH="$PWD/${NETBIN:-.netbin}:$PATH" timeout 100 python3 \
    bench/netns_shaped.py --rate 10gbit -b 16M -e 64M -f 2 -n 20 -w 5 --timeout 90 "$@" \
    >"$OUT/$name.log" 2>&1
  { echo "## $name: exit $?"; grep -A5 "acoll_busbw\|gloo_busbw" "$OUT/$name.log" \
      | grep -v "^# target"; grep "^# \(acoll\|gloo\)\|TCP:" "$OUT/$name.log"; } >>"$S"
}
run acoll1 --libs acoll
run gloo1 --libs gloo
run acoll2 --libs acoll
run burst1m --libs acoll,gloo --burst 1mb
cat "$S"
rm -f "$OUT"/*.log
T=$OUT/p2p_tests.txt
PYTHONPATH=$PWD/src:$PWD/tests:$SITE timeout 420 python3 -m pytest -p no:cacheprovider -q \
  -p no:randomly -rs --timeout 400 --durations=15 tests/test_p2p_gpu.py >"$T" 2>&1
echo "== p2p tests: exit $?" >>"$T"
tail -30 "$T"
