#!/usr/bin/env bash
# Session 50: what floating-point AVG costs now that it scales each input by 1/n first
# (NCCL's PreMulSum) and sums: acoll-perf all_reduce, AVG against SUM in the same call,
# float16 on one GPU shared by 2 ranks (TCP between them, P2P on and off) and float32 on
# host buffers (4 ranks). Carry .whl/ (bench/prepare_device.sh); results under OUT.
set -u
OUT=${OUT:-$PWD/avg}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
# (a command, not a shell function: timeout runs commands)
perf="python3 -m acoll.perf all_reduce -b 8 -e ${MAX:-64M} -f 8 -n 20 -w 5"
for op in sum avg; do
  timeout 150 $perf -N 2 --device cuda -d float16 -o $op >"$OUT/gpu_p2p_$op.txt" 2>&1
  echo "== gpu p2p $op: exit $?" >>"$OUT/gpu_p2p_$op.txt"
  ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 150 \
    $perf -N 2 --device cuda -d float16 -o $op >"$OUT/gpu_tcp_$op.txt" 2>&1
  echo "== gpu tcp $op: exit $?" >>"$OUT/gpu_tcp_$op.txt"
  timeout 120 $perf -N 4 -d float32 -o $op >"$OUT/cpu4_$op.txt" 2>&1
  echo "== cpu 4 ranks $op: exit $?" >>"$OUT/cpu4_$op.txt"
done
