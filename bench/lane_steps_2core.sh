#!/bin/sh
# Issue 11: 2-rank all_reduce of 1 to 16 MiB between 2 processes of one host: acoll (the
# lane: two-shot steps through the mailboxes), acoll with the lane off
# (ACOLL_SHM_LANE_MAX=0: ring messages through the shared-memory rings) and Open MPI
# (mpi4py, MPI_Allreduce in place) in the same acoll-perf run, ROUNDS times.
#
#   sh bench/lane_steps_2core.sh [OUT] [ROUNDS]
set -u
export ACOLL_IB_DISABLE=1
out=${1:-bench/results/lane_steps_2core.txt}
rounds=${2:-3}
py=${PYTHON:-.venv/bin/python}
sweep="-b 1M -e 16M -f 2 -n 30 -w 5"
{
    echo "# issue 11: 2-rank all_reduce, float32 sum, host buffers, 1 to 16 MiB"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# machine: $(uname -srm), $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p')"
    echo "# python: $($py -c 'import sys; print(sys.version.split()[0])'), acoll at $(git rev-parse --short HEAD 2>/dev/null)"
    r=1
    while [ "$r" -le "$rounds" ]; do
        echo
        echo "## round $r"
        echo "# command: acoll-perf all_reduce -N 2 $sweep --vs mpi   (lane, the default)"
        $py -m acoll.perf all_reduce -N 2 $sweep --vs mpi --no-progress 2>&1 | sed -n '/acoll vs mpi/,$p'
        echo "# command: ACOLL_SHM_LANE_MAX=0 acoll-perf all_reduce -N 2 $sweep   (no lane: rings)"
        ACOLL_SHM_LANE_MAX=0 $py -m acoll.perf all_reduce -N 2 $sweep --no-progress 2>&1 | grep -E '^ +[0-9]+ '
        r=$((r + 1))
    done
} >"$out"
echo "wrote $out"
