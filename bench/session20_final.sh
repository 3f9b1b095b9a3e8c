#!/usr/bin/env bash
# Session 20, last device call (2x H200): the whole suite on the device's Python, then
# issue 9's small-op latency at the final code (stages; interleaved GPU vs host, 3 runs).
# OUT=dir bash bench/session20_final.sh
set -u
OUT=${OUT:-$PWD/session20_out}
. bench/device_steps.sh
S=$OUT/final; mkdir -p "$S"
device_machine "$S"
SUITE_LIMIT=330 device_suite "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run2() { timeout 150 python3 -m acoll.run -n "$1" -- python3 "${@:2}"; }
run2 2 bench/via_host_stages.py --ops 3000 >"$S/stages.txt" 2>&1
for r in 1 2 3; do
  run2 2 bench/gpu_latency_ab.py --bytes 8 --rounds 20 --json "$S/ab_8_r$r.json" >"$S/ab_8_r$r.txt" 2>&1
done
run2 2 bench/gpu_latency_ab.py --bytes 65536 --rounds 10 --json "$S/ab_64k.json" >"$S/ab_64k.txt" 2>&1
tail -n 9 "$S/stages.txt"; for f in "$S"/ab_*.txt; do tail -n 1 "$f"; done
tar czf "$OUT/final.tgz" -C "$S" . && rm -rf "$S"
