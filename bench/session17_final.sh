#!/usr/bin/env bash
# Final device check of session 17 (2x H200, Python 3.12): the whole suite; the P2P path
# against NCCL; issue 9's 8 B latency over the staged path (GPU vs host buffers).
# OUT=dir bash bench/session17_final.sh   (writes $OUT/final.tgz and a few text files)
set -u
OUT=${OUT:-$PWD/session17_final}
mkdir -p "$OUT"
. bench/device_steps.sh
W=$(mktemp -d)
t0=$SECONDS
device_machine "$W"
device_suite "$W"
device_p2p "$W" 50
export ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
for round in 1 2; do
  for dev in cuda cpu; do
    timeout 60 python3 -m acoll.perf all_reduce -b 8 -e 8 -n 300 -w 30 -N 2 --device $dev \
      --timeout 55 >"$W/lat_${dev}_2ranks_round$round.txt" 2>&1
  done
done
grep -h -E "^ +8 " "$W"/lat_*_2ranks_round*.txt /dev/null | head
tar czf "$OUT/final.tgz" -C "$W" . && cp "$W/suite.txt" "$W/p2p_inproc.txt" "$W/p2p_procs.txt" "$OUT/"
for f in "$W"/lat_*; do echo "== $(basename $f)"; grep -E "^ +8 |ranks" "$f"; done >"$OUT/lat_summary.txt"
cat "$OUT/lat_summary.txt"
echo "== final batch done after $((SECONDS - t0)) s"
