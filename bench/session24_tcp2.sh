#!/usr/bin/env bash
# Session 24, issue 11 part 2, after the send thread's rule changed (queued bytes, not the
# head frame's rest): acoll's TCP variants against Gloo per rank count and size, per-thread
# CPU (bench/tcp_thread_cpu.py).   OUT=dir bash bench/session24_tcp2.sh
# (THREAD_WAIT_MS: the send thread polled a full socket for up to 20 ms instead of handing
# it back; measured no better, the hook was removed after this run.)
set -u
OUT=${OUT:-$PWD/session24_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
V=$OUT/variants.txt
iters() { case $1 in 2M) echo 150;; 16M) echo 30;; 64M) echo 12;; *) echo 5;; esac; }
one() {  # one label, ranks, size, env...
  local label=$1 n=$2 s=$3; shift 3
  echo "## $n ranks $s $label" >>"$V"
  env "$@" timeout 90 python3 -m acoll.run -n $n -- python3 bench/tcp_thread_cpu.py \
    ${LIB:-acoll} $s $(iters $s) 2>&1 | sort | head -3 >>"$V"
}
for n in ${RANKS:-4 8 2}; do for s in 2M 16M 64M 256M; do
  one default $n $s X=1
  LIB=gloo one gloo $n $s GLOO_PORT=$((29500 + n))
  [ $s = 256M ] && continue
  one chunk2M $n $s ACOLL_CHUNK_SIZE=2M
  one wait20 $n $s THREAD_WAIT_MS=20
  if [ $n = 2 ]; then one offload_recv $n $s OFFLOAD_RECEIVING=1
                      one offload_recv_wait $n $s OFFLOAD_RECEIVING=1 THREAD_WAIT_MS=20
  else one threads2 $n $s ACOLL_SOCKET_SEND_THREADS=2; fi
done; done
echo "session24_tcp2: done" >>"$V"
