"""Paired A/B of the 2-rank lane's all_reduce shapes (sessions 44 and 47), in the same
processes: per size, rounds alternate the variants (the order rotating every round; the
plan cache cleared between variants). NumPy arrays, in place, float32 sum. Under
acoll-run::

    python -m acoll.run -n 2 -- python bench/lane_piece_ab.py 2M 4M 16M --pieces 0,1M:512K

Each variant is ``PIECE`` or ``CAP:PIECE`` (sizes in bytes; 0: as the code has it):
calls larger than the one-shot limit (the slot, or ``CAP`` when given and smaller) run in
one-shot steps (``all_reduce_one_shot_steps``) of ``PIECE`` bytes each (the lane's step
by default). Prints per size the median time per op of each variant (slowest rank) and,
for every variant after the first, the median (min..max) of the per-round ratios first
variant's time / its time (> 1: it is faster).
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

_made_steps = _communicator.all_reduce_one_shot_steps
_one_shot_max = _communicator.one_shot_max
_now = {"cap": 0, "piece": 0}  # the variant running (0: as the code has it)


def _steps(lane: Any, count: int, per: int) -> Any:
    if _now["piece"]:
        per = max(1, _now["piece"] // 4)  # (float32 elements)
    return _made_steps(lane, count, per)


def _one_shot(lane: Any) -> int:
    most = _one_shot_max(lane)
    return min(most, _now["cap"]) if _now["cap"] else most


def _variant(text: str) -> tuple[int, int]:
    cap, _, piece = text.rpartition(":")
    return (parse_size(cap) if cap and cap != "0" else 0,
            parse_size(piece) if piece != "0" else 0)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="+")
    ap.add_argument("--pieces", default="0,512K", help="variants: PIECE or CAP:PIECE, ...")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib-per-round", type=float, default=128.0,
                    help="bytes reduced per variant per round (sets the op count)")
    args = ap.parse_args()
    names = args.pieces.split(",")
    variants = [_variant(name) for name in names]
    _communicator.all_reduce_one_shot_steps = _steps  # type: ignore[attr-defined]
    _communicator.one_shot_max = _one_shot  # type: ignore[attr-defined]
    async with await acoll.init_from_env() as comm:
        lane = comm._lane
        if comm.rank == 0:
            print(f"# 2-rank lane: slot {None if lane is None else lane.limit} bytes, step "
                  f"{None if lane is None else lane.step}; variants {names}", flush=True)
        for size in args.sizes:
            nbytes = parse_size(size)
            x = np.zeros(nbytes // 4, np.float32)
            iters = max(3, int(args.mib_per_round * (1 << 20) // nbytes))
            times: dict[int, list[float]] = {k: [] for k in range(len(variants))}
            for rnd in range(args.rounds):
                k0 = rnd % len(variants)
                for k in [*range(k0, len(variants)), *range(k0)]:
                    _now["cap"], _now["piece"] = variants[k]
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
                line = [f"{nbytes >> 10:>6} KiB"]
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
