#!/usr/bin/env bash
# Session 38, one H200: the whole suite on the GPU host's Python 3.12 at the final code.
# OUT=dir bash bench/session38_device6.sh
set -u
OUT=${OUT:-$PWD/session38_device6}
. bench/device_steps.sh
device_start "$OUT"
device_suite "$OUT"
