"""Run by tests/test_mismatch.py under acoll-run (3 processes): rank 1 all_reduces 16,384
float32 (recursive doubling), the others 204,800 (the ring); each rank prints what the
call raised and after how long: ``rank R after T s: ErrorType: message``."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import acoll


async def main() -> None:
    comm = await acoll.init_from_env(timeout=30)
    await comm.barrier()
    x = np.ones(16384 if comm.rank == 1 else 204800, np.float32)
    start = time.monotonic()
    try:
        await comm.all_reduce(x)
        outcome = "returned"
    except acoll.AcollError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"rank {comm.rank} after {time.monotonic() - start:.2f} s: {outcome}", flush=True)
    comm.abort()


asyncio.run(main())
