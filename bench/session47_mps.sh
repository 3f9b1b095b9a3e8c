#!/usr/bin/env bash
# Session 47: is the staged path's gap on one shared GPU the GPU's time-slicing between the
# processes' contexts? The same runs without and with CUDA MPS (one shared context on the
# server: no context switches), with a check that the clients attached (the MPS server
# among the GPU's processes, the control daemon's log of its clients).
#   OUT=dir [MODES="plain mps"] [RANKS="2 4"] [MIBS="1 4 16"] bash bench/session47_mps.sh
set -u
. bench/device_steps.sh
if [ -f "$OUT/machine.txt" ]; then device_site; else device_start "$OUT"; fi
P=$OUT/mps.txt
run_mode() {  # MODE
  local n
  for n in ${RANKS:-2}; do
    echo "## $1: $n ranks sharing one GPU, TCP (P2P and SHM off)" >>"$P"
    ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 150 python3 -m acoll.run \
      -n $n -- python3 bench/via_host_paths.py --mib ${MIBS:-1 4 16} --rounds ${ROUNDS:-4} \
      --variants ${VARIANTS:-gpu} ${DETAIL:---detail} >>"$P" 2>&1 &
    local job=$!
    sleep 8; { echo "# during the run:"; nvidia-smi | sed -n '/Processes/,$p'; } >>"$P" 2>&1
    wait $job; echo "== exit $? at $SECONDS s" >>"$P"
  done
  echo "## $1: 8 B latency, GPU vs host buffers" >>"$P"
  ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 60 python3 -m acoll.run \
    -n 2 -- python3 bench/gpu_latency_ab.py --bytes 8 --rounds 10 >>"$P" 2>&1
  echo "== exit $? at $SECONDS s" >>"$P"
  echo "## $1: where the 8 B call's time goes" >>"$P"
  ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 60 python3 -m acoll.run \
    -n 2 -- python3 bench/via_host_stages.py >>"$P" 2>&1
  echo "== exit $? at $SECONDS s" >>"$P"
}
for mode in ${MODES:-plain mps}; do
  if [ $mode = plain ]; then run_mode plain; continue; fi
  command -v nvidia-cuda-mps-control >/dev/null || { echo "## no MPS on this host" >>"$P"; break; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d >>"$P" 2>&1 || { echo "## MPS did not start" >>"$P"; break; }
  run_mode mps
  { echo "# MPS server:"; echo get_server_list | nvidia-cuda-mps-control
    grep -c "NEW CLIENT" $CUDA_MPS_LOG_DIRECTORY/control.log; } >>"$P" 2>&1
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
done
grep "^##\|host/gpu\|median over\|== exit\|mps-server\|^\[rank 0\]  *[A-Z][a-zA-Z]*\.\|total" "$P" | cut -c1-120
