"""AVG's scaling folded into the steps (session 52) against scaling first, paired in the
same processes: in-place float32 all_reduce (or ``--coll reduce_scatter``, out of place)
per size, rounds alternating the variants (their order rotating): ``sum``, ``avg-first``
(the whole input scaled before the op's steps, as before session 52) and ``avg`` (the
plans scale each piece as they copy it).
Under acoll-run::

    python -m acoll.run -n 4 -- python bench/avg_fold_ab.py 4M 16M 64M --rounds 6

Prints per size each variant's median time per op (slowest rank) and the median
(min..max) of the per-round ratios ``avg-first`` time / ``avg`` time (> 1: folding is
faster) and ``avg`` time / ``sum`` time (what AVG costs over SUM).
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


def _fold(on: bool | None) -> None:
    """Whether AVG's lane step plans scale as they copy (else: all of the input first;
    None: as the library decides)."""
    _communicator._FOLD_AVG = on


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="+")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib-per-round", type=float, default=128.0)
    ap.add_argument("--coll", choices=["all_reduce", "reduce_scatter"], default="all_reduce",
                    help="reduce_scatter: SIZE is the send buffer, out of place")
    args = ap.parse_args()
    variants = ["sum", "avg-first", "avg"]
    async with await acoll.init_from_env() as comm:
        if comm.rank == 0:
            lane = comm._lane
            print(f"# {comm.size} ranks, lane {None if lane is None else lane.limit} bytes, "
                  f"float32 {args.coll}; variants {variants}", flush=True)
        for size in args.sizes:
            nbytes = parse_size(size)
            x = np.zeros(nbytes // 4 // comm.size * comm.size, np.float32)  # (0: no overflow)
            block = np.zeros(x.size // comm.size, np.float32)

            async def op_once(op: acoll.ReduceOp, x: Any = x, block: Any = block) -> None:
                if args.coll == "all_reduce":
                    await comm.all_reduce(x, op=op)  # (in place)
                else:
                    await comm.reduce_scatter(x, block, op=op)

            iters = max(3, int(args.mib_per_round * (1 << 20) // nbytes))
            times: dict[str, list[float]] = {v: [] for v in variants}
            for rnd in range(args.rounds):
                k0 = rnd % len(variants)
                for v in variants[k0:] + variants[:k0]:
                    _fold(v != "avg-first")
                    op = acoll.SUM if v == "sum" else acoll.AVG
                    await comm.barrier()
                    await op_once(op)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        await op_once(op)
                    t = np.array([(time.perf_counter() - t0) / iters])
                    await comm.all_reduce(t, op=acoll.MAX)
                    times[v].append(float(t[0]))
            _fold(None)
            if comm.rank == 0:
                med = {v: statistics.median(times[v]) for v in variants}
                line = [f"{nbytes >> 10:>7} KiB"]
                line += [f"{v} {med[v] * 1e6:9.1f} us" for v in variants]
                for a, b in (("avg-first", "avg"), ("avg", "sum")):
                    r = [p / q for p, q in zip(times[a], times[b], strict=True)]
                    line.append(f"{a}/{b} {statistics.median(r):.2f} "
                                f"({min(r):.2f}..{max(r):.2f})")
                print("  ".join(line), flush=True)


try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
