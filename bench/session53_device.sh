#!/usr/bin/env bash
# Session 53's device calls: 16-bit floats on the native loops (ring.c), against the code
# before them (oldsrc/: session 52's src/, carried untracked), in the same call.
#   OUT=dir bash bench/session53_device.sh bench   the benchmarks below
#   OUT=dir bash bench/session53_device.sh suite   the whole suite with the GPU tests
#   OUT=dir bash bench/session53_device.sh quick   the new GPU tests, float16 old/new, Gloo
# bench:
#   gpu_{old,new}_DTYPE_OP.txt  acoll-perf all_reduce on GPU buffers, 2 processes sharing
#       the GPU over TCP (the staged path through the host), 8 B to 16 MiB, old and new
#       code alternating per case;
#   cpu_{old,new}_float16_4.txt  4 ranks, host buffers, shared memory (the lane), float16;
#   cpu_gloo_DTYPE_4.txt  4 ranks, TCP only, against Gloo in the same run.
# Carry .whl/ (bench/prepare_device.sh) and oldsrc/.
set -u
OUT=${OUT:-$PWD/session53}
. bench/device_steps.sh
device_start "$OUT" >/dev/null 2>&1 || echo "device_start failed (see $OUT)"
perf="python3 -m acoll.perf all_reduce -n 20 -w 5"

tree() {  # old|new: the PYTHONPATH of that code
  if [ "$1" = old ]; then echo "$PWD/oldsrc:$SITE"; else echo "$PWD/src:$SITE"; fi
}

bench() {
  local dt op t f
  for case in float16:sum float16:avg bfloat16:sum float32:avg; do
    dt=${case%:*} op=${case#*:}
    for t in old new; do
      f="$OUT/gpu_${t}_${dt}_${op}.txt"
      PYTHONPATH=$(tree $t) ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket \
        timeout 100 $perf -b 8 -e 16M -f 8 -N 2 --device cuda -d "$dt" -o "$op" >"$f" 2>&1
      echo "== gpu $t $dt $op: exit $? at $SECONDS s" | tee -a "$f"
    done
  done
  for t in old new; do
    f="$OUT/cpu_${t}_float16_4.txt"
    PYTHONPATH=$(tree $t) CUDA_VISIBLE_DEVICES= timeout 100 \
      $perf -b 1K -e 16M -f 4 -N 4 -d float16 >"$f" 2>&1
    echo "== cpu $t float16 4 ranks: exit $? at $SECONDS s" | tee -a "$f"
  done
  for dt in float16 bfloat16; do
    device_perf "$OUT" "cpu_gloo_${dt}_4.txt" all_reduce -b 1K -e 16M -f 4 -N 4 -d "$dt"
  done
}

quick() {  # what a short loan allows: the new GPU tests, then float16 old/new and Gloo
  local t0=$SECONDS
  PYTHONPATH="$PWD/src:$PWD/tests:$SITE" timeout 220 python3 -m pytest -q -p no:randomly \
    -p no:cacheprovider -n 4 --timeout 200 -rs tests/test_gpu.py tests/test_p2p_gpu.py \
    tests/test_avg.py tests/test_native_halves.py -k "small_average or native_ring_pipelines \
    or average_scales or bit_identical or matrix_copy_mode or halves or numpy" \
    >"$OUT/gpu_tests.txt" 2>&1
  echo "== gpu tests: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/gpu_tests.txt"
  tail -n 4 "$OUT/gpu_tests.txt"
  local op t f
  for op in sum avg; do
    for t in old new; do
      f="$OUT/gpu_${t}_float16_${op}.txt"
      PYTHONPATH=$(tree $t) ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket \
        timeout 60 $perf -b 8 -e 16M -f 8 -N 2 --device cuda -d float16 -o "$op" >"$f" 2>&1
      echo "== gpu $t float16 $op: exit $? at $SECONDS s" | tee -a "$f"
    done
  done
  device_perf "$OUT" cpu_gloo_float16_4.txt all_reduce -b 1K -e 16M -f 4 -N 4 -d float16
}

case "${1:-bench}" in
  bench) bench ;;
  quick) quick ;;
  suite) device_suite "$OUT"; gzip -kf "$OUT/suite.txt" 2>/dev/null ;;
  *) echo "usage: $0 bench|suite" >&2; exit 2 ;;
esac
