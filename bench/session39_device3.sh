#!/usr/bin/env bash
# Session 39, the 16-core GPU host, CPU only: where a lane all_reduce of 512 KiB to 2 MiB
# spends its time with 2, 4 and 8 ranks (bench/lane_waits.py: per rank, the time per op and
# the time its waits, combines and copies take), NumPy arrays (REG=0) and registered
# buffers (REG=1), each rank pinned to its own core (BIND=core) and not pinned.
# OUT=dir bash bench/session39_device3.sh
set -u
OUT=${OUT:-$PWD/session39_device3}
. bench/device_steps.sh
device_start "$OUT"
W=$OUT/waits.txt
for pass in 1 2; do
  for n in 8 4 2; do
    for reg in 0 1; do
      for bind in core none; do
        echo "## $n ranks, REG=$reg, BIND=$bind, pass $pass" >>"$W"
        if [ $bind = core ]; then B=core; else B=; fi
        CUDA_VISIBLE_DEVICES= timeout 60 python3 -m acoll.run -n $n -- env REG=$reg BIND=$B K=200 \
          python3 bench/lane_waits.py 512K 1M 2M >>"$W" 2>&1
        echo "== exit $? at $SECONDS s" >>"$W"
      done
    done
  done
done
# Open MPI's binding (by default: to a core up to 2 ranks, to a socket above) against
# every rank bound to its own core, and none, 8 ranks
for bind in core none socket; do
  echo "## 8 ranks, mpirun --bind-to $bind" >>"$OUT/pair_bind.txt"
  CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe --bind-to $bind \
    -np 8 python3 bench/lane_vs_mpi_pair.py 512K 1M 2M --rounds 4 2>&1 | grep -v "^# all_reduce" \
    >>"$OUT/pair_bind.txt"
  echo "== exit $? at $SECONDS s" >>"$OUT/pair_bind.txt"
done
