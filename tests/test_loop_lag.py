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
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import acoll
from acoll.testing import run_ranks

STEP_LIMIT_MS = 6.0  # one callback (asyncio)
ITER_LIMIT_MS = 15.0  # one loop iteration: up to ~8 callbacks of two ranks (uvloop)
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

    monkeypatch.setattr(asyncio.events.Handle, "_run", timed_run)
    try:
        yield
    finally:
        monkeypatch.undo()


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


async def _all_reduce(comm: acoll.Communicator, meter: Meter, *, nbytes: int,
                      dtype: Any = np.float32, op: str = "sum") -> None:
    x = np.full(nbytes // np.dtype(dtype).itemsize, comm.rank + 1, dtype)
    await comm.barrier()
    with meter.measuring():
        await comm.all_reduce(x, op=op)
        await comm.all_reduce(x, op=op)
    expect = 6.0 if op == "sum" else 1.5
    assert float(x[0]) == float(x[-1]) == expect


async def _reduce(comm: acoll.Communicator, meter: Meter) -> None:
    x = np.full(4 * MIB, comm.rank + 1, np.float32)
    out = np.empty_like(x)
    await comm.barrier()
    with meter.measuring():
        await comm.reduce(x, out, root=0)
    if comm.rank == 0:
        assert float(out[0]) == float(out[-1]) == 3.0


async def _gather_scatter(comm: acoll.Communicator, meter: Meter) -> None:
    x = np.full(4 * MIB, comm.rank, np.float32)
    out = np.empty(2 * x.size, np.float32)
    await comm.barrier()
    with meter.measuring():
        await comm.all_gather(x, out)
        await comm.all_to_all(out, out)  # in place: acoll copies the input first
        await comm.reduce_scatter(out, x)
    assert float(x[0]) == float(x[-1]) == 2 * comm.rank


async def _late_recv(comm: acoll.Communicator, meter: Meter) -> None:
    """The message arrives before its receive is posted: kept aside, then copied out."""
    x = np.full(4 * MIB, 7, np.float32)
    await comm.barrier()
    with meter.measuring():
        if comm.rank == 0:
            await comm.send(x, 1)
        else:
            x[:] = 0
            await asyncio.sleep(0.3)  # the 16 MiB arrive meanwhile
            await comm.recv(x, 0)
    assert float(x[0]) == float(x[-1]) == 7


CASES: dict[str, tuple[dict[str, str], Callable[[acoll.Communicator, Meter],
                                                Awaitable[None]]]] = {
    "ring-32M": ({}, lambda c, m: _all_reduce(c, m, nbytes=32 * MIB)),
    "ring-avg-bf16-16M": ({}, lambda c, m: _all_reduce(
        c, m, nbytes=16 * MIB, dtype=acoll._dtypes.BFLOAT16, op="avg")),
    "ring-one-chunk-16M": ({"ACOLL_CHUNK_SIZE": "64M"},
                           lambda c, m: _all_reduce(c, m, nbytes=16 * MIB)),
    "rd-16M": ({"ACOLL_ALGO": "rd"}, lambda c, m: _all_reduce(c, m, nbytes=16 * MIB)),
    "tree-reduce-16M": ({"ACOLL_ALGO": "tree"}, _reduce),
    "gather-alltoall-scatter": ({}, _gather_scatter),
    "late-recv-16M": ({}, _late_recv),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_no_long_loop_step(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env, fn = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worst, limit, what = await _measure(fn, monkeypatch)
    assert worst <= limit, (f"{case}: the loop was held for {worst:.1f} ms of CPU "
                            f"(limit {limit} ms) by {what}")
