"""One rank of the memory test (started by acoll-run): many all-reduces over the default
transports; prints how much the resident set grew after a warm-up."""

from __future__ import annotations

import asyncio
import gc

import numpy as np

import acoll


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


async def _ops(comm: acoll.Communicator, bufs: list[np.ndarray], big: np.ndarray,
               n: int) -> int:
    count = 0
    for i in range(n):
        await comm.all_reduce(bufs[i % len(bufs)])
        count += 1
        if i % 20 == 0:
            await comm.all_reduce(big)
            count += 1
    return count


async def main() -> None:
    comm = await acoll.init_from_env(timeout=60)
    async with comm:
        bufs = [np.ones(n, np.float32) for n in (2, 256, 4096, 16384)]
        big = np.ones(1 << 18, np.float32)  # 1 MiB: the ring algorithm, in parts
        await _ops(comm, bufs, big, 2000)  # warm-up: pools, caches, first pages
        gc.collect()
        before = _rss_kib()
        count = await _ops(comm, bufs, big, 10_000)
        gc.collect()
        grown = _rss_kib() - before
        names = ",".join(str(comm.transport_name(p)) for p in range(comm.size)
                         if p != comm.rank)
    print(f"rank {comm.rank} via {names}: rss {grown:+d} KiB over {count} ops", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
