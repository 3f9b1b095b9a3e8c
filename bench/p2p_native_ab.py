"""Prepared P2P calls launched by the native launcher against their Python route (issue 10).

    python bench/p2p_native_ab.py inproc [--rounds R] [--iters N]        # one process
    python -m acoll.run -n 2 -- python bench/p2p_native_ab.py procs      # two processes

Two ranks (one process: driven by one task through ``acoll.group()``, one rank per GPU,
or both on GPU 0 with one GPU; two processes: one rank each), float32 sum all_reduce,
out of place, the same buffers every call so that every timed call runs prepared. For
each size, ``--rounds`` rounds alternate the two launch routes on the same communicators
(``comm._p2p.launcher`` set, then ``None``): awaited us/op (the result readable when the
call or the group returns) and pipelined us/op (``stream=``; the timer stops once the
streams drained). Prints each round and the medians, and checks the results.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import cupy as cp

import acoll

SIZES = [8, 1024, 32 << 10, 256 << 10]


async def _once(comms: list[Any], bufs: list[Any], streams: list[Any] | None) -> None:
    if len(comms) == 1:
        s, r = bufs[0]
        await comms[0].all_reduce(s, r, stream=None if streams is None else streams[0])
        return
    async with acoll.group():
        for k, (c, (s, r)) in enumerate(zip(comms, bufs, strict=True)):
            await c.all_reduce(s, r, stream=None if streams is None else streams[k])


async def _time(comms: list[Any], bufs: list[Any], streams: list[Any] | None,
                iters: int) -> float:
    await asyncio.gather(*(c.barrier() for c in comms))
    t0 = time.perf_counter()
    for _ in range(iters):
        await _once(comms, bufs, streams)
    if streams is not None:
        for c, st in zip(comms, streams, strict=True):
            with cp.cuda.Device(c.device):
                st.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


async def run(comms: list[Any], nranks: int, args: argparse.Namespace) -> None:
    doms = [c._p2p for c in comms]
    if any(d is None for d in doms):
        raise SystemExit("no P2P domain formed (ranks sharing a GPU across processes?)")
    native = [d.launcher for d in doms]
    if any(n is None for n in native):
        raise SystemExit("the native launcher is not loaded (ACOLL_P2P_NATIVE=0, or no "
                         "C compiler or driver library)")
    me = comms[0].rank
    hits0 = [c._prepared.hits for c in comms]
    for nbytes in args.sizes:
        count = max(1, nbytes // 4)
        bufs, streams = [], []
        for c in comms:
            with cp.cuda.Device(c.device):
                bufs.append((cp.full(count, c.rank + 1, cp.float32),
                             cp.zeros(count, cp.float32)))
                streams.append(cp.cuda.Stream(non_blocking=True))
        for _ in range(3):  # learn and warm
            await _once(comms, bufs, None)
            await _once(comms, bufs, streams)
        rows: dict[str, list[float]] = {f"{route} {how}": [] for route in ("native", "python")
                                        for how in ("awaited", "pipelined")}
        for _ in range(args.rounds):
            for route in ("native", "python"):
                for d, n in zip(doms, native, strict=True):
                    d.launcher = n if route == "native" else None
                rows[f"{route} awaited"].append(await _time(comms, bufs, None, args.iters))
                rows[f"{route} pipelined"].append(await _time(comms, bufs, streams,
                                                              args.iters))
        for d, n in zip(doms, native, strict=True):
            d.launcher = n
        want = nranks * (nranks + 1) / 2
        for c, (_, r) in zip(comms, bufs, strict=True):
            with cp.cuda.Device(c.device):
                assert bool((r == want).all()), f"rank {c.rank}: wrong result at {nbytes} B"
        if me == 0:
            med = {k: statistics.median(v) for k, v in rows.items()}
            print(f"{nbytes:>8} B  " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
                  + f"  python/native awaited {med['python awaited'] / med['native awaited']:.2f}"
                  f" pipelined {med['python pipelined'] / med['native pipelined']:.2f}")
            for k, v in rows.items():
                print(f"           {k:18} rounds: " + " ".join(f"{x:.1f}" for x in v))
    hits = [c._prepared.hits - h for c, h in zip(comms, hits0, strict=True)]
    if me == 0:
        print(f"# prepared calls per rank: {min(hits)}")


async def inproc(args: argparse.Namespace) -> None:
    ngpu = cp.cuda.runtime.getDeviceCount()
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=r % ngpu,
                                                   ifname="=lo", timeout=60)
                                   for r in range(2)))
    print(f"# one process, 2 ranks on {min(2, ngpu)} GPU(s), group-driven; {args.iters} "
          f"iterations x {args.rounds} rounds per route; us per op, medians")
    try:
        await run(list(comms), 2, args)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def procs(args: argparse.Namespace) -> None:
    comm = await acoll.init_from_env(device="auto", timeout=60)
    if comm.rank == 0:
        print(f"# {comm.size} processes, one rank each; {args.iters} iterations x "
              f"{args.rounds} rounds per route; us per op, medians")
    try:
        await run([comm], comm.size, args)
    finally:
        await comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("where", choices=["inproc", "procs"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = ap.parse_args()
    os.environ["ACOLL_P2P_NATIVE"] = "1"  # (loaded at init; each round sets the route)
    main_fn = inproc if args.where == "inproc" else procs
    if args.loop == "uvloop":
        import uvloop
        uvloop.run(main_fn(args))
    else:
        asyncio.run(main_fn(args))


if __name__ == "__main__":
    main()
