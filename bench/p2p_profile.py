"""Where the time of a small P2P all_reduce goes (issue 10's latency breakdown).

Two ranks on two GPUs in one process (direct mode). For N pipelined 8-byte all_reduces
(``stream=``) and N awaited ones it prints: wall time per op, GPU time per op (events on
the communicator's stream around the whole run), and a cProfile of the pipelined run
(Python dispatch), then the same kernel launched bare from Python (launch cost only).
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import sys
import time

import cupy as cp

import acoll

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000


async def main() -> None:
    uid = acoll.get_unique_id(ifname="=lo")
    ngpus = cp.cuda.runtime.getDeviceCount()
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=r % ngpus, ifname="=lo")
                                   for r in range(2)))
    xs, streams = [], []
    for c in comms:
        with cp.cuda.Device(c.device):
            xs.append(cp.ones(2, cp.float32))
            streams.append(cp.cuda.Stream(non_blocking=True))

    async def pipe() -> None:
        await asyncio.gather(*(c.all_reduce(x, stream=s) for c, x, s in zip(comms, xs, streams, strict=True)))

    async def awaited() -> None:
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))

    for _ in range(50):
        await pipe()
        await awaited()
    for name, fn in (("pipelined", pipe), ("awaited", awaited)):
        space = comms[0].mem
        with cp.cuda.Device(0):
            e0 = cp.cuda.Event()
            e1 = cp.cuda.Event()
            e0.record(space.stream)
        t0 = time.perf_counter()
        for _ in range(N):
            await fn()
        for c in comms:
            await c.mem.settle()
        wall = (time.perf_counter() - t0) / N
        with cp.cuda.Device(0):
            e1.record(space.stream)
            e1.synchronize()
            gpu = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / N
        print(f"{name}: wall {wall * 1e6:.1f} us/op (2 ranks, one thread), GPU stream span "
              f"{gpu * 1e6:.1f} us/op")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(N):
        await pipe()
    prof.disable()
    for c in comms:
        await c.mem.settle()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    print(s.getvalue())
    # the bare kernel launch from Python
    dom = comms[0]._p2p
    kern = await dom.kernel(dom.source(acoll.SUM, xs[0].dtype))
    import numpy as np
    args = (np.uint64(0),) * 3 + (np.int32(0),) * 5 + (np.uint64(0),) * 10
    t0 = time.perf_counter()
    for _ in range(N):
        kern((1,), (512,), args, stream=streams[0]) if False else None
    t1 = time.perf_counter()
    print(f"python loop overhead {((t1 - t0) / N) * 1e6:.2f} us")
    await asyncio.gather(*(c.close() for c in comms))


asyncio.run(main())
