#!/usr/bin/env bash
# Small-op CPU path, this tree against an older commit's tree, alternating in one run:
# 2 and 4 ranks in one event loop (bench/one_loop.py) and 2 processes over shared memory
# (acoll-perf). OLD=path/to/old/checkout bash bench/ab_hotpath.sh
set -u
OLD=${OLD:?path of the older checkout}
PY=${PY:-python3}
for round in 1 2 3; do
  for tree in "$OLD" "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo new || echo old)
    for n in 2 4; do
      echo "## round $round $label: one loop, $n ranks"
      PYTHONPATH=$tree/src $PY bench/one_loop.py -N $n -b 8 -e 1K -f 128 -n 2000 -w 200 | grep -v "^#"
    done
    echo "## round $round $label: 2 processes, shared memory"
    PYTHONPATH=$tree/src $PY -m acoll.perf all_reduce -N 2 -b 8 -e 1K -f 128 -n 1000 -w 100 \
      --no-inplace 2>&1 | grep -E "^ +[0-9]"
  done
done
