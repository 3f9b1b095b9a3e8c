#!/usr/bin/env bash
# Session 22 (2x H200): the P2P workspace size (ACOLL_P2P_BUFFER 64 MiB default vs
# 256 MiB) for two processes, registered and not, 128 MiB to 1 GiB, against NCCL.
# OUT=dir bash bench/session22_buffer.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/buffer; mkdir -p "$S"
device_machine "$S"
export PYTHONUNBUFFERED=1
for buf in 64M 256M; do
  for reg in "" --register; do
    f="$S/procs_${buf}${reg:+_reg}.txt"
    ACOLL_P2P_BUFFER=$buf timeout 100 python3 bench/p2p_bench.py procs $reg \
      --sizes 128M,256M,1G --iters 2000 >"$f" 2>&1
    echo "== exit $?" >>"$f"
  done
done
for f in "$S"/procs*.txt; do echo "## $(basename $f)"; grep -h "^all\|^red\|exit" "$f" | cut -c1-80; done
tar czf "$OUT/buffer.tgz" -C "$S" . && rm -rf "$S"
