#!/usr/bin/env bash
# Session 37's GPU check of the native launcher after the review's fixes (one H200): the
# P2P, group and launcher tests with the launcher on (ACOLL_P2P_NATIVE=1) and with the
# default (off), then the A/B of the two routes once more.
# OUT=dir bash bench/session37_device2.sh
set -u
OUT=${OUT:-$PWD/session37_device2}
. bench/device_steps.sh
device_start "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests:$SITE"
for native in 1 0; do
  ACOLL_P2P_NATIVE=$native timeout 280 python3 -m pytest -q -n 8 -p no:randomly \
    -p no:benchmark -p no:cacheprovider --timeout 240 tests/test_p2p_gpu.py \
    tests/test_groups.py tests/test_launcher.py tests/test_p2p_fast_cpu.py \
    tests/test_p2p.py >"$OUT/tests_native$native.txt" 2>&1
  echo "== tests ACOLL_P2P_NATIVE=$native: exit $? at $SECONDS s" | tee -a "$OUT/tests_native$native.txt"
  tail -n 2 "$OUT/tests_native$native.txt"
done
timeout 100 python3 bench/p2p_native_ab.py inproc --rounds 5 --iters 1000 >"$OUT/native_ab.txt" 2>&1
echo "== native_ab: exit $?" >>"$OUT/native_ab.txt"
grep -v rounds: "$OUT/native_ab.txt"
