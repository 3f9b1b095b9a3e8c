#!/usr/bin/env bash
# Device batch of session 19 (one H200 host, 16 cores, CPU only, Python 3.12): host
# collectives between processes through the lane (one slot, or in steps above a slot)
# against Open MPI, 2, 4 and 8 ranks; the one-shot/two-shot switch for 4 and 8 ranks;
# with TESTS=1, then the lane and shared-memory tests. OUT=dir bash bench/session19_device.sh
set -u
OUT=${OUT:-$PWD/session19_device}
mkdir -p "$OUT"
. bench/device_steps.sh
t0=$SECONDS
device_machine "$OUT"
device_site
mpirun --version 2>&1 | head -1 >>"$OUT/machine.txt"
export ACOLL_IB_DISABLE=1 CUDA_VISIBLE_DEVICES=
perf() { timeout "$1" python3 -m acoll.perf "${@:2}" --no-progress; }
for n in ${WIDE-2 4 8}; do
  perf 150 all_reduce -N $n -b 8 -e 64M -f 4 -n 30 -w 5 --vs mpi >"$OUT/all_reduce_vs_mpi_$n.txt" 2>&1
  echo "== all_reduce vs mpi, $n ranks: exit $? ($((SECONDS - t0)) s)"
  sed -n '/acoll vs mpi/,$p' "$OUT/all_reduce_vs_mpi_$n.txt"
done
for n in ${TUNE:+4 8}; do  # (TUNE=1: needs the temporary ACOLL_TUNE_ONE_SHOT_BYTES knob)
  for b in 65536 262144 4194304; do
    ACOLL_TUNE_ONE_SHOT_BYTES=$b perf 60 all_reduce -N $n -b 8K -e 1M -f 2 -n 300 -w 30 \
      >"$OUT/one_shot_${n}_$b.txt" 2>&1
    echo "== one-shot budget $b, $n ranks: exit $?"
    grep -E "^ +[0-9]+ " "$OUT/one_shot_${n}_$b.txt" | awk '{print $1, $6, $10}'
  done
done
if [ -n "${FINE:-}" ]; then  # 1 to 16 MiB, factor 2, three runs per rank count
  for k in 1 2 3; do
    for n in 2 4 8; do
      perf 150 all_reduce -N $n -b 1M -e 16M -f 2 -n 50 -w 5 --vs mpi \
        >"$OUT/fine_${k}_$n.txt" 2>&1
      echo "== run $k, all_reduce 1-16 MiB vs mpi, $n ranks: exit $? ($((SECONDS - t0)) s)"
      sed -n '/acoll vs mpi/,$p' "$OUT/fine_${k}_$n.txt" | grep -E "^ +[0-9]"
    done
  done
fi
for c in ${OTHERS-all_gather reduce_scatter}; do
  for n in 2 4 8; do
    perf 120 $c -N $n -b 64K -e 64M -f 4 -n 20 -w 3 --vs mpi >"$OUT/${c}_vs_mpi_$n.txt" 2>&1
    echo "== $c vs mpi, $n ranks: exit $? ($((SECONDS - t0)) s)"
    sed -n '/acoll vs mpi/,$p' "$OUT/${c}_vs_mpi_$n.txt"
  done
done
unset ACOLL_IB_DISABLE CUDA_VISIBLE_DEVICES
if [ -n "${TESTS:-}" ]; then
  timeout 300 make test-gpu PYTEST_ARGS="tests/test_lane.py tests/test_transport_shm.py -q -n 4 \
    -p no:randomly -p no:benchmark --timeout 200" >"$OUT/tests.txt" 2>&1
  echo "== lane and shm tests: exit $?"; tail -n 3 "$OUT/tests.txt"
fi
echo "== batch done after $((SECONDS - t0)) s"
tar czf "$OUT.tgz" -C "$OUT" . && rm -rf "$OUT" && mkdir -p "$OUT" && mv "$OUT.tgz" "$OUT/all.tgz"
