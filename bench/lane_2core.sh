#!/bin/sh
# Issue 11: small all_reduce between 2 processes of one host: acoll through the
# shared-memory lane (the default), acoll with the lane off (ACOLL_SHM_LANE_MAX=0: ring
# messages over shared memory), and Open MPI (mpi4py, MPI_Allreduce in place), same sizes,
# alternating, ROUNDS times. Writes bench/results/lane_2core.txt (or $1). Run on an
# otherwise idle machine: every rank needs a core of its own.
#
#   sh bench/lane_2core.sh [OUT] [ROUNDS]
#
# Environment: PYTHON (default: .venv/bin/python), MPIRUN (default: mpirun).
set -u
export ACOLL_IB_DISABLE=1
out=${1:-bench/results/lane_2core.txt}
rounds=${2:-3}
py=${PYTHON:-.venv/bin/python}
mpirun=${MPIRUN:-mpirun}
sweep="-b 8 -e 64K -f 2 -n 2000 -w 200"
{
    echo "# issue 11: 2-rank all_reduce, float32 sum, host buffers, small sizes"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# machine: $(uname -srm), $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p')"
    echo "# python: $($py -c 'import sys; print(sys.version.split()[0])'), acoll at $(git rev-parse --short HEAD 2>/dev/null)"
    r=1
    while [ "$r" -le "$rounds" ]; do
        echo
        echo "## round $r"
        echo "# command: acoll-perf all_reduce -N 2 $sweep   (lane, the default)"
        $py -m acoll.perf all_reduce -N 2 $sweep --no-progress 2>&1 | grep -v '^# Out\|^# Avg\|^#$'
        echo "# command: ACOLL_SHM_LANE_MAX=0 acoll-perf all_reduce -N 2 $sweep   (no lane)"
        ACOLL_SHM_LANE_MAX=0 $py -m acoll.perf all_reduce -N 2 $sweep --no-progress 2>&1 | grep -v '^# Out\|^# Avg\|^#$'
        echo "# command: $mpirun --allow-run-as-root --oversubscribe -np 2 $py bench/mpi_allreduce.py $sweep"
        $mpirun --allow-run-as-root --oversubscribe -np 2 $py bench/mpi_allreduce.py $sweep 2>&1 | grep -v '^# Out\|^# Avg\|^#$'
        r=$((r + 1))
    done
    echo
    echo "## wide: 8 B to 16 MiB, acoll (lane up to its size, rings above) and MPI in one run"
    echo "# command: acoll-perf all_reduce -N 2 -b 8 -e 16M -f 4 -n 50 -w 5 --vs mpi"
    $py -m acoll.perf all_reduce -N 2 -b 8 -e 16M -f 4 -n 50 -w 5 --vs mpi --no-progress 2>&1 | sed -n '/acoll vs mpi/,$p'
} >"$out"
echo "wrote $out"
