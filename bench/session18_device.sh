#!/usr/bin/env bash
# Device batch of session 18 (one H200 host, 16 cores, Python 3.12): the lane's small
# all_reduce with 2, 4 and 8 ranks against Open MPI (lane on, lane off), then the whole
# suite. OUT=dir bash bench/session18_device.sh   (writes $OUT/lane16.tgz and text files)
set -u
OUT=${OUT:-$PWD/session18_device}
mkdir -p "$OUT"
. bench/device_steps.sh
W=$(mktemp -d)
t0=$SECONDS
device_machine "$W"
device_site
mpirun --version 2>&1 | head -1 >>"$W/machine.txt"
sweep="${SWEEP:--b 8 -e 64K -f 2 -n 2000 -w 200}"
export ACOLL_IB_DISABLE=1  # (benchmarks only: the suite runs with defaults)
for n in ${RANKS:-2 4 8}; do
  CUDA_VISIBLE_DEVICES= timeout 150 python3 -m acoll.perf all_reduce -N $n $sweep --vs mpi \
    --no-progress >"$W/lane_vs_mpi_${n}.txt" 2>&1
  echo "== lane vs mpi, $n ranks: exit $?" | tee -a "$W/lane_vs_mpi_${n}.txt"
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_LANE_MAX=0 timeout 100 python3 -m acoll.perf all_reduce -N $n \
    $sweep --no-progress >"$W/nolane_${n}.txt" 2>&1
  echo "== no lane, $n ranks: exit $?" | tee -a "$W/nolane_${n}.txt"
done
echo "== benchmarks done after $((SECONDS - t0)) s"
if [ -n "${WIDE:-}" ]; then
  for n in ${RANKS:-2 4 8}; do
    CUDA_VISIBLE_DEVICES= timeout 200 python3 -m acoll.perf all_reduce -N $n -b 8 -e 16M -f 4 -n 50 -w 5 \
      --vs mpi --no-progress >"$W/wide_vs_mpi_${n}.txt" 2>&1
    echo "== wide sweep vs mpi, $n ranks: exit $?" | tee -a "$W/wide_vs_mpi_${n}.txt"
    sed -n '/acoll vs mpi/,$p' "$W/wide_vs_mpi_${n}.txt"
  done
fi
unset ACOLL_IB_DISABLE
device_suite "$W"
tar czf "$OUT/session18.tgz" -C "$W" .
cp "$W/suite.txt" "$W/machine.txt" "$OUT/"
for n in ${RANKS:-2 4 8}; do
  echo "== $n ranks: acoll vs mpi"; sed -n '/acoll vs mpi/,$p' "$W/lane_vs_mpi_${n}.txt"
  echo "== $n ranks: no lane"; grep -E "^ +[0-9]+ " "$W/nolane_${n}.txt"
done >"$OUT/lane_summary.txt"
cat "$OUT/lane_summary.txt"
echo "== batch done after $((SECONDS - t0)) s"
