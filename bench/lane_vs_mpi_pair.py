"""acoll's lane against Open MPI in the same processes (session 28): in-place float32 sum
all_reduce, per size, rounds alternating the variants' order, so a drift of the machine
(the 2-core VM's "slow mode") hits every variant of a round alike. Under mpirun::

    mpirun --allow-run-as-root --oversubscribe -np 2 python bench/lane_vs_mpi_pair.py \\
        1M 2M 4M 8M 16M --rounds 8

Variants: ``mpi`` (MPI_Allreduce in place), ``acoll`` (a NumPy array), ``acoll-R`` (an
array from ``acoll.empty_shared``, registered: the zero-copy path; without it in
``--variants`` nothing is registered, as in a program of NumPy arrays only). Prints per size each
variant's median time per op (slowest rank), its busbw, and the medians (min..max) of the
per-round ratios acoll's busbw / MPI's. ``--coll all_gather|reduce_scatter|broadcast``
times those instead (out of place, root 0; SIZE is the larger buffer, as nccl-tests).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import acoll
from acoll._config import parse_size


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="+")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mib-per-round", type=float, default=128.0,
                    help="bytes reduced per variant per round (sets the op count)")
    ap.add_argument("--variants", default="mpi,acoll,acoll-R")
    ap.add_argument("--coll", default="all_reduce",
                    choices=["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    uid = world.bcast(bytes(acoll.get_unique_id(ifname="lo")) if rank == 0 else None)
    variants = args.variants.split(",")
    async with await acoll.init_rank(n, uid, rank) as comm:
        if rank == 0:
            print(f"# {args.coll}, {n} ranks, "
                  f"{MPI.Get_library_version().splitlines()[0].rstrip(chr(0))}; busbw as "
                  "nccl-tests (all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, "
                  "broadcast 1 x bytes / time)", flush=True)
        coll = args.coll
        for size in args.sizes:
            nbytes = parse_size(size) // (4 * n) * 4 * n
            count = nbytes // 4
            small = count if coll in ("all_reduce", "broadcast") else count // n
            plain = np.zeros(count, np.float32)
            plain_small = np.zeros(small, np.float32)
            shared = acoll.empty_shared(count + small, np.float32)  # (both, one allocation)
            shared[:] = 0
            shared_small = shared[count:]
            shared = shared[:count]
            # (no registration without acoll-R: the communicator of a NumPy-only program)
            reg = await comm.register(shared) if "acoll-R" in variants else None

            def mpi_op() -> None:
                if coll == "all_reduce":
                    world.Allreduce(MPI.IN_PLACE, plain)
                elif coll == "all_gather":
                    world.Allgather(plain_small, plain)
                elif coll == "reduce_scatter":
                    world.Reduce_scatter_block(plain, plain_small)
                else:
                    world.Bcast(plain, root=0)

            async def acoll_op(big: Any, little: Any) -> None:
                if coll == "all_reduce":
                    await comm.all_reduce(big)
                elif coll == "all_gather":
                    await comm.all_gather(little, big)
                elif coll == "reduce_scatter":
                    await comm.reduce_scatter(big, little)
                else:
                    await comm.broadcast(big, 0)

            iters = max(3, int(args.mib_per_round * (1 << 20) // nbytes))
            times: dict[str, list[float]] = {v: [] for v in variants}
            for rnd in range(args.rounds):
                order = variants if rnd % 2 == 0 else variants[::-1]
                for v in order:
                    world.Barrier()
                    if v == "mpi":
                        mpi_op()
                        world.Barrier()
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            mpi_op()
                    else:
                        big, little = ((shared, shared_small) if v == "acoll-R"
                                       else (plain, plain_small))
                        await acoll_op(big, little)
                        await comm.barrier()
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            await acoll_op(big, little)
                    t = (time.perf_counter() - t0) / iters
                    times[v].append(world.allreduce(t, op=MPI.MAX))
            if reg is not None:
                await comm.deregister(reg)
            if rank == 0:
                factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(
                    coll, (n - 1) / n)
                bus = factor * nbytes
                line = [f"{nbytes >> 10:>6} KiB ({iters:>3} ops)"]
                for v in variants:
                    med = _median(times[v])
                    line.append(f"{v} {med * 1e6:8.1f} us {bus / med / 1e9:6.2f} GB/s")
                for v in variants:
                    if v == "mpi" or "mpi" not in times:
                        continue
                    ratios = [m / a for a, m in zip(times[v], times["mpi"], strict=True)]
                    line.append(f"{v}/mpi {_median(ratios):.2f} "
                                f"({min(ratios):.2f}..{max(ratios):.2f})")
                print("  ".join(line), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
