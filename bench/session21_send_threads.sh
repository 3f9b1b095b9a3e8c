#!/usr/bin/env bash
# Session 21, issue 11 (GPU host, CPU only): host-buffer all_reduce over sockets with the
# socket send threads as configured (auto) and off (ACOLL_SOCKET_SEND_THREADS=0), 2, 4 and
# 8 ranks, alternating, two rounds; Gloo in the same runs. Prompted by issue 9's runs, where
# the host path's 64 MiB in-place op took 35 ms without send threads and 44 to 51 ms with.
# OUT=dir bash bench/session21_send_threads.sh
set -u
OUT=${OUT:-$PWD/session21_out}
. bench/device_steps.sh
device_site
S=$OUT/send_threads; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket
perf() { timeout 110 python3 -m acoll.perf all_reduce --timeout 100 -b 1M -e 64M -f 4 -n 10 \
  -w 3 "$@"; }
for r in 1 2; do
  for n in 2 4 8; do
    for t in auto 0; do
      if [ "$t" = auto ]; then perf -N $n --vs gloo >"$S/n${n}_t${t}_r$r.txt" 2>&1
      else ACOLL_SOCKET_SEND_THREADS=0 perf -N $n --vs gloo >"$S/n${n}_t${t}_r$r.txt" 2>&1; fi
    done
  done
done
for f in "$S"/n*_r*.txt; do echo "== $(basename "$f")"; grep -E "^ +[0-9]+ " "$f" | head -8; done
tar czf "$OUT/send_threads.tgz" -C "$S" . && rm -rf "$S"
