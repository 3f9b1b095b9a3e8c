# Steps shared by the device batch scripts (sourced; DIR is where a step writes):
#   device_machine DIR   what ran where (GPUs, cores, Python, tree)
#   device_suite DIR     the whole suite on the device's Python (make test-gpu)
#   device_p2p DIR ITERS the P2P path against NCCL, one process and two (bench/p2p_bench.py)
#   device_site          install the carried wheels into $SITE and put src/ and $SITE first
#   device_start DIR     mkdir DIR, device_site, device_machine DIR, build the native ring
#   device_perf DIR FILE ARGS...  acoll-perf ARGS --vs gloo, TCP only, CPU only, into DIR/FILE
#   device_shm_mpi DIR ROUNDS all_reduce against Open MPI over shared memory, 8 ranks,
#                        512 KiB to 4 MiB, NumPy arrays (R0) and registered buffers (R1)
#   device_netns DIR NAME ARGS... bench/netns_shaped.py (4 hosts, 10 Gbit/s) with ARGS; its
#                        summary appended to DIR/netns.txt (NETBIN: the carried iproute2)
#   device_lane_tests DIR the lane and registered-lane tests, CPU only, into DIR/tests.txt
#   device_lane_mpi_ab DIR registered-buffer all_reduce against Open MPI, the code in
#                        oldsrc/ (carried untracked) and src/ alternating, at each rank
#                        count in RANKS (default "8 2"), PASSES times (default 2), into
#                        DIR/pair_ab.txt
#   device_netns_queues DIR NAME ARGS... the same, with the links' queues sampled
#                        (bench/qdisc_backlog.py) into DIR/backlog_NAME.txt and netns.txt
#   device_lane_mpi_variants DIR  NumPy-array all_reduce against Open MPI at 1, 2 and 4 MiB,
#                        on a communicator with a registered allocation (variants
#                        mpi,acoll,acoll-R) and on one without (mpi,acoll), at each rank count
#                        in RANKS (default "2 4 8"), PASSES times (default 2), into DIR/pair.txt
#   device_lane_limit_ab DIR  NumPy-array all_reduce against Open MPI at 1 and 2 MiB with 2
#                        ranks, one run per lane size in LIMITS (ACOLL_SHM_LANE_MAX, default
#                        "2M 1M 512K 256K"), PASSES times (default 2), into DIR/limit_ab.txt
#   device_lane_piece_ab DIR  the 2-rank lane's one-shot step piece, paired in the same
#                        processes (bench/lane_piece_ab.py, PIECES default "0,1M,512K"),
#                        4 to 64 MiB, into DIR/piece_ab.txt
#   device_via_host DIR  issue 9's staged path on the one GPU: bench/via_host_paths.py with
#                        2 ranks (separate processes sharing the GPU) over TCP, as they are
#                        and, where the host has it, under CUDA MPS; into DIR/via_host.txt
#   device_issue9 DIR    issue 9 on the one GPU: bench/via_host_paths.py (MIBS, default "1 4 16
#                        64") with 2 and 4 ranks over TCP into DIR/via_host.txt, the loop-lag
#                        and 8 B latency run (bench/gpu_loop_lag.py, 2 ranks) into DIR/lag.json,
#                        and the GPU, staging and native-ring tests (GPU_TESTS) into
#                        DIR/gpu_tests.txt
# bench/device_batch.sh runs a list of these steps by name.
export NCCL_NVLS_ENABLE=0 ACOLL_TIMEOUT=${ACOLL_TIMEOUT:-60}
SITE=${GPU_SITE:-/tmp/acoll-site}

device_machine() {
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
    python3 --version; git log -1 --oneline 2>/dev/null; } >"$1/machine.txt" 2>&1
}

device_suite() {  # (make test-gpu installs the carried wheels into $SITE)
  local t0=$SECONDS
  timeout --kill-after=10 "${SUITE_LIMIT:-300}" make test-gpu \
    PYTEST_ARGS="-q -n ${WORKERS:-12} --dist loadgroup -p no:randomly -p no:benchmark -rs ${SUITE_ARGS:---timeout 300}" \
    >"$1/suite.txt" 2>&1
  echo "== suite: exit $? after $((SECONDS - t0)) s" | tee -a "$1/suite.txt"
  tail -n 3 "$1/suite.txt"
  export PYTHONPATH="$PWD/src:$PWD/tests:$SITE" PATH="$SITE/bin:$PATH"
}

