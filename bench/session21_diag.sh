#!/usr/bin/env bash
# Session 21, issue 9 (2x H200): what one copy on the caller's stream costs the loop's
# thread, and the via-host paths at 1 to 16 MiB with the GIL's switch interval as is and
# shortened (0.2 ms).
# OUT=dir bash bench/session21_diag.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/diag; mkdir -p "$S"
device_machine "$S"
timeout 120 python3 bench/staging_enqueue_probe.py >"$S/enqueue.txt" 2>&1; cat "$S/enqueue.txt"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 150 python3 -m acoll.run -n "$1" -- "${@:2}"; }
P="python3 bench/via_host_paths.py --mib 1 4 16 --rounds 6"
run 2 $P >"$S/paths_2.txt" 2>&1; grep -v "^\[rank [1-9]" "$S/paths_2.txt" | tail -n 60
run 2 $P --switch 0.0002 >"$S/paths_2_switch.txt" 2>&1
grep -v "^\[rank [1-9]" "$S/paths_2_switch.txt" | tail -n 60
tar czf "$OUT/diag.tgz" -C "$S" . && rm -rf "$S"
