#!/usr/bin/env bash
# Session 32's last device run (16-core GPU host, one H200, Python 3.12) at the final code:
# the whole suite with the GPU tests; acoll-perf all_reduce --vs gloo with 2, 4, 8 ranks,
# TCP only (the native ring's small calls on one thread); the shaped network, acoll then
# Gloo; all_reduce against Open MPI over shared memory with 8 ranks at 512 KiB to 4 MiB,
# NumPy arrays and registered buffers.
# OUT=dir NETBIN=.netbin bash bench/session32_device2.sh
set -u
OUT=${OUT:-$PWD/session32_device2}
. bench/device_steps.sh
device_start "$OUT"
SUITE_LIMIT=${SUITE_LIMIT:-260} WORKERS=12 device_suite "$OUT"
grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
for n in 8 4 2; do device_perf "$OUT" ar_$n.txt all_reduce -N $n -b 8 -e 128M -f 8; done
for lib in acoll gloo; do device_netns "$OUT" $lib --libs $lib; done
cat "$OUT/netns.txt"
for R in 0 1; do
  CUDA_VISIBLE_DEVICES= timeout 80 python3 -m acoll.perf all_reduce -N 8 -b 512K -e 4M -f 2 \
    -n 20 -w 5 -R $R --vs mpi --rounds 3 >"$OUT/shm_mpi_R$R.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$OUT/shm_mpi_R$R.txt"
  grep -A8 "acoll vs mpi" "$OUT/shm_mpi_R$R.txt" | tail -7
done
