#!/usr/bin/env bash
# Session 26, one H200 (16 cores, Python 3.12.3): the whole suite with the GPU tests at stop
# 25's code (never run on a GPU host), on the host's own Python. OUT=dir bash bench/session26_suite.sh
set -u
OUT=${OUT:-$PWD/session26_suite}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
SUITE_LIMIT=420 WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
