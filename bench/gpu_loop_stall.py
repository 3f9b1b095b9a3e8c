"""Longest event-loop gap while two ranks of one loop all-reduce 64 MiB GPU buffers.

Diagnosis tool for issue 9 (``bench/results/gpu_issue9/loop_stall_diagnosis.txt``).
Environment: ``UV=1`` runs on uvloop, ``DEBUG=1`` in asyncio debug mode, ``NOGC=1`` with
the cyclic garbage collector off, ``PROFILE=1`` prints the top functions by own time.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import os
import pstats
import time

import cupy as cp

import acoll
from acoll.testing import run_ranks


async def main() -> None:
    worst = 0.0
    stop = asyncio.Event()
    prof = cProfile.Profile()
    tickers: list[asyncio.Future[None]] = []

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    async def fn(comm: acoll.Communicator) -> None:
        x = cp.ones(16 << 20, cp.float32)
        await comm.all_reduce(x)  # warm-up: pools, kernels, connections
        await comm.barrier()
        if comm.rank == 0:
            tickers.append(asyncio.ensure_future(ticker()))
            if os.environ.get("PROFILE"):
                prof.enable()
        for _ in range(4):
            await comm.all_reduce(x)
        await comm.barrier()
        if comm.rank == 0 and os.environ.get("PROFILE"):
            prof.disable()

    await run_ranks(2, fn, device=0)
    stop.set()
    await tickers[0]
    print(f"worst loop gap {worst * 1e3:.2f} ms")
    if os.environ.get("PROFILE"):
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    if os.environ.get("NOGC"):
        gc.disable()
    if os.environ.get("UV"):
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main(), debug=bool(os.environ.get("DEBUG")))
