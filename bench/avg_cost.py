"""What floating-point AVG costs against SUM (session 50): the same calls alternating.

    python -m acoll.run -n 2 -- python bench/avg_cost.py [--rounds 2]

all_reduce of 64 elements, 1 MiB and 16 MiB, reduce_scatter of 16 MiB (float32, NumPy
arrays, out of place); per call, the mean of a timed loop after a warm-up;
rank 0 prints one line per (call, op, round), and the time of a 16 MiB ``np.multiply``
alone (the pass AVG adds on host memory)."""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import acoll


async def _call(comm: acoll.Communicator, coll: str, x: np.ndarray, out: np.ndarray,
                op: str) -> None:
    if coll == "all_reduce":
        await comm.all_reduce(x, out, op=op)
    else:
        await comm.reduce_scatter(x, out, op=op)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    comm = await acoll.init_from_env()
    n = comm.size
    cases = [("all_reduce", 64, 2000), ("all_reduce", 1 << 18, 200),
             ("all_reduce", 1 << 22, 20), ("reduce_scatter", 1 << 22, 20)]
    for rnd in range(args.rounds):
        for coll, count, iters in cases:
            x = np.ones(count, np.float32)
            out = np.empty(count if coll == "all_reduce" else count // n, np.float32)
            for op in ("sum", "avg"):
                for _ in range(max(3, iters // 10)):
                    await _call(comm, coll, x, out, op)
                t0 = time.perf_counter()
                for _ in range(iters):
                    await _call(comm, coll, x, out, op)
                per = (time.perf_counter() - t0) / iters
                if comm.rank == 0:
                    print(f"round {rnd} {coll:14s} {count * 4:>9d} B {op}: "
                          f"{per * 1e6:9.1f} us", flush=True)
    y = np.empty(1 << 22, np.float32)
    x = np.ones(1 << 22, np.float32)
    t0 = time.perf_counter()
    for _ in range(10):
        np.multiply(x, np.float32(0.5), out=y)
    if comm.rank == 0:
        print(f"np.multiply of 16 MiB alone: {(time.perf_counter() - t0) / 10 * 1e6:.1f} us")
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main())
