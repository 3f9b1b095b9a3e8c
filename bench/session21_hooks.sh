#!/usr/bin/env bash
# Session 21, issue 9 (2x H200): the via-host paths at 1 to 16 MiB with the time spent in
# the pipelined ring's ready/final hooks (why pipelining the copies measured no faster).
# OUT=dir bash bench/session21_hooks.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/${HOOKS_DIR:-hooks}; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
timeout 150 python3 -m acoll.run -n 2 -- python3 bench/via_host_paths.py --mib ${MIBS:-1 4 16} \
  --rounds ${ROUNDS:-4} >"$S/paths_2.txt" 2>&1
grep -v "^\[rank [1-9]" "$S/paths_2.txt" | grep -v "RuntimeWarning\|_UFUNCS"
tar czf "$OUT/${HOOKS_DIR:-hooks}.tgz" -C "$S" . && rm -rf "$S"
