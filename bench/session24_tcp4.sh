#!/usr/bin/env bash
# Session 24, issue 11 part 2: paired, interleaved A/B of acoll's TCP variants against Gloo
# in the same processes (bench/tcp_ab.py), then the acoll-perf --vs gloo sweeps.
# OUT=dir bash bench/session24_tcp4.sh   (16-core GPU host, CPU only)
set -u
OUT=${OUT:-$PWD/session24_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab.txt
for n in 4 8 2; do
  for s in 2M 16M 64M 256M; do
    case $s in 2M) it=40; vs="chunks=8 gloo";; 16M) it=8; vs="chunks=8 chunks=0 chunks=4 headrule gloo";;
               64M) it=4; vs="chunks=8 chunks=0 chunks=4 headrule gloo";; *) it=2; vs="chunks=8 chunks=0 headrule gloo";; esac
    GLOO_PORT=$((29500 + n)) timeout 150 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
      --iters $it --rounds 5 --variants $vs 2>&1 | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
  done
done
for n in ${PERF_RANKS:-4 8}; do
  timeout 150 python3 -m acoll.perf all_reduce -N $n -b 8 -e 64M -f 8 -n 20 -w 5 --vs gloo \
    >"$OUT/tcp_vs_gloo_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/tcp_vs_gloo_$n.txt"
done
echo "session24_tcp4: done" >>"$A"
