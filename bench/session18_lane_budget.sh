#!/usr/bin/env bash
# Would a larger automatic lane help 4 and 8 ranks? The wide sweep of
# bench/session18_device.sh with ACOLL_SHM_LANE_MAX set to 4 MiB / (ranks - 1) (capped at
# 1 MiB) instead of the default 1 MiB / (ranks - 1). OUT=dir bash bench/session18_lane_budget.sh
set -u
OUT=${OUT:-$PWD/session18_lane_budget}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_IB_DISABLE=1
for pair in "4 1048576" "8 599168"; do
  set -- $pair
  ACOLL_SHM_LANE_MAX=$2 timeout 200 python3 -m acoll.perf all_reduce -N $1 -b 8 -e 16M -f 4 -n 50 \
    -w 5 --vs mpi --no-progress >"$OUT/wide_lane${2}_vs_mpi_$1.txt" 2>&1
  echo "== $1 ranks, lane $2: exit $?"
  sed -n '/acoll vs mpi/,$p' "$OUT/wide_lane${2}_vs_mpi_$1.txt"
done
