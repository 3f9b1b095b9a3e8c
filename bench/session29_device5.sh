#!/usr/bin/env bash
# Session 29, 16-core GPU host, CPU only: (1) one TCP hop's latency between two processes
# with the send and receive threads off and on (bench/transport_pingpong.py), (2) a py-spy
# profile (native frames, idle included) of rank 0 of an 8-rank ring all-reduce of 16 MiB
# over TCP. py-spy is carried as a wheel (.whl/); SUITE=1 also runs the whole suite with
# the GPU tests (pytest-asyncio carried likewise).
# OUT=dir bash bench/session29_device5.sh
set -u
OUT=${OUT:-$PWD/session29_device5}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
device_machine "$OUT"
t0=$SECONDS
for t in 0 1; do for sz in 65536 524288 1048576 4194304; do
  ACOLL_SOCKET_SEND_THREADS=$t ACOLL_SOCKET_RECV_THREADS=$t CUDA_VISIBLE_DEVICES= timeout 60 \
    python3 bench/transport_pingpong.py socket 400 $sz 2>&1 | tail -1 \
    | sed "s/^/threads=$t: /" >>"$OUT/pingpong.txt"
done; done
cat "$OUT/pingpong.txt"
command -v py-spy >>"$OUT/spy_run.txt" 2>&1
CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket SPY_OUT="$OUT/spy_ring8.raw" \
  timeout 120 python3 -m acoll.run -n 8 -- bash bench/spy_rank0.sh python3 \
  bench/tcp_rank_loop.py 16M 60 2>&1 | grep -v "Warning\|UFUNCS" >>"$OUT/spy_run.txt"
echo "== spy: exit $? at $((SECONDS - t0)) s" >>"$OUT/spy_run.txt"
grep "rank 0\]" "$OUT/spy_run.txt" | tail -2
gzip -f "$OUT/spy_ring8.raw" 2>/dev/null
if [ "${SUITE:-0}" = 1 ]; then
  SUITE_LIMIT=${SUITE_LIMIT:-300} WORKERS=12 device_suite "$OUT"
  grep -h "^FAILED\|^ERROR" "$OUT/suite.txt" | head -20
fi
