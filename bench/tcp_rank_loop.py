"""One rank of a host all_reduce loop with a time breakdown (issue 11 part 2).

Run under ``acoll-run``: ``python -m acoll.run -n 8 -- python bench/tcp_rank_loop.py 16M 30``.
Prints, per rank, the time per op and how much of it the rank spent reducing, waiting for
receives, waiting for sends and elsewhere (Python, the loop, socket copies).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import acoll
from acoll._coll import base
from acoll._config import parse_size

SPENT: dict[str, float] = {"reduce": 0.0, "wait_recv": 0.0, "wait_send": 0.0}


def _timed(name: str, fn):  # type: ignore[no-untyped-def]
    async def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t
    return wrapper


for _name in SPENT:
    setattr(base.OpContext, _name, _timed(_name, getattr(base.OpContext, _name)))


async def main() -> None:
    nbytes = parse_size(sys.argv[1])
    iters = int(sys.argv[2])
    async with await acoll.init_from_env() as comm:
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            await comm.all_reduce(x)
        await comm.barrier()
        for k in SPENT:
            SPENT[k] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            await comm.all_reduce(x)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        per = wall / iters
        busbw = 2 * (comm.size - 1) / comm.size * nbytes / per / 1e9
        parts = " ".join(f"{k} {v / iters * 1e3:.2f}" for k, v in SPENT.items())
        other = per * 1e3 - sum(SPENT.values()) / iters * 1e3
        print(f"rank {comm.rank}/{comm.size} {nbytes >> 20} MiB: {per * 1e3:.2f} ms/op "
              f"busbw {busbw:.2f} GB/s cpu {cpu / wall * 100:.0f}% | ms/op: {parts} "
              f"other {other:.2f}", flush=True)


if os.environ.get("LOOP", "uvloop") == "uvloop":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
asyncio.run(main())
