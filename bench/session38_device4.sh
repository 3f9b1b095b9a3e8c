#!/usr/bin/env bash
# Session 38, the 16-core GPU host, CPU only: registered-buffer all_reduce against Open MPI
# (issue 11's 1 MiB cell), the code before this session's zero-copy changes (oldsrc/: a
# copy of src/ at 7077ad2, carried untracked) and after, alternating, 2 and 8 ranks.
# OUT=dir bash bench/session38_device4.sh
set -u
OUT=${OUT:-$PWD/session38_device4}
. bench/device_steps.sh
device_start "$OUT"
P=$OUT/pair_ab.txt
for pass in 1 2; do
  for n in 8 2; do
    for v in old new; do
      if [ $v = old ]; then src=$PWD/oldsrc; else src=$PWD/src; fi
      echo "## $v, $n ranks, pass $pass" >>"$P"
      PYTHONPATH="$src:$SITE" CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root \
        --oversubscribe -np $n python3 bench/lane_vs_mpi_pair.py 512K 1M 2M 4M --rounds 6 \
        --variants mpi,acoll,acoll-R 2>&1 | grep -v "^# all_reduce" >>"$P"
      echo "== exit $? at $SECONDS s" >>"$P"
    done
  done
done
cat "$P"
