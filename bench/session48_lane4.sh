#!/usr/bin/env bash
# Session 48: 4 ranks on the 16-core host at 1 MiB sit at Open MPI's level (0.99x) while
# 2 MiB is 1.17 to 1.21x: is 1 MiB a step off the size curve, and does the lane size
# (ACOLL_SHM_LANE_MAX: the step per peer) move it? In-place float32 sum, NumPy arrays.
#   OUT=dir [PASSES=2] [SIZES="512K 1M 2M"] [LIMITS="auto 128K 64K"] \
#     bash bench/session48_lane4.sh
set -u
. bench/device_steps.sh
if [ -f "$OUT/machine.txt" ]; then device_site; else device_start "$OUT"; fi
P=$OUT/lane4.txt
for pass in $(seq "${PASSES:-2}"); do
  for lim in ${LIMITS:-auto 128K 64K}; do
    echo "## ${NP:-4} ranks, ACOLL_SHM_LANE_MAX=$lim, pass $pass" >>"$P"
    CUDA_VISIBLE_DEVICES= ACOLL_SHM_LANE_MAX=$lim timeout 100 mpirun --allow-run-as-root \
      --oversubscribe -x ACOLL_SHM_LANE_MAX -np ${NP:-4} python3 bench/lane_vs_mpi_pair.py \
      ${SIZES:-512K 1M 2M} --rounds ${ROUNDS:-6} --variants mpi,acoll 2>&1 \
      | grep -v "^# all_reduce" >>"$P"
    echo "== exit $? at $SECONDS s" >>"$P"
  done
done
cat "$P"
