#!/usr/bin/env bash
# Session 30's last device run (16-core GPU host, one H200, Python 3.12) at the final code
# (timeout probes): the whole suite with the GPU tests (pytest-asyncio carried in .whl/).
# OUT=dir bash bench/session30_device4.sh
set -u
OUT=${OUT:-$PWD/session30_device4}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
SUITE_LIMIT=${SUITE_LIMIT:-420} WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
