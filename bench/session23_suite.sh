#!/usr/bin/env bash
# Session 23 (2x H200): the whole suite at the start of the session (stop 22's last code, which
# never ran on a GPU: tidy-up, self_checked P2P ops, withdrawn launches). OUT=dir bash bench/session23_suite.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/suite; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=200 WORKERS=12 device_suite "$S"
grep -h "^FAILED\|^ERROR" "$S/suite.txt" | head
tar czf "$OUT/suite.tgz" -C "$S" . && rm -rf "$S"
