"""Open MPI's in-place MPI_Allreduce through mpi4py, timed like ``acoll-perf``: the peer
that issue 11's shared-memory targets are set against.

    mpirun --allow-run-as-root --oversubscribe -np 2 python bench/mpi_allreduce.py \\
        -b 8 -e 64M -f 4 -n 20 -w 5

For each size (float32, sum): ``-w`` warm-up ops, a barrier, then ``-n`` back-to-back ops;
time is the mean per op, the maximum over ranks (acoll-perf's default ``-a 3``); busbw is
algbw x 2(n-1)/n. Rank 0 prints a table in acoll-perf's column layout (in-place only).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-b", "--minbytes", type=_size, default=8)
    parser.add_argument("-e", "--maxbytes", type=_size, default=64 << 20)
    parser.add_argument("-f", "--stepfactor", type=int, default=4)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup_iters", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        library = MPI.Get_library_version().replace("\0", "").splitlines()[0]
        print(f"# mpi4py {library} | ranks {n} | "
              "MPI_Allreduce in place, float32 sum | time: max over ranks")
        print(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'time':>10} "
              f"{'algbw':>7} {'busbw':>7} {'#wrong':>7}")
        print(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'(us)':>10} "
              f"{'(GB/s)':>7} {'(GB/s)':>7}")
    size = args.minbytes
    while size <= args.maxbytes:
        count = max(size // 4, 1)
        buf = np.ones(count, np.float32)
        for _ in range(args.warmup_iters):
            buf[:] = 1
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        elapsed = (time.perf_counter() - t0) / args.iters
        worst = comm.allreduce(elapsed, op=MPI.MAX)
        buf[:] = rank + 1
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        wrong = int(np.count_nonzero(buf != n * (n + 1) / 2))
        wrong = comm.allreduce(wrong, op=MPI.SUM)
        nbytes = count * 4
        algbw = nbytes / worst / 1e9
        if rank == 0:
            print(f"  {nbytes:>10} {count:>12} {'float32':>8} {'sum':>6} {worst * 1e6:>10.1f} "
                  f"{algbw:>7.2f} {algbw * 2 * (n - 1) / n:>7.2f} {wrong:>7}", flush=True)
        size *= args.stepfactor


if __name__ == "__main__":
    main()
