"""How communicator init time grows with the number of ranks in one event loop.

    python bench/init_scaling.py [--loop uvloop|asyncio] [--max 1024]

Every rank is a task in one loop; all talk over loopback exactly as separate processes
would. Reported: wall time from ``get_unique_id`` until every rank's ``init_rank``
returned, then the first barrier, then close.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time

import acoll
from acoll._communicator import raise_nofile_limit


async def one(n: int) -> tuple[float, float, float]:
    uid = acoll.get_unique_id(ifname="=lo")
    t0 = time.perf_counter()
    comms = await asyncio.gather(*(acoll.init_rank(n, uid, r, ifname="=lo", timeout=300)
                                   for r in range(n)))
    t1 = time.perf_counter()
    await asyncio.gather(*(c.barrier() for c in comms))
    t2 = time.perf_counter()
    await asyncio.gather(*(c.close() for c in comms))
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--max", type=int, default=1024)
    ap.add_argument("--min", type=int, default=2)
    args = ap.parse_args()
    raise_nofile_limit()
    sizes = [n for n in (2, 8, 32, 128, 256, 512, 1024, 2048) if args.min <= n <= args.max]
    print(f"# acoll {acoll.__version__} init scaling, {args.loop}, {platform.node()} "
          f"({os.cpu_count()} cpus), {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{'ranks':>6} {'init (ms)':>10} {'per rank (ms)':>14} {'barrier (ms)':>13} "
          f"{'close (ms)':>11}")

    async def run() -> None:
        for n in sizes:
            init, bar, close = await one(n)
            print(f"{n:>6} {init * 1e3:>10.1f} {init * 1e3 / n:>14.3f} {bar * 1e3:>13.1f} "
                  f"{close * 1e3:>11.1f}", flush=True)

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


if __name__ == "__main__":
    main()
