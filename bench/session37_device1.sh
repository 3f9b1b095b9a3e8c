#!/usr/bin/env bash
# Session 37's first GPU run (one H200): the native launcher of prepared P2P calls.
# A/B of the native launcher against the Python route on the same communicators (one
# process, two ranks sharing the GPU, group-driven; uvloop and asyncio), the phase
# breakdown of an 8 B call with and without it, then the whole suite on the host's
# Python 3.12 (make test-gpu).
# OUT=dir bash bench/session37_device1.sh
set -u
OUT=${OUT:-$PWD/session37_device1}
. bench/device_steps.sh
device_start "$OUT"
python3 - >>"$OUT/build.txt" 2>&1 <<'PY'
from acoll._cuda import launcher
print("native launcher:", launcher.load())
PY
cat "$OUT/build.txt"
for loop in uvloop asyncio; do
  timeout 120 python3 bench/p2p_native_ab.py inproc --loop $loop --rounds 5 --iters 1000 \
    >>"$OUT/native_ab.txt" 2>&1
  echo "== native_ab $loop: exit $? at $SECONDS s" >>"$OUT/native_ab.txt"
done
grep -v rounds: "$OUT/native_ab.txt"
for native in 1 0; do
  for b in 8 262144; do
    echo "## ACOLL_P2P_NATIVE=$native" >>"$OUT/breakdown.txt"
    ACOLL_P2P_NATIVE=$native timeout 60 python3 bench/group_breakdown.py --bytes $b \
      --iters 2000 --no-nccl >>"$OUT/breakdown.txt" 2>&1
  done
done
cat "$OUT/breakdown.txt"
SUITE_LIMIT=330 device_suite "$OUT"
grep -E "FAILED|ERROR|Timeout" "$OUT/suite.txt" | head -20
