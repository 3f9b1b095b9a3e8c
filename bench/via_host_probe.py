"""Where the time of a small GPU all_reduce over TCP goes (issue 9), on one GPU.

    python bench/via_host_probe.py prims         # CUDA primitives as CuPy calls them
    python bench/via_host_probe.py ranks [-N 2]  # ranks in one loop over TCP: host vs GPU
    python bench/via_host_probe.py profile       # cProfile of the GPU ranks' 8 B ops

``prims`` times, from Python, each CUDA call the staged small path makes (median of many),
and the round trips of an 8-byte copy down, up, and down-then-up, waited by a query loop
that never yields. ``ranks`` runs ``-N`` ranks in this loop (TCP: in-process transport,
shared memory and the GPU path off) and prints the awaited 8 B all_reduce latency of host
and GPU buffers (median, p90), with ``ACOLL_GPU_VIA_HOST_MAX`` as set.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("ACOLL_INPROC_DISABLE", "1")
os.environ.setdefault("ACOLL_SHM_DISABLE", "1")
os.environ.setdefault("ACOLL_P2P_DISABLE", "1")
os.environ.setdefault("ACOLL_NET", "socket")

import numpy as np

import acoll
from acoll.testing import run_ranks


def _median_us(fn: Callable[[], Any], reps: int = 2000) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return statistics.median(times) / 1e3, times[int(0.9 * len(times))] / 1e3


def prims() -> None:
    import cupy as cp

    dev = cp.cuda.Device(0)
    dev.use()
    s = cp.cuda.Stream(non_blocking=True)
    user = cp.cuda.get_current_stream()
    x = cp.ones(2, cp.float32)
    pinned = cp.cuda.alloc_pinned_memory(4096)
    h = np.frombuffer(pinned, np.uint8, 4096)
    hptr = h.ctypes.data
    ev = cp.cuda.Event(block=False, disable_timing=True)
    ev.record(s)
    s.synchronize()
    rt = cp.cuda.runtime

    def with_dev() -> None:
        with cp.cuda.Device(0):
            pass

    def d2h_enqueue() -> None:
        rt.memcpyAsync(hptr, x.data.ptr, 8, 2, s.ptr)

    rows: list[tuple[str, tuple[float, float]]] = [
        ("with Device(0)", _median_us(with_dev)),
        ("Event() create", _median_us(lambda: cp.cuda.Event(block=False, disable_timing=True))),
        ("event.record(s)", _median_us(lambda: ev.record(s))),
        ("event.done", _median_us(lambda: ev.done)),
        ("s.wait_event(ev)", _median_us(lambda: s.wait_event(ev))),
        ("get_current_stream", _median_us(cp.cuda.get_current_stream)),
        ("memcpyAsync 8B D2H enqueue", _median_us(d2h_enqueue)),
    ]
    s.synchronize()

    def trip(kinds: tuple[int, ...]) -> Callable[[], None]:
        def run() -> None:
            ev.record(user)
            s.wait_event(ev)
            for k in kinds:
                if k == 2:
                    rt.memcpyAsync(hptr, x.data.ptr, 8, 2, s.ptr)
                else:
                    rt.memcpyAsync(x.data.ptr, hptr, 8, 1, s.ptr)
                ev.record(s)
                while not ev.done:
                    pass
        return run

    rows += [
        ("round trip D2H 8B (record, wait, copy, record, spin)", _median_us(trip((2,)), 500)),
        ("round trip H2D 8B", _median_us(trip((1,)), 500)),
        ("round trips D2H then H2D (two spins)", _median_us(trip((2, 1)), 500)),
        ("stream.synchronize idle", _median_us(s.synchronize)),
    ]
    for name, (med, p90) in rows:
        print(f"{name:<56} median {med:7.2f} us  p90 {p90:7.2f} us")


async def _latency(comm: acoll.Communicator, x: Any, iters: int) -> list[float]:
    for _ in range(50):
        await comm.all_reduce(x)
    await comm.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await comm.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return times


async def ranks(n: int, iters: int) -> None:
    import cupy as cp

    async def host(comm: acoll.Communicator) -> list[float]:
        return await _latency(comm, np.ones(2, np.float32), iters)

    async def gpu(comm: acoll.Communicator) -> list[float]:
        with cp.cuda.Device(0):
            x = cp.ones(2, cp.float32)
        return await _latency(comm, x, iters)

    out = {}
    for name, fn, kw in (("host", host, {}), ("gpu", gpu, {"device": 0}),
                         ("host", host, {}), ("gpu", gpu, {"device": 0})):
        per = await run_ranks(n, fn, **kw)
        t = sorted(max(col) for col in zip(*per, strict=True))  # slowest rank per op
        out.setdefault(name, []).append((statistics.median(t) * 1e6, t[int(0.9 * len(t))] * 1e6))
    via = os.environ.get("ACOLL_GPU_VIA_HOST_MAX", "default")
    for name, runs in out.items():
        print(f"{n} ranks in one loop over TCP, 8 B all_reduce, {name}: "
              + ", ".join(f"median {m:.1f} us p90 {p:.1f} us" for m, p in runs)
              + f"  (ACOLL_GPU_VIA_HOST_MAX={via})")


async def profile(n: int, iters: int) -> None:
    import cupy as cp

    prof = cProfile.Profile()

    async def gpu(comm: acoll.Communicator) -> None:
        with cp.cuda.Device(0):
            x = cp.ones(2, cp.float32)
        await _latency(comm, x, 50)
        if comm.rank == 0:
            prof.enable()
        await _latency(comm, x, iters)
        if comm.rank == 0:
            prof.disable()

    await run_ranks(n, gpu, device=0)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    print(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["prims", "ranks", "profile"])
    p.add_argument("-N", type=int, default=2)
    p.add_argument("-n", type=int, default=2000)
    a = p.parse_args()
    if a.what == "prims":
        prims()
    elif a.what == "ranks":
        asyncio.run(ranks(a.N, a.n))
    else:
        asyncio.run(profile(a.N, a.n))


if __name__ == "__main__":
    main()
