#!/usr/bin/env bash
# Session 23 (one H200): the "thread" completion wait (a waiter thread synchronizes an
# event, spinning in the driver without the GIL, then closes a pipe the loop watches; the first run used a blocking-sync event) against the others, in
# bench/gpu_kernels.py's completion table; awaited large P2P calls with ACOLL_GPU_WAIT=pipe
# and =thread alternating; the GPU tests with thread waits. OUT=dir bash bench/session23_wait.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/wait; mkdir -p "$S"
device_machine "$S"
timeout 150 python3 bench/gpu_kernels.py "$S/completion.txt" --only completion >/dev/null 2>"$S/completion.err"
echo "== completion exit $?" >>"$S/completion.txt"
for round in 1 2; do
  for m in pipe thread; do
    ACOLL_GPU_WAIT=$m timeout 100 python3 bench/p2p_bench.py inproc --no-nccl --colls all_reduce \
      --sizes 256K,16M,128M --json "$S/p2p_${m}_$round.json" >"$S/p2p_${m}_$round.txt" 2>&1
  done
done
ACOLL_GPU_WAIT=thread timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly -p no:benchmark -n 8 \
  tests/test_gpu.py tests/test_p2p_gpu.py tests/test_cuda_kernels.py >"$S/tests_thread.txt" 2>&1
echo "== tests exit $?" >>"$S/tests_thread.txt"
grep -A12 "D = 2000 us, uvloop\|D = 20 us, uvloop" "$S/completion.txt" | head -30
tail -2 "$S/tests_thread.txt"; cat "$S"/p2p_*_1.txt
tar czf "$OUT/wait.tgz" -C "$S" . && rm -rf "$S"
