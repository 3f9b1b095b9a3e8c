#!/usr/bin/env bash
# Session 28, one H200 host (16 cores, Python 3.12.3), CPU only for issue 11: the lane's
# zero-copy all_reduce on registered buffers (acoll.empty_shared + register) against Open
# MPI in the same processes (bench/lane_vs_mpi_pair.py) and in acoll-perf's alternating
# rounds (-R 1 --vs mpi --rounds 3), 2, 4 and 8 ranks; then the whole suite with the GPU
# tests on the host's own Python. OUT=dir bash bench/session28_device.sh
set -u
OUT=${OUT:-$PWD/session28_device}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
python3 -m pip list 2>/dev/null | grep -i "^pytest\|^mpi4py\|^numpy " >>"$OUT/machine.txt"
export PYTHONPATH="$PWD/src:$SITE"
P=$OUT/pair.txt
for n in 2 4 8; do
  CUDA_VISIBLE_DEVICES= timeout 120 mpirun --allow-run-as-root --oversubscribe -np $n \
    python3 bench/lane_vs_mpi_pair.py 512K 1M 2M 4M 16M 64M --rounds ${ROUNDS:-6} >>"$P" 2>&1
  echo "== $n ranks: exit $?" >>"$P"
done
cat "$P"
if [ -n "${PERF:-1}" ]; then
  for n in 2 4 8; do
    CUDA_VISIBLE_DEVICES= timeout 100 python3 -m acoll.perf all_reduce -N $n -b 1M -e 64M -f 4 \
      -n 20 -w 5 -R 1 --vs mpi --rounds 3 >"$OUT/perf_R1_$n.txt" 2>&1
    echo "== exit $?" >>"$OUT/perf_R1_$n.txt"
    grep -A7 "acoll vs mpi" "$OUT/perf_R1_$n.txt" | tail -5
  done
fi
if [ -n "${SUITE:-1}" ]; then
  SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
  grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
fi
