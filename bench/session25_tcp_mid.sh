#!/usr/bin/env bash
# Prepared in session 24 for the next 16-core loan (issue 11 part 2): where 4 and 8 TCP ranks
# lose to Gloo at 2 to 16 MiB. Smaller chunks (a deeper ring pipeline) and the send thread's
# threshold, each paired with Gloo in the same processes (bench/tcp_ab.py), 5 rounds.
# OUT=dir bash bench/session25_tcp_mid.sh   (CPU only)
set -u
OUT=${OUT:-$PWD/session25_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab_mid.txt
for n in 4 8; do for s in 2M 4M 16M; do
  case $s in 2M) it=40;; 4M) it=20;; *) it=8;; esac
  GLOO_PORT=$((29500 + n)) timeout 150 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s \
    --iters $it --rounds 5 --variants chunks=8 chunk=256K chunk=128K offload=256K gloo 2>&1 \
    | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
done; done
for n in 4 8; do
  timeout 200 python3 -m acoll.perf all_reduce -N $n -b 256K -e 64M -f 4 -n 10 -w 3 --vs gloo \
    --rounds 3 >"$OUT/tcp_vs_gloo_rounds_$n.txt" 2>&1
  echo "== exit $?" >>"$OUT/tcp_vs_gloo_rounds_$n.txt"
done
echo "session25_tcp_mid: done" >>"$A"
