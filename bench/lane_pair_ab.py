"""Paired A/B of the 2-rank lane's all_reduce algorithms in the same processes (session 25):
one-shot steps (every rank reads the peer's whole piece) against two-shot steps, per size,
rounds alternating (the plan cache is cleared between variants). Under acoll-run::

    python -m acoll.run -n 2 -- python bench/lane_pair_ab.py 4M 16M 64M --rounds 6

Prints per size the median time per op of each (slowest rank) and the median of the
per-round ratios two-shot time / one-shot time (> 1: one-shot faster).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

import acoll
from acoll._comm import lane as lane_mod
from acoll._config import parse_size


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="+")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib-per-round", type=float, default=256.0,
                    help="bytes reduced per variant per round (sets the op count)")
    args = ap.parse_args()
    keep = lane_mod._PAIR_ONE_SHOT_SLOTS
    async with await acoll.init_from_env() as comm:
        for size in args.sizes:
            nbytes = parse_size(size)
            x = np.zeros(nbytes // 4, np.float32)
            iters = max(3, int(args.mib_per_round * (1 << 20) // nbytes))
            times: dict[str, list[float]] = {"one-shot": [], "two-shot": []}
            for rnd in range(args.rounds):
                order = ["one-shot", "two-shot"] if rnd % 2 == 0 else ["two-shot", "one-shot"]
                for v in order:
                    lane_mod._PAIR_ONE_SHOT_SLOTS = 1 << 30 if v == "one-shot" else 0
                    comm._lane_plans.clear()
                    await comm.barrier()
                    await comm.all_reduce(x)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        await comm.all_reduce(x)
                    t = np.array([(time.perf_counter() - t0) / iters])
                    await comm.all_reduce(t, op=acoll.MAX)
                    times[v].append(float(t[0]))
            lane_mod._PAIR_ONE_SHOT_SLOTS = keep
            comm._lane_plans.clear()
            if comm.rank == 0:
                one, two = times["one-shot"], times["two-shot"]
                ratios = [b / a for a, b in zip(one, two, strict=True)]
                print(f"{nbytes >> 20:>5} MiB  one-shot {statistics.median(one) * 1e6:9.1f} us"
                      f"  two-shot {statistics.median(two) * 1e6:9.1f} us  two/one "
                      f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})",
                      flush=True)


try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
