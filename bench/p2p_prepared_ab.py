"""Prepared P2P calls against the general route, interleaved in one run (issue 10).

    python bench/p2p_prepared_ab.py inproc [--rounds R] [--iters N] [--eager]  # 1 process
    python -m acoll.run -n 2 -- python bench/p2p_prepared_ab.py procs  # 2 processes

For each size (float32 sum all_reduce, out of place), ``--rounds`` rounds each time the
prepared route (``comm._prepared`` as made at init) and the general route (the same
communicators with ``comm._prepared`` set to ``None``), in alternation: awaited us/op
(the await returns with the result readable) and pipelined us/op (``stream=``, timer
stopped after the stream drained). Prints the median of the rounds per route and the
ratio. Then, with ``--profile``, rank 0's prepared awaited 8 B call under cProfile, and
the bare cost of the CUDA calls a prepared call makes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any

import cupy as cp

import acoll

SIZES = [8, 1024, 32 << 10, 256 << 10, 2 << 20, 16 << 20]


async def _time(comms: list[Any], bufs: list[Any], streams: list[Any] | None,
                iters: int) -> float:
    async def once() -> None:
        if len(comms) == 1:
            s, r = bufs[0]
            await comms[0].all_reduce(s, r, stream=None if streams is None else streams[0])
            return
        await asyncio.gather(*(c.all_reduce(s, r, stream=None if streams is None else st)
                               for c, (s, r), st in zip(comms, bufs, streams or [None] *
                                                        len(comms), strict=True)))
    await asyncio.gather(*(c.barrier() for c in comms))
    t0 = time.perf_counter()
    for _ in range(iters):
        await once()
    if streams is not None:
        for c, st in zip(comms, streams, strict=True):
            with cp.cuda.Device(c.device):
                st.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


async def run(comms: list[Any], args: argparse.Namespace) -> None:
    prepared = [c._prepared for c in comms]
    me = comms[0].rank
    for nbytes in args.sizes:
        bufs, streams = [], []
        for c in comms:
            with cp.cuda.Device(c.device):
                s = cp.full(max(nbytes // 4, 1), c.rank + 1, cp.float32)
                bufs.append((s, cp.empty_like(s)))
                streams.append(cp.cuda.Stream(non_blocking=True))
        iters = max(20, min(args.iters, int(args.iters * (256 << 10) / max(nbytes, 1))))
        res: dict[str, list[float]] = {k: [] for k in ("prep_await", "gen_await",
                                                         "prep_pipe", "gen_pipe")}
        for c, p in zip(comms, prepared, strict=True):
            c._prepared = p
        await _time(comms, bufs, None, 20)  # learn, compile, warm
        for _ in range(args.rounds):
            for route in ("prep", "gen"):
                for c, p in zip(comms, prepared, strict=True):
                    c._prepared = p if route == "prep" else None
                res[f"{route}_await"].append(await _time(comms, bufs, None, iters))
                res[f"{route}_pipe"].append(await _time(comms, bufs, streams, iters))
        for c, p in zip(comms, prepared, strict=True):
            c._prepared = p
        want = float(sum(range(1, comms[0].size + 1)))
        for c, (_, r) in zip(comms, bufs, strict=True):
            with cp.cuda.Device(c.device):
                assert bool((r == want).all()), (nbytes, float(r[0]))
        med = {k: statistics.median(v) for k, v in res.items()}
        if me == 0:
            print(f"{nbytes:>10} B  awaited prepared {med['prep_await']:8.1f} us  general "
                  f"{med['gen_await']:8.1f} us  ({med['gen_await'] / med['prep_await']:.2f}x)"
                  f"   pipelined prepared {med['prep_pipe']:8.1f} us  general "
                  f"{med['gen_pipe']:8.1f} us  ({med['gen_pipe'] / med['prep_pipe']:.2f}x)"
                  f"   rounds await {' '.join(f'{x:.0f}' for x in res['prep_await'])}",
                  flush=True)
    if args.profile:
        await profile(comms)


async def profile(comms: list[Any]) -> None:
    bufs = []
    for c in comms:
        with cp.cuda.Device(c.device):
            s = cp.ones(2, cp.float32)
            bufs.append((s, cp.empty_like(s)))
    await _time(comms, bufs, None, 50)
    prof = cProfile.Profile()
    prof.enable()
    took = await _time(comms, bufs, None, 2000)
    prof.disable()
    if comms[0].rank == 0:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"prepared awaited 8 B under cProfile: {took:.1f} us/op", flush=True)
        print(out.getvalue(), flush=True)
        bare(comms[0])


def bare(comm: Any) -> None:
    """What the CUDA calls of a prepared call cost from Python, alone."""
    dev = comm.device
    rt = cp.cuda.runtime
    with cp.cuda.Device(dev):
        x = cp.ones(2, cp.float32)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        st = cp.cuda.get_current_stream()
        n = 20000

        def per(fn: Any) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n * 1e6

        rows = {
            "event.record": per(lambda: ev.record(st)),
            "event.done": per(lambda: ev.done),
            "get_current_stream": per(cp.cuda.get_current_stream),
            "runtime.getDevice": per(rt.getDevice),
            "x.data.ptr + size + dtype": per(lambda: (x.data.ptr, x.size, x.dtype)),
            "x.flags.c_contiguous": per(lambda: x.flags.c_contiguous),
        }
        st.synchronize()
    fast = comm._prepared
    if fast is not None:
        rows["prepared key"] = per(lambda: fast.key("all_reduce", x, None, "sum", 0))
    print("bare costs (us/call): " + ", ".join(f"{k} {v:.2f}" for k, v in rows.items()),
          flush=True)


async def main(args: argparse.Namespace) -> None:
    if args.where == "procs":
        comm = await acoll.init_from_env(device="auto")
        comms = [comm]
    else:
        n = cp.cuda.runtime.getDeviceCount()
        uid = acoll.get_unique_id(ifname="=lo")
        comms = list(await asyncio.gather(*(acoll.init_rank(2, uid, r, device=r % n,
                                                            ifname="=lo") for r in range(2))))
    if comms[0].rank == 0:
        print(f"# {args.where}, 2 ranks, p2p={'direct' if comms[0]._p2p.direct else 'copy'},"
              f" rounds {args.rounds}, pid {os.getpid()}, python {sys.version.split()[0]}",
              flush=True)
    try:
        await run(comms, args)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("where", choices=["inproc", "procs"])
    ap.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",")], default=SIZES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--eager", action="store_true",
                    help="the loop's eager task factory (Python 3.12+: gather starts each "
                         "rank's call at once instead of scheduling a task)")
    a = ap.parse_args()
    if a.uvloop:
        import uvloop
        uvloop.install()

    async def top() -> None:
        if a.eager:
            asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        await main(a)
    asyncio.run(top())
