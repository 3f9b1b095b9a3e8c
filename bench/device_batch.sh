#!/usr/bin/env bash
# One device call: the steps of bench/device_steps.sh named on the command line, in order,
# each writing under OUT. Steps: start (site, machine, native ring), site, machine, suite,
# lane_tests, lane_mpi_ab (needs oldsrc/: the code to compare against, untracked, carried
# with the tree), lane_mpi_variants, lane_limit_ab, lane_piece_ab, via_host, issue9, shm_mpi,
# p2p. Settings pass through the environment
# (PASSES, RANKS, SUITE_LIMIT, ROUNDS for shm_mpi, ITERS for p2p). Carry .whl/
# (bench/prepare_device.sh). Examples:
#   OUT=$OUT/r SUITE_LIMIT=360 bash bench/device_batch.sh start suite lane_mpi_variants
#   OUT=$OUT/ab PASSES=3 RANKS="8 4 2" bash bench/device_batch.sh start lane_tests lane_mpi_ab
set -u
OUT=${OUT:-$PWD/device_batch}
. bench/device_steps.sh
[ $# -gt 0 ] || { echo "usage: OUT=dir bash bench/device_batch.sh STEP..." >&2; exit 2; }
for step in "$@"; do
  case $step in
    start|site|machine|suite|lane_tests|lane_mpi_ab|lane_mpi_variants|lane_limit_ab|lane_piece_ab|via_host|issue9) ;;
    shm_mpi|p2p) ;;
    *) echo "device_batch.sh: unknown step '$step'" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
for step in "$@"; do
  echo "== $step at $SECONDS s"
  case $step in
    site) device_site ;;
    shm_mpi) device_shm_mpi "$OUT" "${ROUNDS:-3}" ;;
    p2p) device_p2p "$OUT" "${ITERS:-1000}" ;;
    *) "device_$step" "$OUT" ;;
  esac
done
echo "== done at $SECONDS s"