device_p2p() {
  local where
  for where in inproc procs; do
    timeout 120 python3 bench/p2p_bench.py $where --iters "$2" --json "$1/p2p_$where.json" \
      >"$1/p2p_$where.txt" 2>&1
    echo "== p2p $where: exit $?" >>"$1/p2p_$where.txt"
  done
}

device_site() {
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1; fi
  export PYTHONPATH="$PWD/src:$SITE" PATH="$SITE/bin:$PATH"
}

device_perf() {
  local dir=$1 f=$2; shift 2
  CUDA_VISIBLE_DEVICES= ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 150 \
    python3 -m acoll.perf "$@" -n 20 -w 5 --vs gloo >"$dir/$f" 2>&1
  echo "== $f: exit $? at $SECONDS s" >>"$dir/$f"
  sed -n '/acoll vs gloo/,$p' "$dir/$f"
}

device_netns() {
  local dir=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES= PATH="$PWD/${NETBIN:-.netbin}:$PATH" timeout 100 python3 \
    bench/netns_shaped.py --rate 10gbit -b 16M -e 64M -f 2 -n 20 -w 5 --timeout 90 "$@" \
    >"$dir/$name.log" 2>&1
  { echo "## $name: exit $? at $SECONDS s"; grep -A5 "acoll_busbw\|gloo_busbw" \
      "$dir/$name.log" | grep -v "^# target"; grep "^# \(acoll\|gloo\)\|TCP:\|native\|kernel dropped\|steering" \
      "$dir/$name.log"; } >>"$dir/netns.txt"
  rm -f "$dir/$name.log"
}

device_shm_mpi() {
  local R
  for R in 0 1; do
    CUDA_VISIBLE_DEVICES= timeout 110 python3 -m acoll.perf all_reduce -N 8 -b 512K -e 4M \
      -f 2 -n 20 -w 5 -R $R --vs mpi --rounds "$2" >"$1/shm_mpi_R$R.txt" 2>&1
    echo "== exit $? at $SECONDS s" >>"$1/shm_mpi_R$R.txt"
    grep -A8 "acoll vs mpi" "$1/shm_mpi_R$R.txt" | tail -7
  done
}

device_start() {
  mkdir -p "$1"
  device_site
  device_machine "$1"
  python3 -m acoll._native >"$1/build.txt" 2>&1
}

device_netns_queues() {  # DIR NAME ARGS...: device_netns with bench/qdisc_backlog.py beside
  local dir=$1 name=$2; shift 2
  PATH="$PWD/${NETBIN:-.netbin}:$PATH" python3 bench/qdisc_backlog.py --rate 10gbit \
    --every 0.05 --seconds 95 >"$dir/backlog_$name.txt" 2>&1 &
  local sampler=$!
  device_netns "$dir" "$name" "$@"
  wait $sampler
  { echo "## queues during $name"; grep -v "tcp_congestion_control" "$dir/backlog_$name.txt"
    grep -m1 "tcp_congestion_control" "$dir/backlog_$name.txt"; } >>"$dir/netns.txt"
}

device_lane_tests() {
  PYTHONPATH="$PWD/src:$PWD/tests:$SITE" CUDA_VISIBLE_DEVICES= timeout 200 python3 -m pytest -q \
    -n 12 -p no:randomly -p no:benchmark -p no:cacheprovider --timeout 150 tests/test_lane.py \
    tests/test_lane_registered.py >"$1/tests.txt" 2>&1
  echo "== tests: exit $? at $SECONDS s" | tee -a "$1/tests.txt"; tail -n 3 "$1/tests.txt"
}

device_lane_mpi_ab() {
  local P=$1/pair_ab.txt pass n v src
  for pass in $(seq "${PASSES:-2}"); do
    for n in ${RANKS:-8 2}; do
      for v in old new; do
        if [ $v = old ]; then src=$PWD/oldsrc; else src=$PWD/src; fi
        echo "## $v, $n ranks, pass $pass" >>"$P"
        PYTHONPATH="$src:$SITE" CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root \
          --oversubscribe -np $n python3 bench/lane_vs_mpi_pair.py 512K 1M 2M 4M --rounds 6 \
          --variants mpi,acoll,acoll-R 2>&1 | grep -v "^# all_reduce" >>"$P"
        echo "== exit $? at $SECONDS s" >>"$P"
      done
    done
  done
}

