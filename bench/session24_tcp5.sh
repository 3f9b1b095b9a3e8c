#!/usr/bin/env bash
# Session 24, issue 11 part 2: split sockets (each direction of a connection on its own
# socket, so the send thread works on 2-rank rings too) on and off, each run paired with
# Gloo in the same processes (bench/tcp_ab.py), then the acoll-perf --vs gloo
# sweeps at the defaults.   OUT=dir bash bench/session24_tcp5.sh   (16-core host, CPU only)
set -u
OUT=${OUT:-$PWD/session24_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab.txt
for n in 2 4 8; do
  for s in 2M 16M 64M 256M; do
    case $s in 2M) it=40;; 16M) it=8;; 64M) it=4;; *) it=2;; esac
    for split in 1 0; do
      echo "# ACOLL_SOCKET_SPLIT=$split" >>"$A"
      ACOLL_SOCKET_SPLIT=$split GLOO_PORT=$((29500 + n)) timeout 150 python3 -m acoll.run -n $n -- \
        python3 bench/tcp_ab.py $s --iters $it --rounds 4 --variants chunks=8 gloo 2>&1 \
        | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
    done
  done
done
for n in ${PERF_RANKS:-2 4 8}; do
  timeout 150 python3 -m acoll.perf all_reduce -N $n -b 8 -e 256M -f 8 -n 20 -w 5 --vs gloo \
    >"$OUT/tcp_vs_gloo_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/tcp_vs_gloo_$n.txt"
done
echo "session24_tcp5: done" >>"$A"
