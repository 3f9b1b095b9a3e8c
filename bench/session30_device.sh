#!/usr/bin/env bash
# Session 30 on the 16-core GPU host, CPU only, TCP only (issue 11 part 2): receive threads
# reading into users' buffers (the ring's all-gather payloads, `recvuser`) and from smaller
# payloads (`recvmin=`), paired with the current code and Gloo (bench/tcp_ab.py); then each
# thread's CPU share (bench/tcp_thread_cpu.py) at 8 ranks, 16 MiB, with and without.
# OUT=dir bash bench/session30_device.sh
set -u
OUT=${OUT:-$PWD/session30_device}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
A=$OUT/ab.txt
t0=$SECONDS
V="chunks=8 recvuser recvmin=256K recvuser+recvmin=256K recvuser+recvmin=384K gloo"
for ns in 8:2M 8:4M 8:8M 8:16M 8:64M 4:2M 4:4M 4:16M 4:64M; do
  n=${ns%%:*}; s=${ns##*:}
  case $s in 2M|4M) it=20;; 64M) it=4;; *) it=8;; esac
  GLOO_PORT=$((29500 + n)) timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py \
    $s --iters $it --rounds 4 --variants $V 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
cat "$A"
T=$OUT/threads.txt
for v in base user user256 gloo; do
  case $v in
    gloo) lib=gloo; env=;;
    base) lib=acoll; env=;;
    user) lib=acoll; env=RECV_USER=1;;
    user256) lib=acoll; env="RECV_USER=1 RECV_MIN=256K";;
  esac
  echo "## $v" >>"$T"
  env $env GLOO_PORT=29561 timeout 60 python3 -m acoll.run -n 8 -- \
    python3 bench/tcp_thread_cpu.py $lib 16M 40 2>&1 | grep -v "Warning\|UFUNCS" | sort >>"$T"
  echo "== $v: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$T"
done
grep -v "^\[rank [1-7]\]" "$T"
