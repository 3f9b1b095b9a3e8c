"""The 2-rank lane's all_reduce of NumPy arrays (in place, float32 sum): one-shot calls up
to the slot (and one-shot steps of the slot above) against a cap on the one-shot call and
smaller step pieces, paired in the same processes, the order rotating every round
(session 47). Under acoll-run::

    python -m acoll.run -n 2 -- python bench/lane_cap_ab.py 1M,2M,4M 0:0,1M:512K [ROUNDS]

Variants are CAP:PIECE (bytes; 0: as the code has it). Prints per size each variant's
median time per op (slowest rank) and the median of the per-round ratios first variant's
time / its time (> 1: faster).
"""
from __future__ import annotations
import asyncio, statistics, sys, time
import numpy as np
import acoll
from acoll import _communicator
from acoll._config import parse_size

_made = _communicator.all_reduce_one_shot_steps
_oneshot = _communicator.one_shot_max
cfg = {"cap": 0, "piece": 0}

def _steps(lane, count, per):
    if cfg["piece"]:
        per = max(1, cfg["piece"] // 4)
    return _made(lane, count, per)

def _one(lane):
    m = _oneshot(lane)
    return min(m, cfg["cap"]) if cfg["cap"] else m

async def main():
    sizes = [parse_size(s) for s in sys.argv[1].split(",")]
    variants = [tuple(parse_size(x) if x != "0" else 0 for x in v.split(":")) for v in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    _communicator.all_reduce_one_shot_steps = _steps
    _communicator.one_shot_max = _one
    async with await acoll.init_from_env() as comm:
        for nbytes in sizes:
            x = np.zeros(nbytes // 4, np.float32)
            iters = max(3, (96 << 20) // nbytes)
            times = {v: [] for v in variants}
            for rnd in range(rounds):
                order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
                for v in order:
                    cfg["cap"], cfg["piece"] = v
                    comm._lane_plans.clear()
                    await comm.barrier()
                    await comm.all_reduce(x)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        await comm.all_reduce(x)
                    t = np.array([(time.perf_counter() - t0) / iters])
                    await comm.all_reduce(t, op=acoll.MAX)
                    times[v].append(float(t[0]))
            if comm.rank == 0:
                base = variants[0]
                print(f"{nbytes>>10:>6} KiB " + "  ".join(
                    f"cap{v[0]>>10}K/p{v[1]>>10}K {statistics.median(times[v])*1e6:7.1f}us "
                    f"r{statistics.median([a/b for a,b in zip(times[base],times[v])]):.2f}"
                    for v in variants), flush=True)

asyncio.run(main())
