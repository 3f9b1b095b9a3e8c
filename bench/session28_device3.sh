#!/usr/bin/env bash
# Session 28's third device run (one H200 host, 16 cores, Python 3.12.3) at the final
# code: every collective registered buffers serve (all_reduce, all_gather, reduce_scatter,
# broadcast) against Open MPI in the same processes at 2, 4 and 8 ranks
# (bench/lane_vs_mpi_pair.py --coll), then the whole suite with the GPU tests.
# OUT=dir bash bench/session28_device3.sh
set -u
OUT=${OUT:-$PWD/session28_device3}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
export PYTHONPATH="$PWD/src:$SITE"
for c in all_reduce all_gather reduce_scatter broadcast; do
  P=$OUT/pair_$c.txt
  for n in 2 4 8; do
    CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n \
      python3 bench/lane_vs_mpi_pair.py 1M 4M 16M 64M --rounds 4 --coll $c 2>&1 \
      | tr -d '\000' >>"$P"
    echo "== $c $n ranks: exit ${PIPESTATUS[0]}" >>"$P"
  done
  grep -v "^#" "$P" | cut -c1-24,150-250
done
SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
