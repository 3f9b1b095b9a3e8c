#!/usr/bin/env bash
# Session 24, issue 11 part 2: where 4 and 8 TCP ranks lose to Gloo (16-core GPU host, CPU
# only). The traffic's own ceiling (bench/tcp_raw_ring.py), per-thread CPU of acoll and Gloo
# ranks (bench/tcp_thread_cpu.py), acoll's transport settings one at a time, and the lane's
# 1 MiB cells against Open MPI.   OUT=dir bash bench/session24_tcp.sh
set -u
OUT=${OUT:-$PWD/session24_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES=
device_machine "$OUT"
R=$OUT/raw.txt; T=$OUT/threads.txt; V=$OUT/variants.txt
for n in 2 4 8; do for s in 16M 64M; do
  timeout 60 python3 bench/tcp_raw_ring.py $n $s 10 >>"$R" 2>&1
  timeout 60 python3 bench/tcp_raw_ring.py $n $s 10 --reduce >>"$R" 2>&1
done; done
export ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for n in 4 8; do for s in 16M 64M; do
  echo "## $n ranks $s" >>"$T"
  timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_thread_cpu.py acoll $s 20 2>&1 | sort >>"$T"
  GLOO_PORT=$((29500 + n)) timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_thread_cpu.py gloo $s 20 2>&1 | sort >>"$T"
done; done
for n in 4 8; do for s in 16M 64M; do
  for v in "ACOLL_SOCKET_SEND_THREADS=0" "ACOLL_SOCKET_SEND_THREADS=2" "ACOLL_CHUNK_SIZE=2M" \
           "ACOLL_SOCKET_BUFSIZE=4M" "ACOLL_SOCKET_NSOCKS=2" "LOOP=asyncio"; do
    echo "## $n ranks $s $v" >>"$V"
    env $v timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_thread_cpu.py acoll $s 20 2>&1 | sort >>"$V"
  done
done; done
unset ACOLL_SHM_DISABLE ACOLL_NET
for n in 4 8; do
  timeout 120 python3 -m acoll.perf all_reduce -N $n -b 512K -e 4M -f 2 -n 50 -w 10 --vs mpi \
    >"$OUT/lane_vs_mpi_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/lane_vs_mpi_$n.txt"
done
echo "session24_tcp: done" >>"$V"
