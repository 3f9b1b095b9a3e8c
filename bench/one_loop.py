"""All-reduce with every rank in one event loop (``acoll.testing.run_ranks``).

What a test harness or a single-process program driving several ranks sees: before the
in-process transport, these ranks talked over loopback TCP; now they hand messages over
in memory. Prints, per size, the time per all_reduce (mean over ``-n`` ops after ``-w``
warm-up ops, the slowest rank) and busbw (2 (n-1)/n x bytes / time).

Usage: ``python bench/one_loop.py [-N 2] [-b 8] [-e 64M] [-f 8] [-n 20] [-w 5]``
(``ACOLL_INPROC_DISABLE=1`` measures the TCP path.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np

import acoll
from acoll.testing import run_ranks


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


async def main(args: argparse.Namespace) -> None:
    sizes = []
    size = args.b
    while size <= args.e:
        sizes.append(size)
        size *= args.f

    async def fn(comm: acoll.Communicator) -> list[float]:
        out = []
        for nbytes in sizes:
            x = np.ones(max(nbytes // 4, 1), np.float32)
            for _ in range(args.w):
                await comm.all_reduce(x)
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.n):
                await comm.all_reduce(x)
            out.append((time.perf_counter() - t0) / args.n)
        return out

    per_rank = await run_ranks(args.N, fn)
    n = args.N
    via = "tcp" if os.environ.get("ACOLL_INPROC_DISABLE") == "1" else "in-process"
    print(f"# run_ranks all_reduce float32 sum, {n} ranks in one loop ({via}), "
          f"-n {args.n} -w {args.w}")
    print(f"{'bytes':>12} {'time us':>10} {'busbw GB/s':>11}")
    for i, nbytes in enumerate(sizes):
        t = max(r[i] for r in per_rank)
        nb = max(nbytes // 4, 1) * 4
        print(f"{nb:>12} {t * 1e6:>10.1f} {2 * (n - 1) / n * nb / t / 1e9:>11.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-N", type=int, default=2)
    p.add_argument("-b", type=_size, default=8)
    p.add_argument("-e", type=_size, default=64 << 20)
    p.add_argument("-f", type=int, default=8)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    asyncio.run(main(p.parse_args()))
