#!/usr/bin/env bash
# Session 41, the GPU host: the whole suite (and the GPU tests) on its Python 3.12 with the
# code as committed. Carry .whl/ (bench/prepare_device.sh). OUT=dir bash bench/session41_device2.sh
set -u
OUT=${OUT:-$PWD/session41_device2}
. bench/device_steps.sh
mkdir -p "$OUT"
device_site
device_machine "$OUT"
SUITE_LIMIT=420 device_suite "$OUT"
