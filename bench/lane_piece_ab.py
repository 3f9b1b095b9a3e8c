"""Paired A/B of the piece size of the 2-rank lane's one-shot all_reduce steps (session 44),
in the same processes: per size, rounds alternate the pieces (the order rotating every
round; the plan cache cleared between variants). NumPy arrays, in place, float32 sum.
Under acoll-run::

    python -m acoll.run -n 2 -- python bench/lane_piece_ab.py 4M 16M 64M --pieces 2M,512K

Calls larger than the lane's slot run in one-shot steps (``all_reduce_one_shot_steps``);
this patches the piece each step moves (the slot by default). Prints per size the median
time per op of each piece (slowest rank) and, for every piece after the first, the median
(min..max) of the per-round ratios first piece's time / its time (> 1: it is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

import acoll
from acoll import _communicator
from acoll._config import parse_size

_made = _communicator.all_reduce_one_shot_steps
_piece = [0]  # bytes per step of the variant running (0: the slot)


def _steps(lane: Any, count: int, per: int) -> Any:
    if _piece[0]:
        per = max(1, per * _piece[0] // lane.limit)
    return _made(lane, count, per)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="+")
    ap.add_argument("--pieces", default="2M,512K")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib-per-round", type=float, default=128.0,
                    help="bytes reduced per variant per round (sets the op count)")
    args = ap.parse_args()
    names = args.pieces.split(",")
    pieces = [parse_size(p) for p in names]
    _communicator.all_reduce_one_shot_steps = _steps  # type: ignore[attr-defined]
    async with await acoll.init_from_env() as comm:
        lane = comm._lane
        if comm.rank == 0:
            print(f"# 2-rank lane: slot {None if lane is None else lane.limit} bytes; "
                  f"pieces {names}", flush=True)
        for size in args.sizes:
            nbytes = parse_size(size)
            x = np.zeros(nbytes // 4, np.float32)
            iters = max(3, int(args.mib_per_round * (1 << 20) // nbytes))
            times: dict[int, list[float]] = {k: [] for k in range(len(pieces))}
            for rnd in range(args.rounds):
                k0 = rnd % len(pieces)
                for k in [*range(k0, len(pieces)), *range(k0)]:
                    _piece[0] = pieces[k]
                    comm._lane_plans.clear()
                    await comm.barrier()
                    await comm.all_reduce(x)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        await comm.all_reduce(x)
                    t = np.array([(time.perf_counter() - t0) / iters])
                    await comm.all_reduce(t, op=acoll.MAX)
                    times[k].append(float(t[0]))
            comm._lane_plans.clear()
            if comm.rank == 0:
                line = [f"{nbytes >> 20:>5} MiB"]
                for k, name in enumerate(names):
                    line.append(f"{name} {statistics.median(times[k]) * 1e6:9.1f} us")
                for k in range(1, len(names)):
                    ratios = [a / b for a, b in zip(times[0], times[k], strict=True)]
                    line.append(f"{names[0]}/{names[k]} {statistics.median(ratios):.2f} "
                                f"({min(ratios):.2f}..{max(ratios):.2f})")
                print("  ".join(line), flush=True)


try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
