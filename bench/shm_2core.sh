#!/bin/sh
# Issue 11, part 1: 2-rank all_reduce on one host over shared memory, over TCP
# (ACOLL_SHM_DISABLE=1) and with Open MPI (mpi4py, MPI_Allreduce in place), same sizes.
# Writes bench/results/shm_2core.txt (or $1). Run on an otherwise idle machine: every
# rank needs a core of its own, and busy-polling peers (MPI's and acoll's) lose badly
# when they share one.
#
#   sh bench/shm_2core.sh [OUT] [ROUNDS]
#
# Environment: PYTHON (default: python3), MPIRUN (default: mpirun), IDLE_WAIT (seconds to
# wait, before each command, for both CPUs to be at least 90% idle over 5 s; default 600).
set -u
# No RDMA device here: skip probing for one (importing pyverbs also configures the root
# logger, which would print acoll's INFO lines into the tables).
export ACOLL_IB_DISABLE=1
out=${1:-bench/results/shm_2core.txt}
rounds=${2:-1}
py=${PYTHON:-python3}
mpirun=${MPIRUN:-mpirun}
sweep="-b 8 -e 64M -f 4 -n 20 -w 5"

# Print "idle N%" once the CPUs were >= 90% idle over 5 s (or the best seen, after IDLE_WAIT).
wait_idle() {
    end=$(( $(date +%s) + ${IDLE_WAIT:-600} ))
    best=0
    while :; do
        a=$(awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8, $5+$6}' /proc/stat)
        sleep 5
        b=$(awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8, $5+$6}' /proc/stat)
        idle=$(echo "$a $b" | awk '{t=$3-$1; print (t > 0) ? int(100*($4-$2)/t) : 0}')
        [ "$idle" -gt "$best" ] && best=$idle
        if [ "$idle" -ge 90 ] || [ "$(date +%s)" -ge "$end" ]; then
            echo "# CPUs idle over the 5 s before: $best% ($(date -u +%H:%M:%SZ))"
            return
        fi
    done
}
{
    echo "# issue 11 part 1: 2-rank all_reduce, float32 sum, host buffers"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# machine: $(uname -srm), $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), $(lscpu | sed -n 's/^L3 cache: *//p') L3"
    echo "# python: $($py -c 'import sys; print(sys.version.split()[0])'), acoll at $(git rev-parse --short HEAD 2>/dev/null)"
    r=1
    while [ "$r" -le "$rounds" ]; do
        echo
        echo "## round $r"
        wait_idle
        echo "# command: acoll-perf all_reduce -N 2 $sweep   (shared memory, the default)"
        $py -m acoll.perf all_reduce -N 2 $sweep --no-progress 2>&1
        wait_idle
        echo "# command: ACOLL_SHM_DISABLE=1 acoll-perf all_reduce -N 2 $sweep   (TCP)"
        ACOLL_SHM_DISABLE=1 $py -m acoll.perf all_reduce -N 2 $sweep --no-progress 2>&1
        wait_idle
        echo "# command: $mpirun --allow-run-as-root --oversubscribe -np 2 python bench/mpi_allreduce.py $sweep"
        $mpirun --allow-run-as-root --oversubscribe -np 2 $py bench/mpi_allreduce.py $sweep 2>&1
        r=$((r + 1))
    done
} >"$out"
echo "wrote $out"
