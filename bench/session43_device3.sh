#!/usr/bin/env bash
# Session 43, the GPU host: the whole suite (and the GPU tests) on its Python 3.12 with the
# records shortcut of ea6a4a1, then all_reduce of NumPy arrays against Open MPI at 1, 2 and
# 4 MiB with 2, 4 and 8 ranks, twice: on a communicator with a registered allocation (as in
# session43_device2.sh) and on one without (a NumPy-only program).
# Carry .whl/ (bench/prepare_device.sh). OUT=dir bash bench/session43_device3.sh
set -u
OUT=${OUT:-$PWD/session43_device3}
. bench/device_steps.sh
mkdir -p "$OUT"
device_site
device_machine "$OUT"
SUITE_LIMIT=360 device_suite "$OUT"
P=$OUT/pair.txt
for pass in 1 2; do
  for n in 2 4 8; do
    for v in mpi,acoll,acoll-R mpi,acoll; do
      echo "## $n ranks, variants $v, pass $pass" >>"$P"
      CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n \
        python3 bench/lane_vs_mpi_pair.py 1M 2M 4M --rounds 8 --variants $v 2>&1 \
        | grep -v "^# all_reduce" >>"$P"
      echo "== exit $? at $SECONDS s" >>"$P"
    done
  done
done
echo "== done at $SECONDS s"
