#!/usr/bin/env bash
# Session 30, 16-core host, CPU only: why both libraries stay under 90% of the line on the
# shaped network. The runs of session30_device2.sh saw 11,000 to 12,000 TCP fast
# retransmits per run (acoll and Gloo alike) with no tbf drop. Here: each run's TCP counters
# with DSACKs (spurious retransmits) and the CPUs' backlog drops, and acoll with its
# sockets' buffers capped (ACOLL_SOCKET_BUFSIZE: a shorter queue on the link, so a lost
# segment's retransmit arrives sooner), on the shaped network and, paired with Gloo in each
# run, on loopback with 8 and 4 ranks (bench/tcp_ab.py).
# OUT=dir NETBIN=.netbin bash bench/session30_device3.sh
set -u
OUT=${OUT:-$PWD/session30_device3}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
S=$OUT/netns.txt
run() {  # name, then netns_shaped.py arguments
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= PATH="$PWD/${NETBIN:-.netbin}:$PATH" timeout 100 python3 \
    bench/netns_shaped.py --rate 10gbit -b 16M -e 64M -f 2 -n 20 -w 5 --timeout 90 "$@" \
    >"$OUT/$name.log" 2>&1
  { echo "## $name: exit $?"; grep -A5 "acoll_busbw\|gloo_busbw" "$OUT/$name.log" \
      | grep -v "^# target"; grep "^# \(acoll\|gloo\): wall\|TCP:" "$OUT/$name.log"; } >>"$S"
}
run default --libs acoll
run buf1m --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=1M
run buf512k --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=512K
run gloo --libs gloo
run buf2m --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=2M
run buf1m_b --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=1M
run default_b --libs acoll
cat "$S"
rm -f "$OUT"/*.log
A=$OUT/loopback.txt
for buf in 0 1M; do
  for ns in 8:16M 8:64M 4:16M; do
    n=${ns%%:*}; s=${ns##*:}
    case $s in 64M) it=4;; *) it=8;; esac
    CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket ACOLL_SOCKET_BUFSIZE=$buf \
      GLOO_PORT=$((29500 + n)) timeout 60 python3 -m acoll.run -n $n -- python3 \
      bench/tcp_ab.py $s --iters $it --rounds 4 --variants chunks=8 gloo 2>&1 \
      | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed "s/^\[rank 0\] /buf=$buf /" >>"$A"
  done
done
cat "$A"
