#!/usr/bin/env bash
# Session 46, one device call: where the copy counters crash two processes (issue 9).
# Each case of bench/counters_probe.py under acoll.run -n 2, then bench/via_host_paths.py
# with the counters at "up", all with bench/native/segv_bt.c preloaded (a native
# backtrace of any SIGSEGV) and faulthandler on (the Python one).
#   OUT=dir bash bench/session46_probe.sh
set -u
. bench/device_steps.sh
device_start "$OUT"
cc -O1 -g -shared -fPIC -o /tmp/segv_bt.so bench/native/segv_bt.c -ldl
export PYTHONFAULTHANDLER=1
{ which gdb compute-sanitizer eu-stack; ls /usr/local/cuda*/bin; } >"$OUT/tools.txt" 2>&1
for c in ${CASES:-mp-up mp-up-whole mp-up-uv mp-up-out mp-down mp-both-uv-out mp-down-nb-uv-out}; do
  echo "## $c" >>"$OUT/mp.txt"
  LD_PRELOAD=/tmp/segv_bt.so timeout 60 python3 -m acoll.run -n 2 -- \
    python3 bench/counters_probe.py "$c" >>"$OUT/mp.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/mp.txt"
done
grep "^## \|^== exit\|killed by\|Error:" "$OUT/mp.txt" | head -40
echo "## via_host_paths, counters up" >"$OUT/via.txt"
ACOLL_GPU_VIA_HOST_COUNTERS=up ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket \
  LD_PRELOAD=/tmp/segv_bt.so timeout 90 python3 -m acoll.run -n 2 -- \
  python3 bench/via_host_paths.py --mib 4 16 --rounds 2 >>"$OUT/via.txt" 2>&1
echo "== exit $? at $SECONDS s" >>"$OUT/via.txt"
grep -A12 "=== segv_bt" "$OUT/via.txt" | head -40
echo "## the in-process counters GPU test" >"$OUT/gpu_test.txt"
PYTHONPATH="$PWD/src:$PWD/tests:$SITE" ACOLL_GPU_VIA_HOST_COUNTERS=1 LD_PRELOAD=/tmp/segv_bt.so \
  timeout 150 python3 -m pytest -q \
  -p no:cacheprovider tests/test_gpu.py -k counters >>"$OUT/gpu_test.txt" 2>&1
echo "== exit $? at $SECONDS s" >>"$OUT/gpu_test.txt"
tail -5 "$OUT/gpu_test.txt"
