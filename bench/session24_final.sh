#!/usr/bin/env bash
# Session 24: the send thread's threshold at mid sizes (bench/tcp_ab.py, 4 and 8 ranks, paired
# with Gloo), then the GPU tests that stage through TCP (split sockets and capped ring chunks
# are on by default on this 16-core host) on one H200.   OUT=dir bash bench/session24_final.sh
set -u
OUT=${OUT:-$PWD/session24_out}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
A=$OUT/ab_offload.txt
for n in 4 8; do for s in 2M 16M; do
  case $s in 2M) it=40;; *) it=8;; esac
  ACOLL_SHM_DISABLE=1 ACOLL_NET=socket CUDA_VISIBLE_DEVICES= GLOO_PORT=$((29500 + n)) \
    timeout 100 python3 -m acoll.run -n $n -- python3 bench/tcp_ab.py $s --iters $it \
    --rounds 4 --variants chunks=8 offload=256K offload=128K gloo 2>&1 \
    | grep "rank 0\]" | sed 's/^\[rank 0\] //' >>"$A"
done; done
timeout --kill-after=10 200 make test-gpu PYTEST_ARGS="-q -n 8 -p no:randomly -p no:benchmark -rs \
  --timeout 150 tests/test_gpu.py tests/test_staging.py tests/test_transport_tcp.py" \
  >"$OUT/tests.txt" 2>&1
echo "== tests: exit $?" >>"$OUT/tests.txt"
tail -n 3 "$OUT/tests.txt"
