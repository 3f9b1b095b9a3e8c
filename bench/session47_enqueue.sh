#!/usr/bin/env bash
# Session 47: the loop thread's cost of enqueueing piecewise copies, one process alone and
# two at once on the one GPU (plain, then under MPS where the host has it).
#   OUT=dir bash bench/session47_enqueue.sh
set -u
. bench/device_steps.sh
if [ -f "$OUT/machine.txt" ]; then device_site; else device_start "$OUT"; fi
P=$OUT/enqueue.txt
probe_pair() {
  echo "## $1: one process" >>"$P"
  timeout 60 python3 bench/enqueue_pieces_probe.py >>"$P" 2>&1
  echo "## $1: two processes at once" >>"$P"
  timeout 60 python3 bench/enqueue_pieces_probe.py >"$OUT/a.txt" 2>&1 &
  timeout 60 python3 bench/enqueue_pieces_probe.py >"$OUT/b.txt" 2>&1
  wait; cat "$OUT/a.txt" "$OUT/b.txt" >>"$P"; rm -f "$OUT/a.txt" "$OUT/b.txt"
}
probe_pair plain
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if nvidia-cuda-mps-control -d >>"$P" 2>&1; then
  probe_pair mps
  echo quit | nvidia-cuda-mps-control
fi
cat "$P"
