#!/usr/bin/env bash
# Session 22 (2x H200): the whole suite at the last code commit (CUDA errors at launch as
# TransportError, closed domains never read, causes kept). OUT=dir bash bench/session22_suite.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/suite; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=200 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
tar czf "$OUT/suite.tgz" -C "$S" . && rm -rf "$S"
