#!/usr/bin/env bash
# Session 21 (2x H200), after the review's fixes: the whole suite on the device's Python,
# then the send-threads A/B of bench/session21_send_threads.sh (issue 11, CPU only).
# OUT=dir bash bench/session21_check.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/check; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=260 device_suite "$S"
tar czf "$OUT/check.tgz" -C "$S" . && rm -rf "$S"
OUT=$OUT bash bench/session21_send_threads.sh
