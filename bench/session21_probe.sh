#!/usr/bin/env bash
# Session 21, issue 9 (2x H200): where 1 to 64 MiB GPU all_reduces over sockets spend their
# time (stages of the ordered path), against the host and the direct path at every size;
# 4 ranks as one process per rank (two contexts per GPU) and as two ranks per process.
# OUT=dir bash bench/session21_probe.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/probe; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 150 python3 -m acoll.run -n "$1" -- "${@:2}"; }
B="python3 bench/via_host_breakdown.py --mib 1 4 16 64 --direct"
run 2 $B >"$S/breakdown_2.txt" 2>&1; tail -n 40 "$S/breakdown_2.txt"
run 4 $B >"$S/breakdown_4.txt" 2>&1
ACOLL_INPROC_DISABLE=1 run 2 $B --per-proc 2 >"$S/breakdown_4_shared.txt" 2>&1
grep -h "ranks\|##\|gpu" "$S/breakdown_4.txt" "$S/breakdown_4_shared.txt"
SPY_OUT=$S/spy_64in.txt run 2 bash bench/spy_rank0.sh python3 bench/via_host_breakdown.py \
  --mib 64 --rounds 3 >"$S/spy_run.txt" 2>&1
tar czf "$OUT/probe.tgz" -C "$S" . && rm -rf "$S"
