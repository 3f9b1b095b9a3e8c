#!/usr/bin/env bash
# Session 38, one H200: issue 9's loop-lag target measured afresh (five runs, 2 ranks
# sharing the GPU, over TCP through the host, each long gap with the loop thread's CPU
# time in it), then the via-host paths at 1 and 4 MiB with 2 and 4 ranks.
# OUT=dir bash bench/session38_device1.sh
set -u
OUT=${OUT:-$PWD/session38_device1}
. bench/device_steps.sh
device_start "$OUT"
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for i in 1 2 3 4 5; do
  timeout 100 python3 -m acoll.run -n 2 -- python3 bench/gpu_loop_lag.py --diagnose \
    --gc collect --dump-ms 2 --iters 16 --json "$OUT/lag_$i.json" >"$OUT/lag_$i.txt" 2>&1
  echo "== lag $i: exit $? at $SECONDS s" >>"$OUT/lag_$i.txt"
done
python3 - "$OUT" <<'PY' | tee "$OUT/lag_summary.txt"
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/lag_*.json")):
    d = json.load(open(f))
    for k in ("gpu_lag", "host_lag"):
        g = d[k]
        print(f, k, "worst %.2f ms p99 %.3f over1 %d over2 %d" % (g["worst_ms"], g["p99_ms"],
              g["over_1ms"], g["over_2ms"]), "top(gap,cpu)", g["longest_ms_and_loop_cpu_ms"],
              "gc", g.get("gc_passes_over_0.5ms"), "op %.1f ms" % g["op_ms"])
    print(f, "latency delta %.1f us" % d["latency_delta_us"])
PY
for n in 2 4; do
  timeout 150 python3 -m acoll.run -n $n -- python3 bench/via_host_paths.py --mib 1 4 \
    --rounds 6 >"$OUT/paths_$n.txt" 2>&1
  echo "== paths $n: exit $? at $SECONDS s" >>"$OUT/paths_$n.txt"
  tail -n 30 "$OUT/paths_$n.txt"
done
