#!/usr/bin/env bash
# Session 32: the whole suite with the GPU tests at the final code on the 16-core GPU host
# (Python 3.12); only the summary comes back (the full log is too large to return).
# OUT=dir bash bench/session32_device3.sh
set -u
OUT=${OUT:-$PWD/session32_device3}
. bench/device_steps.sh
device_start "$OUT"
SUITE_LIMIT=${SUITE_LIMIT:-280} WORKERS=12 device_suite /tmp
{ grep -h "^FAILED\|^ERROR" /tmp/suite.txt | head -40; tail -n 4 /tmp/suite.txt; } >"$OUT/suite_summary.txt"
grep -c "^SKIPPED" /tmp/suite.txt >>"$OUT/suite_summary.txt"
cat "$OUT/suite_summary.txt"
