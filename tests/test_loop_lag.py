"""acoll never holds the event loop for long, whatever the message size (issue 7, part 1).

Two ranks share the test's loop and run large collectives while a meter records how long
the loop was kept busy without a break, in *CPU time of the loop's thread*
(``time.thread_time_ns``), so that a loaded CI machine preempting the process does not
count against acoll:

- plain asyncio: the CPU time of every single callback (task step, reader, writer, timer),
  by wrapping ``asyncio.events.Handle._run``; the bound is ``STEP_LIMIT_MS``;
- uvloop (its handles are compiled): a ticker task that resumes on every loop iteration;
  the CPU time between two of its resumptions covers one iteration, i.e. every callback
  that ran in it (each rank's step, the readers and writers of both ends), so the limit
  is ``ITER_LIMIT_MS``.

acoll's own bound is about 1 ms of CPU per callback (see ``acoll._coll.base.STEP_NS`` and
``acoll._transport.tcp._IO_BUDGET``); the limits here are several times that, for CI.
Before the bound existed these cases measured 10 to 100 ms.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import acoll
from acoll._transport import shm
from acoll.testing import run_ranks

STEP_LIMIT_MS = 5.0  # one callback (asyncio)
ITER_LIMIT_MS = 12.0  # one loop iteration: up to ~8 callbacks of two ranks (uvloop)
MIB = 1 << 20


class Meter:
    """The longest CPU stretch seen while at least one rank is inside a measured op."""

    def __init__(self) -> None:
        self.active = 0
        self.worst_ns = 0
        self.what = ""

    def record(self, ns: int, what: Callable[[], str]) -> None:
        if self.active and ns > self.worst_ns:
            self.worst_ns = ns
            self.what = what()

    @contextmanager
    def measuring(self) -> Iterator[None]:
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


@contextmanager
def _per_callback(meter: Meter, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = asyncio.events.Handle._run

    def timed_run(self: asyncio.Handle) -> None:
        t0 = time.thread_time_ns()
        try:
            original(self)
        finally:
            meter.record(time.thread_time_ns() - t0, lambda: repr(self)[:300])

    # (set and put back by hand: monkeypatch.undo() would also drop the test's settings)
    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        asyncio.events.Handle._run = original  # type: ignore[method-assign]


async def _ticker(meter: Meter, stop: asyncio.Event) -> None:
    last = time.thread_time_ns()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.thread_time_ns()
        meter.record(now - last, lambda: "one loop iteration")
        last = now


async def _measure(fn: Callable[[acoll.Communicator, Meter], Awaitable[None]],
                   monkeypatch: pytest.MonkeyPatch) -> tuple[float, float, str]:
    """Run ``fn`` on 2 ranks in this loop; return (worst ms, limit ms, what)."""
    meter = Meter()
    loop = asyncio.get_running_loop()
    # Not acoll's costs, so kept out of the measurement: a full collection of pytest's heap
    # (tens of ms whoever triggers it), and debug mode, which records a stack for every
    # future and handle (milliseconds when linecache loads a file; both loops are in
    # debug mode under the test harness).
    gc.collect()
    gc.freeze()
    debug = loop.get_debug()
    loop.set_debug(False)
    try:
        return await _measure_in(fn, monkeypatch, meter, loop)
    finally:
        loop.set_debug(debug)
        gc.unfreeze()


async def _measure_in(fn: Callable[[acoll.Communicator, Meter], Awaitable[None]],
                      monkeypatch: pytest.MonkeyPatch, meter: Meter,
                      loop: asyncio.AbstractEventLoop) -> tuple[float, float, str]:
    if isinstance(loop, asyncio.BaseEventLoop):  # plain asyncio: time each callback
        with _per_callback(meter, monkeypatch):
            await run_ranks(2, lambda comm: fn(comm, meter), timeout=60)
        return meter.worst_ns / 1e6, STEP_LIMIT_MS, meter.what
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(meter, stop))
    try:
        await run_ranks(2, lambda comm: fn(comm, meter), timeout=60)
    finally:
        stop.set()
        await ticker
    return meter.worst_ns / 1e6, ITER_LIMIT_MS, meter.what


async def _settle(comm: acoll.Communicator) -> None:
    """End the test's own step (allocating and filling buffers is not acoll's work), then
    line the ranks up.

    The cases fill their buffers before use: the first write to a fresh NumPy array of
    several MiB faults in (and zeroes) a 2 MiB transparent huge page, milliseconds inside
    one ``recv_into`` call, and a user's memory is the user's to prepare.
    """
    await asyncio.sleep(0)
    await comm.barrier()


async def _all_reduce(comm: acoll.Communicator, meter: Meter, *, nbytes: int,
                      dtype: Any = np.float32, op: str = "sum") -> None:
    x = np.full(nbytes // np.dtype(dtype).itemsize, comm.rank + 1, dtype)
    await _settle(comm)
    with meter.measuring():
        await comm.all_reduce(x, op=op)
        await comm.all_reduce(x, op=op)
    expect = 6.0 if op == "sum" else 1.5
    assert float(x[0]) == float(x[-1]) == expect


async def _reduce(comm: acoll.Communicator, meter: Meter) -> None:
    x = np.full(8 * MIB, comm.rank + 1, np.float32)
    out = np.full_like(x, -1)  # buffers are touched: see _settle
    await _settle(comm)
    with meter.measuring():
        await comm.reduce(x, out, root=0)
    if comm.rank == 0:
        assert float(out[0]) == float(out[-1]) == 3.0


async def _gather_scatter(comm: acoll.Communicator, meter: Meter) -> None:
    x = np.full(4 * MIB, comm.rank, np.float32)
    out = np.full(2 * x.size, -1, np.float32)  # 32 MiB
    await _settle(comm)
    with meter.measuring():
        await comm.all_gather(x, out)
        await comm.all_to_all(out, out)  # in place: acoll copies the input first
        await comm.reduce_scatter(out, x)
    assert float(x[0]) == float(x[-1]) == 0 + 1  # rank q's blocks all hold q


async def _late_recv(comm: acoll.Communicator, meter: Meter) -> None:
    """The message arrives before its receive is posted: kept aside, then copied out."""
    x = np.full(8 * MIB, 7 if comm.rank == 0 else 0, np.float32)
    await _settle(comm)
    with meter.measuring():
        if comm.rank == 0:
            await comm.send(x, 1)
        else:
            await asyncio.sleep(0.3)  # the 32 MiB arrive meanwhile
            await comm.recv(x, 0)
    assert float(x[0]) == float(x[-1]) == 7


CASES: dict[str, tuple[dict[str, str], Callable[[acoll.Communicator, Meter],
                                                Awaitable[None]]]] = {
    "ring-32M": ({}, lambda c, m: _all_reduce(c, m, nbytes=32 * MIB)),
    "ring-avg-bf16-16M": ({}, lambda c, m: _all_reduce(
        c, m, nbytes=16 * MIB, dtype=acoll._dtypes.BFLOAT16, op="avg")),
    "ring-one-chunk-32M": ({"ACOLL_CHUNK_SIZE": "64M"},
                           lambda c, m: _all_reduce(c, m, nbytes=32 * MIB)),
    "rd-32M": ({"ACOLL_ALGO": "rd"}, lambda c, m: _all_reduce(c, m, nbytes=32 * MIB)),
    "tree-reduce-32M": ({"ACOLL_ALGO": "tree"}, _reduce),
    "gather-alltoall-scatter-32M": ({}, _gather_scatter),
    "late-recv-32M": ({}, _late_recv),
}


async def _measure_again_if_over(fn: Callable[[acoll.Communicator, Meter], Awaitable[None]],
                                 monkeypatch: pytest.MonkeyPatch) -> tuple[float, float, str]:
    """:func:`_measure`, once more if the first run went over its limit: on this VM a vCPU
    the host takes away for a while still counts as the thread's CPU time (one task step of
    13 ms in a clean-clone run whose every other run of it stayed under 2 ms), while a step
    that really does too much goes over in both runs."""
    worst, limit, what = await _measure(fn, monkeypatch)
    if worst > limit:
        print(f"first run: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}; again")
        worst, limit, what = await _measure(fn, monkeypatch)
    return worst, limit, what


@pytest.mark.parametrize("case", list(CASES))
async def test_no_long_loop_step(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env, fn = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worst, limit, what = await _measure_again_if_over(fn, monkeypatch)
    print(f"{case}: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}")
    assert worst <= limit, (f"{case}: the loop was held for {worst:.1f} ms of CPU "
                            f"(limit {limit} ms) by {what}")


#: The same bound with the two ranks joined by shared memory (as ranks in two processes
#: of a host are): copies into and out of the rings are paced by the transport's budget.
SHM_CASES = ["ring-32M", "rd-32M", "gather-alltoall-scatter-32M", "late-recv-32M"]


@pytest.mark.skipif(bool(shm.unsupported()), reason=shm.unsupported() or "-")
@pytest.mark.parametrize("case", SHM_CASES)
async def test_no_long_loop_step_over_shm(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env, fn = CASES[case]
    for name, value in {**env, "ACOLL_INPROC_DISABLE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(shm.ShmTransport, "can_connect",
                        lambda self, mine, theirs: mine.same_host(theirs))

    async def checked(comm: acoll.Communicator, meter: Meter) -> None:
        assert comm.transport_name(1 - comm.rank) == "shm"
        await fn(comm, meter)

    worst, limit, what = await _measure_again_if_over(checked, monkeypatch)
    print(f"{case} over shm: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}")
    assert worst <= limit, (f"{case} over shm: the loop was held for {worst:.1f} ms of CPU "
                            f"(limit {limit} ms) by {what}")


async def test_no_long_loop_step_with_the_native_ring(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """Ranks joined by TCP with the native ring: its C code runs on a worker thread, so
    the loop only starts the call and takes its completion."""
    from acoll import _native

    if _native.load() is None:
        pytest.skip("no C compiler: the native ring cannot be built here")
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def checked(comm: acoll.Communicator, meter: Meter) -> None:
        assert comm._native is not None
        await _all_reduce(comm, meter, nbytes=32 * MIB)

    worst, limit, what = await _measure_again_if_over(checked, monkeypatch)
    print(f"native ring-32M: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}")
    assert worst <= limit, (f"native ring-32M: the loop was held for {worst:.1f} ms of CPU "
                            f"(limit {limit} ms) by {what}")


#: Wall-clock bound of the forming test below: far above what acoll holds the loop for
#: (5 ms measured), far below what it held it for with a page-populating mmap() in the
#: loop's thread or holding the GIL (90 ms at 32 MiB, 165 ms at 64 MiB).
WALL_LIMIT_MS = 80.0


@pytest.mark.skipif(bool(shm.unsupported()), reason=shm.unsupported() or "-")
async def test_forming_over_shm_keeps_the_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the shared segment of each shm connection was made (its pages
    reserved and faulted in) and the peer's mapped on the loop's thread, 10 ms a handshake
    with the default ring and 60-80 ms with 32 MiB rings; moved to a worker thread, the
    faulting-in still held the GIL on Python 3.11 (mmap's MAP_POPULATE), which CPU time
    does not show. Here the whole of init_rank(), a barrier and close() is measured, with
    64 MiB rings: the CPU time of each loop step (as in the cases above) and the longest
    wall-clock gap between two turns of a ticker task."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_SHM_RING_SIZE", "64M")
    monkeypatch.setattr(shm.ShmTransport, "can_connect",
                        lambda self, mine, theirs: mine.same_host(theirs))
    loop = asyncio.get_running_loop()

    async def formed(comm: acoll.Communicator, meter: Meter) -> None:
        assert comm.transport_name(1 - comm.rank) == "shm"
        await comm.barrier()

    async def whole() -> tuple[float, float, str, float]:
        async def measured(comm: acoll.Communicator, meter: Meter) -> None:
            await formed(comm, meter)
        meter = Meter()
        meter.active = 1  # (from the first step of init_rank() to the end of close())
        gap, stop = 0.0, False

        async def wall_ticker() -> None:
            nonlocal gap
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gap, last = max(gap, now - last), now

        gc.collect()
        gc.freeze()
        debug = loop.get_debug()
        loop.set_debug(False)
        ticker = asyncio.ensure_future(wall_ticker())
        try:
            worst, limit, what = await _measure_in(measured, monkeypatch, meter, loop)
        finally:
            stop = True
            await ticker
            loop.set_debug(debug)
            gc.unfreeze()
        return worst, limit, what, gap * 1e3

    worst, limit, what, gap = await whole()
    if worst > limit or gap > WALL_LIMIT_MS:
        print(f"first run: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}, "
              f"longest gap {gap:.1f} ms; again")
        worst, limit, what, gap = await whole()
    print(f"forming over shm: worst {worst:.2f} ms of CPU (limit {limit} ms) by {what}, "
          f"longest wall-clock gap {gap:.1f} ms")
    assert worst <= limit, (f"forming over shm: the loop was held for {worst:.1f} ms of CPU "
                            f"(limit {limit} ms) by {what}")
    assert gap <= WALL_LIMIT_MS, (f"forming over shm: the loop did not turn for {gap:.1f} ms "
                                  f"(limit {WALL_LIMIT_MS} ms)")
