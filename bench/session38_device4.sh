#!/usr/bin/env bash
# Session 38, the 16-core GPU host, CPU only: registered-buffer all_reduce against Open MPI
# (issue 11's 1 MiB cell), the code before this session's zero-copy changes (oldsrc/: a
# copy of src/ at 7077ad2, carried untracked) and after, alternating, 2 and 8 ranks.
# OUT=dir bash bench/session38_device4.sh
set -u
OUT=${OUT:-$PWD/session38_device4}
. bench/device_steps.sh
device_start "$OUT"
device_lane_mpi_ab "$OUT"
cat "$OUT/pair_ab.txt"