device_lane_mpi_variants() {
  local P=$1/pair.txt pass n v
  for pass in $(seq "${PASSES:-2}"); do
    for n in ${RANKS:-2 4 8}; do
      for v in mpi,acoll,acoll-R mpi,acoll; do
        echo "## $n ranks, variants $v, pass $pass" >>"$P"
        CUDA_VISIBLE_DEVICES= timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n \
          python3 bench/lane_vs_mpi_pair.py 1M 2M 4M --rounds 8 --variants $v 2>&1 \
          | grep -v "^# all_reduce" >>"$P"
        echo "== exit $? at $SECONDS s" >>"$P"
      done
    done
  done
}

device_lane_limit_ab() {
  local P=$1/limit_ab.txt pass lim
  for pass in $(seq "${PASSES:-2}"); do
    for lim in ${LIMITS:-2M 1M 512K 256K}; do
      echo "## ACOLL_SHM_LANE_MAX=$lim, 2 ranks, pass $pass" >>"$P"
      CUDA_VISIBLE_DEVICES= ACOLL_SHM_LANE_MAX=$lim timeout 100 mpirun --allow-run-as-root \
        --oversubscribe -x ACOLL_SHM_LANE_MAX -np 2 python3 bench/lane_vs_mpi_pair.py 1M 2M \
        --rounds 8 --variants mpi,acoll 2>&1 | grep -v "^# all_reduce" >>"$P"
      echo "== exit $? at $SECONDS s" >>"$P"
    done
  done
}

device_via_host() {
  local P=$1/via_host.txt mode
  for mode in plain mps; do
    if [ $mode = mps ]; then
      command -v nvidia-cuda-mps-control >/dev/null || { echo "## no MPS on this host" >>"$P"; break; }
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
      nvidia-cuda-mps-control -d >>"$P" 2>&1 || { echo "## MPS did not start" >>"$P"; break; }
    fi
    echo "## $mode: 2 ranks sharing one GPU, TCP (P2P and SHM off)" >>"$P"
    ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 150 python3 -m acoll.run \
      -n 2 -- python3 bench/via_host_paths.py --mib 1 4 16 --rounds ${ROUNDS:-4} >>"$P" 2>&1
    echo "== exit $? at $SECONDS s" >>"$P"
  done
  if [ "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}

device_lane_piece_ab() {
  CUDA_VISIBLE_DEVICES= timeout 150 python3 -m acoll.run -n 2 -- python3 bench/lane_piece_ab.py \
    4M 8M 16M 64M --pieces "${PIECES:-0,1M,512K}" --rounds 8 >>"$1/piece_ab.txt" 2>&1
  echo "== exit $? at $SECONDS s" >>"$1/piece_ab.txt"
  lscpu | grep -i "model name\|cache" >>"$1/piece_ab.txt"
}

device_issue9() {
  local P=$1/via_host.txt n
  for n in ${RANKS:-2 4}; do
    echo "## $n ranks sharing one GPU, TCP (P2P and SHM off)" >>"$P"
    ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 200 python3 -m acoll.run \
      -n $n -- python3 bench/via_host_paths.py --mib ${MIBS:-1 4 16 64} --rounds ${ROUNDS:-4} \
      >>"$P" 2>&1
    echo "== exit $? at $SECONDS s" >>"$P"
  done
  ACOLL_P2P_DISABLE=1 ACOLL_SHM_DISABLE=1 ACOLL_NET=socket timeout 120 python3 -m acoll.run \
    -n 2 -- python3 bench/gpu_loop_lag.py --gc collect --iters 16 --json "$1/lag.json" \
    >"$1/lag.txt" 2>&1
  echo "== lag: exit $? at $SECONDS s" | tee -a "$1/lag.txt"
  PYTHONPATH="$PWD/src:$PWD/tests:$SITE" timeout ${TESTS_LIMIT:-200} python3 -m pytest -q \
    -p no:randomly -p no:benchmark -p no:cacheprovider --timeout 120 --timeout-method=thread \
    -rs --durations=10 ${GPU_TESTS:-tests/test_gpu.py tests/test_staging.py tests/test_native_ring.py} \
    >"$1/gpu_tests.txt" 2>&1
  echo "== gpu tests: exit $? at $SECONDS s" | tee -a "$1/gpu_tests.txt"; tail -n 3 "$1/gpu_tests.txt"
}
