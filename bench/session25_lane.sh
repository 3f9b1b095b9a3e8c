#!/usr/bin/env bash
# Session 25, the 16-core host, CPU only (issue 11): the lane's step size at 4 and 8 ranks
# around 1 MiB, where it lost to Open MPI (0.90 and 0.94 in session25_device.sh's run), each
# setting alternating with MPI in its own acoll-perf --rounds run.
# OUT=dir bash bench/session25_lane.sh
set -u
OUT=${OUT:-$PWD/session25_lane}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
for n in 4 8; do for lane in auto 256K 512K; do
  ACOLL_SHM_LANE_MAX=$lane timeout 80 python3 -m acoll.perf all_reduce -N $n -b 512K -e 4M -f 2 \
    -n 50 -w 10 --vs mpi --rounds 3 >"$OUT/lane_${lane}_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/lane_${lane}_$n.txt"
done; done
