#!/usr/bin/env bash
# Session 25, the 16-core host, CPU only (issue 11): the lane and SHM against Open MPI with
# 2, 4 and 8 ranks (acoll-perf --vs mpi --rounds 3), then where 4 and 8 TCP ranks lose to
# Gloo at 2 and 16 MiB (bench/tcp_ab.py: ring chunk and chunk-size variants, paired).
# OUT=dir bash bench/session25_device.sh
set -u
OUT=${OUT:-$PWD/session25_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
{ command -v mpirun; mpirun --version 2>&1 | head -1; python3 -c "import mpi4py; print('mpi4py', mpi4py.__version__)"; } >>"$OUT/machine.txt" 2>&1
for n in 2 4 8; do
  timeout 100 python3 -m acoll.perf all_reduce -N $n -b 1M -e 64M -f 4 -n 20 -w 5 --vs mpi \
    --rounds 3 >"$OUT/shm_vs_mpi_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/shm_vs_mpi_$n.txt"
done
export ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
A=$OUT/tcp_ab_mid.txt
for n in 4 8; do for s in 2M 16M; do
  case $s in 2M) it=40;; *) it=8;; esac
  GLOO_PORT=$((29500 + n)) timeout 60 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 4 --variants chunks=8 chunk=256K chunk=128K offload=256K gloo 2>&1 \
    | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]}" >>"$A"
done; done
echo "session25_device: done" >>"$OUT/machine.txt"
