#!/usr/bin/env bash
# Session 31, 16-core GPU host, CPU only, TCP only: the native ring's small end after its
# helper threads (kept between calls), paired with the Python ring and Gloo in the same
# processes (bench/tcp_ab.py native python gloo), 128 and 256 KiB.
# OUT=dir bash bench/session31_device4.sh
set -u
OUT=${OUT:-$PWD/session31_device4}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
python3 -m acoll._native >"$OUT/build.txt" 2>&1
A=$OUT/ab.txt
t0=$SECONDS
for ns in ${SIZES:-2:256K 4:256K 8:256K 2:128K 4:128K 8:128K}; do
  n=${ns%%:*}; s=${ns##*:}
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket GLOO_PORT=$((29500 + n)) \
    timeout 40 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters 50 \
    --rounds 4 --variants native python gloo 2>&1 \
    | grep "rank 0\]" | grep -v "Warning\|UFUNCS" | sed 's/^\[rank 0\] //' >>"$A"
  echo "== $n ranks $s: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$A"
done
grep -v "^# " "$A"
