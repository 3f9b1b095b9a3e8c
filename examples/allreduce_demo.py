"""Run under a launcher: ``acoll-run -n 4 -- python examples/allreduce_demo.py``.

Every rank joins through ``acoll.init_from_env()``, passes a barrier, all-reduces a few
arrays, checks the results against NumPy, and rank 0 prints a small table.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

import acoll


async def main() -> int:
    t0 = time.perf_counter()
    comm = await acoll.init_from_env()
    init_ms = (time.perf_counter() - t0) * 1e3
    async with comm:
        await comm.barrier()
        rows = []
        for count in (1, 1000, 1 << 20):
            data = np.full(count, comm.rank + 1, dtype=np.float32)
            t = time.perf_counter()
            await comm.all_reduce(data)
            dt = (time.perf_counter() - t) * 1e6
            expected = comm.size * (comm.size + 1) / 2
            ok = bool(np.all(data == expected))
            rows.append((count, dt, ok))
        inits = np.array([init_ms], dtype=np.float64)
        await comm.all_reduce(inits, op=acoll.MAX)
        if comm.rank == 0:
            print(f"{comm.size} ranks joined; slowest init {inits[0]:.1f} ms; barrier passed")
            print(f"{'count':>10} {'time(us)':>10} {'result':>8}")
            for count, dt, ok in rows:
                print(f"{count:>10} {dt:>10.1f} {'ok' if ok else 'WRONG':>8}")
        return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
