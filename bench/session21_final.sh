#!/usr/bin/env bash
# Session 21, issue 9 (2x H200), final code: the whole suite on the device's Python, the
# via-host paths side by side (2 and 4 ranks, one per process), the 8 B latency GPU vs
# host (interleaved) and the loop's lag during 64 MiB GPU all_reduces.
# OUT=dir bash bench/session21_final.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/final; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=260 device_suite "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 150 python3 -m acoll.run -n "$1" -- "${@:2}"; }
run 2 python3 bench/via_host_paths.py --mib 1 4 16 64 --rounds 6 >"$S/paths_2.txt" 2>&1
grep -h "ranks\|##\|  gpu" "$S/paths_2.txt"
run 4 python3 bench/via_host_paths.py --mib 1 4 16 64 --rounds 4 >"$S/paths_4.txt" 2>&1
grep -h "ranks\|##\|  gpu" "$S/paths_4.txt"
run 2 python3 bench/gpu_latency_ab.py --bytes 8 --rounds 20 --json "$S/ab_8.json" \
  >"$S/ab_8.txt" 2>&1; tail -n 2 "$S/ab_8.txt"
run 2 python3 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --gc collect \
  --json "$S/lag_collect.json" >"$S/lag_collect.txt" 2>&1; grep -h "worst_ms" "$S/lag_collect.txt"
tar czf "$OUT/final.tgz" -C "$S" . && rm -rf "$S"
