#!/usr/bin/env bash
# Session 29, 16-core GPU host, CPU only, TCP only, 8 ranks, 16 MiB: where a rank's time
# goes in the ring, in halving-doubling and in Gloo (per-thread CPU from /proc,
# bench/tcp_thread_cpu.py), and a py-spy profile (native frames, idle included) of rank 0
# in the ring. py-spy is carried as a wheel in .whl/.
# OUT=dir bash bench/session29_device3.sh
set -u
OUT=${OUT:-$PWD/session29_device3}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
device_machine "$OUT"
t0=$SECONDS
for v in ring hd gloo ring; do
  case $v in gloo) lib=gloo; env=;; *) lib=acoll; env=ACOLL_ALGO=all_reduce:$v;; esac
  echo "## $v" >>"$OUT/threads.txt"
  env $env GLOO_PORT=29561 timeout 60 python3 -m acoll.run -n 8 -- \
    python3 bench/tcp_thread_cpu.py $lib 16M 40 2>&1 | grep -v "Warning\|UFUNCS" \
    | sort >>"$OUT/threads.txt"
  echo "== $v: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" >>"$OUT/threads.txt"
done
cat "$OUT/threads.txt" | grep -v "^\[rank [1-7]\]" | head -60
SPY_OUT="$OUT/spy_ring8.raw" timeout 120 python3 -m acoll.run -n 8 -- \
  bash bench/spy_rank0.sh python3 bench/tcp_rank_loop.py 16M 60 >"$OUT/spy_run.txt" 2>&1
echo "== spy: exit $? at $((SECONDS - t0)) s" >>"$OUT/spy_run.txt"
tail -3 "$OUT/spy_run.txt"
gzip -f "$OUT/spy_ring8.raw" 2>/dev/null
ls -la "$OUT"
