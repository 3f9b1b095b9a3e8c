#!/usr/bin/env bash
# Session 52's device call: the whole suite with the GPU tests on the device's Python
# (SUITE_LIMIT, default 330 s), then AVG folded into the lane's steps against scaling
# first, paired in the same processes (bench/avg_fold_ab.py) with 2, 4 and 8 ranks on the
# 16-core host, CPU only. Carry .whl/ (bench/prepare_device.sh); results under OUT.
#   OUT=dir bash bench/session52_device.sh
set -u
OUT=${OUT:-$PWD/session52}
. bench/device_steps.sh
device_start "$OUT" >/dev/null 2>&1 || echo "device_start failed (see $OUT)"
device_suite "$OUT"
gzip -kf "$OUT/suite.txt" 2>/dev/null
for n in 2 4 8; do
  timeout 200 python3 -m acoll.run -n "$n" -- python3 bench/avg_fold_ab.py 4M 16M 64M \
    --rounds "${ROUNDS:-4}" >"$OUT/avg_fold_$n.txt" 2>&1
  echo "== $n ranks: exit $?" >>"$OUT/avg_fold_$n.txt"
  grep -v "^\[rank [1-9]" "$OUT/avg_fold_$n.txt" | tail -n 5
done
