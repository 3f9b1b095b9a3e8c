#!/usr/bin/env bash
# Session 21, issue 9 (2x H200): the via-host paths at 1 to 16 MiB with no socket send
# threads (ACOLL_SOCKET_SEND_THREADS=0, host and GPU alike): does the GIL, handed back and
# forth with those threads at each CUDA call, cost the pipelined copies their gain?
# OUT=dir bash bench/session21_threads.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/threads; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
run() { timeout 150 python3 -m acoll.run -n "$1" -- "${@:2}"; }
P="python3 bench/via_host_paths.py --mib 1 4 16 64 --rounds 6"
ACOLL_SOCKET_SEND_THREADS=0 run 2 $P >"$S/paths_2_nothreads.txt" 2>&1
grep -v "^\[rank [1-9]" "$S/paths_2_nothreads.txt" | grep -v "  [a-z(].*  *[0-9.]*$" | tail -n 60
ACOLL_SOCKET_SEND_THREADS=0 run 4 $P >"$S/paths_4_nothreads.txt" 2>&1
grep -h "ranks\|##\|  gpu" "$S/paths_4_nothreads.txt"
tar czf "$OUT/threads.tgz" -C "$S" . && rm -rf "$S"
