#!/usr/bin/env bash
# Session 21 (2x H200), final code: the via-host paths at 64 MiB with 4 ranks, and the
# loop's lag during 64 MiB GPU all_reduces (pipelined copies above 1 MiB).
# OUT=dir bash bench/session21_last.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/last; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 80 python3 -m acoll.run -n "$1" -- "${@:2}"; }
run 2 python3 bench/gpu_loop_lag.py --diagnose --dump-ms 2 --iters 24 --gc collect \
  --json "$S/lag_collect.json" >"$S/lag_collect.txt" 2>&1; grep -h "worst_ms" "$S/lag_collect.txt"
run 4 python3 bench/via_host_paths.py --mib 64 --rounds 3 >"$S/paths_4.txt" 2>&1
grep -h "ranks\|##\|  gpu" "$S/paths_4.txt"
tar czf "$OUT/last.tgz" -C "$S" . && rm -rf "$S"
