#!/usr/bin/env bash
# Session 46: after the fix of the copy counters' crash (pooled events destroyed by the
# cyclic collector), their GPU tests, then bench/via_host_paths.py with the counters'
# variants beside the default path, 2 and 4 processes sharing the GPU over TCP, and the
# loop-lag / 8 B latency run with the counters on.
#   OUT=dir bash bench/session46_measure.sh
set -u
. bench/device_steps.sh
device_start "$OUT"
PYTHONPATH="$PWD/src:$PWD/tests:$SITE" timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu.py -k "counters or native" >"$OUT/gpu_tests.txt" 2>&1
echo "== exit $? at $SECONDS s" >>"$OUT/gpu_tests.txt"
tail -3 "$OUT/gpu_tests.txt"
for n in ${RANKS:-2 4}; do
  echo "## $n ranks sharing one GPU, TCP (P2P and SHM off)" >>"$OUT/via_host.txt"
  ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 240 python3 -m acoll.run \
    -n $n -- python3 bench/via_host_paths.py --mib ${MIBS:-1 4 16 64} --rounds ${ROUNDS:-4} \
    --variants ${VARIANTS:-gpu gpu-counters gpu-counters-down gpu-counters-up} \
    >>"$OUT/via_host.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/via_host.txt"
done
grep "^##\|host/gpu\|== exit" "$OUT/via_host.txt" | cut -c1-110
ACOLL_GPU_VIA_HOST_COUNTERS=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket \
  timeout 120 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --gc collect \
  --iters 16 --json "$OUT/lag.json" >"$OUT/lag.txt" 2>&1
echo "== lag: exit $? at $SECONDS s" | tee -a "$OUT/lag.txt"
tail -6 "$OUT/lag.txt"
