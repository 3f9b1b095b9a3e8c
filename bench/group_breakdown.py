"""Where the time of a small all_reduce goes when one task drives two GPUs (issue 10).

    python bench/group_breakdown.py [--bytes 8] [--iters 2000] [--loop uvloop|asyncio]

One process, one rank per GPU (or two ranks sharing GPU 0 with one GPU), float32 sum,
awaited (the result readable when the group exits), the same buffers every call so that
calls run prepared. Per iteration it stamps ``time.perf_counter()``:

- ``enter``: ``async with acoll.group()`` entered;
- ``rank 0``: rank 0's call returned (its Python: key, checks, an event on the caller's
  stream, its launch handed to the local launch group);
- ``rank 1``: rank 1's call returned (its Python, then both ranks' launches, then the
  poll of its own kernel's event: up to 20 us without yielding);
- ``exit``: the block exited (rank 0's completion: its launch already ran, its event
  polled).

It prints the median of each phase, the median and p90 total, and NCCL's
(``cupy.cuda.nccl``: group calls of both GPUs, then a synchronize of each stream) on the
same buffers in the same run, split the same way (launch, synchronize).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def _p90_us(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] * 1e6


async def _acoll(args: argparse.Namespace, cp: Any) -> dict[str, float]:
    import acoll

    ngpu = cp.cuda.runtime.getDeviceCount()
    devs = [r % ngpu for r in range(2)]
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=d, ifname="=lo",
                                                   timeout=60) for r, d in enumerate(devs)))
    count = max(1, args.bytes // 4)
    bufs = []
    for d in devs:
        with cp.cuda.Device(d):
            bufs.append((cp.ones(count, cp.float32), cp.zeros(count, cp.float32)))
            cp.cuda.get_current_stream().synchronize()
    c0, c1 = comms
    (s0, r0), (s1, r1) = bufs
    phases: dict[str, list[float]] = {"rank 0": [], "rank 1": [], "exit": [], "total": []}
    clock = time.perf_counter
    try:
        for k in range(args.iters + args.warmup):
            t0 = clock()
            async with acoll.group():
                await c0.all_reduce(s0, r0)
                t1 = clock()
                await c1.all_reduce(s1, r1)
                t2 = clock()
            t3 = clock()
            if k >= args.warmup:
                phases["rank 0"].append(t1 - t0)
                phases["rank 1"].append(t2 - t1)
                phases["exit"].append(t3 - t2)
                phases["total"].append(t3 - t0)
        hits = [c._prepared.hits if c._prepared is not None else 0 for c in comms]
        exact = True
        for d, (_, r) in zip(devs, bufs, strict=True):
            with cp.cuda.Device(d):
                exact = exact and bool((cp.asnumpy(r) == 2).all())
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    out = {name: _median_us(xs) for name, xs in phases.items()}
    out["total p90"] = _p90_us(phases["total"])
    out["prepared calls"] = float(min(hits))
    out["exact"] = float(exact)
    return out


def _nccl(args: argparse.Namespace, cp: Any) -> dict[str, float]:
    from cupy.cuda import nccl

    ngpu = cp.cuda.runtime.getDeviceCount()
    devs = [r % ngpu for r in range(2)]
    if len(set(devs)) < 2:
        return {}
    comms = nccl.NcclCommunicator.initAll(devs)
    count = max(1, args.bytes // 4)
    bufs, streams = [], []
    for d in devs:
        with cp.cuda.Device(d):
            bufs.append((cp.ones(count, cp.float32), cp.zeros(count, cp.float32)))
            streams.append(cp.cuda.Stream(non_blocking=True))
    launch, sync, total = [], [], []
    clock = time.perf_counter
    for k in range(args.iters + args.warmup):
        t0 = clock()
        nccl.groupStart()
        for c, (s, r), st in zip(comms, bufs, streams, strict=True):
            c.allReduce(s.data.ptr, r.data.ptr, s.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                        st.ptr)
        nccl.groupEnd()
        t1 = clock()
        for st in streams:
            st.synchronize()
        t2 = clock()
        if k >= args.warmup:
            launch.append(t1 - t0)
            sync.append(t2 - t1)
            total.append(t2 - t0)
    return {"launch": _median_us(launch), "synchronize": _median_us(sync),
            "total": _median_us(total), "total p90": _p90_us(total)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="run acoll's loop under cProfile and print the top functions")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import cupy as cp

    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    if args.loop == "uvloop":
        import uvloop
        got = uvloop.run(_acoll(args, cp))
    else:
        got = asyncio.run(_acoll(args, cp))
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(28)
    print(f"# one process, 2 ranks ({cp.cuda.runtime.getDeviceCount()} GPU(s)), "
          f"{args.bytes} B float32 sum all_reduce, awaited, {args.iters} iterations, "
          f"{args.loop}; medians in us")
    print("acoll  " + "  ".join(f"{k}: {v:.1f}" for k, v in got.items()))
    if not args.no_nccl:
        ref = _nccl(args, cp)
        if ref:
            print("nccl   " + "  ".join(f"{k}: {v:.1f}" for k, v in ref.items()))
            print(f"ratio (NCCL total / acoll total, >1: acoll faster): "
                  f"{ref['total'] / got['total']:.2f}")


if __name__ == "__main__":
    main()
