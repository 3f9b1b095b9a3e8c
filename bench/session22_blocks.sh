#!/usr/bin/env bash
# Session 22 (2x H200), 128 blocks by default: the P2P tests, then every collective's
# large sizes against NCCL (one process; two processes, registered and not).
# OUT=dir bash bench/session22_blocks.sh
set -u
OUT=${OUT:-$PWD/session22_out}
. bench/device_steps.sh
device_site
S=$OUT/blocks; mkdir -p "$S"
device_machine "$S"
timeout 200 make test-gpu PYTEST_ARGS="-q -n 8 --dist loadgroup -p no:randomly \
  -p no:benchmark -rs --timeout 150 tests/test_p2p_gpu.py tests/test_p2p.py" >"$S/tests.txt" 2>&1
echo "== tests exit $?" >>"$S/tests.txt"; tail -n 2 "$S/tests.txt"
export PYTHONUNBUFFERED=1
big=16M,64M,128M,256M,1G
timeout 100 python3 bench/p2p_bench.py inproc --sizes $big --iters 50 \
  --json "$S/big_inproc.json" >"$S/big_inproc.txt" 2>&1; echo "== exit $?" >>"$S/big_inproc.txt"
timeout 110 python3 bench/p2p_bench.py procs --sizes $big --iters 50 \
  --json "$S/big_procs.json" >"$S/big_procs.txt" 2>&1; echo "== exit $?" >>"$S/big_procs.txt"
timeout 110 python3 bench/p2p_bench.py procs --register --sizes $big --iters 50 \
  --json "$S/big_procs_reg.json" >"$S/big_procs_reg.txt" 2>&1
echo "== exit $?" >>"$S/big_procs_reg.txt"
for f in big_inproc big_procs big_procs_reg; do echo "## $f"; grep -h "^all\|^red\|exit" "$S/$f.txt" | cut -c1-80; done
tar czf "$OUT/blocks.tgz" -C "$S" . && rm -rf "$S"
