#!/usr/bin/env bash
# Session 32 (16-core GPU host, CPU only, TCP only): the native ring's small calls on one
# thread (ACOLL_NATIVE_INLINE) against its helper thread, the Python ring and Gloo, paired
# in the same processes (bench/tcp_ab.py); full all_reduce sweeps --vs gloo with 2, 4, 8
# ranks; the shaped network with socket buffer sizes (ACOLL_SOCKET_BUFSIZE) against the
# kernel's autotuning, and Gloo.
# OUT=dir NETBIN=.netbin bash bench/session32_device.sh
set -u
OUT=${OUT:-$PWD/session32_device}
. bench/device_steps.sh
device_start "$OUT"
timeout 150 python3 -m pytest -q -p no:benchmark -p no:randomly -p no:cacheprovider \
  tests/test_native_ring.py >"$OUT/native_tests.txt" 2>&1
echo "== native tests: exit $?" >>"$OUT/native_tests.txt"
tail -n 2 "$OUT/native_tests.txt"
A=$OUT/ab.txt
for ns in ${SIZES:-2:256K 4:256K 8:256K 2:128K 4:1M 8:1M}; do
  n=${ns%%:*}; s=${ns##*:}
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) \
    timeout 60 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters 50 \
    --rounds 4 --variants inline=1M inline=-1 python gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $SECONDS s" >>"$A"
done
grep -v "^# " "$A"
for n in 2 4 8; do device_perf "$OUT" ar_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
if [ "${NETNS:-1}" = 1 ]; then
  device_netns "$OUT" acoll_auto --libs acoll
  device_netns "$OUT" acoll_buf1m --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=1M
  device_netns "$OUT" gloo --libs gloo
  device_netns "$OUT" acoll_buf4m --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=4M
  device_netns "$OUT" acoll_auto2 --libs acoll
  device_netns "$OUT" acoll_buf1m2 --libs acoll --acoll-env ACOLL_SOCKET_BUFSIZE=1M
  cat "$OUT/netns.txt"
fi
