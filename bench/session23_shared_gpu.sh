#!/usr/bin/env bash
# Session 23 (one H200): the P2P group tests of ranks sharing one GPU, five times each, at
# the last code, with CUDA_MODULE_LOADING=EAGER, and at stop 22's code (./old, unpacked
# from git by the caller): a 60 s hang of test_group_of_different_kernels_keeps_order
# [asyncio] was seen once. OUT=dir bash bench/session23_shared_gpu.sh
set -u
OUT=${OUT:-$PWD/session23_out}
. bench/device_steps.sh
device_site
S=$OUT/shared; mkdir -p "$S"
device_machine "$S"
export ACOLL_TIMEOUT=10
K="group_of_different_kernels or sharing_a_gpu or one_task_drives"
run() {  # label, tree, extra environment
  local i
  for i in 1 2 3 4 5; do
    (cd "$2" && env PYTHONPATH="$PWD/src:$PWD/tests:$SITE" $3 timeout 150 python3 -m pytest -q \
      -p no:cacheprovider -p no:randomly tests/test_p2p_gpu.py -k "$K" 2>&1 | grep -v "^SKIPPED" \
      | tail -6) >>"$S/$1.txt"
    echo "== $1 run $i" >>"$S/$1.txt"
  done
}
run new . ""
run eager . "CUDA_MODULE_LOADING=EAGER"
[ -d old ] && run old old ""
grep -h "passed\|failed" "$S"/*.txt | sort | uniq -c
tar czf "$OUT/shared.tgz" -C "$S" . && rm -rf "$S"
