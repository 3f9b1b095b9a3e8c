"""One rank of a shared-memory lane test (started by tests/test_lane.py).

    python mp_lane.py SCENARIO UID_HEX RANK NRANKS

Prints ``RESULT <json>`` on success; the test reads it. ``ACOLL_TEST_CPUS`` makes the
process report that many CPUs, so that 3 or 4 ranks use the lane on a 2-core machine (the
lane wants a core per rank).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("ACOLL_TEST_CPUS"):
    _cpus = int(os.environ["ACOLL_TEST_CPUS"])
    os.cpu_count = lambda: _cpus

import numpy as np

import acoll
from acoll._comm import lane as lane_mod
from collective_cases import ALL_DTYPES, ALL_OPS, check_all, reference

RUNS = {"lane": 0, "steps": 0, "zc_calls": 0, "zero_copy": 0}  # lane ops run, by kind


def _count(cls: Any, kind: str) -> None:
    run = cls.run

    async def counted(self: Any, seq: int, *args: Any, **kwargs: Any) -> None:
        RUNS[kind] += 1
        await run(self, seq, *args, **kwargs)

    cls.run = counted


_count(lane_mod._LaneCall, "lane")
_count(lane_mod.StepPlan, "steps")
_count(lane_mod.ZeroCopyAllReduce, "zc_calls")
#: zero-copy runs by collective ("zero_copy" counts all_reduce's, as before)
ZERO_COPY_BY: dict[str, int] = {}


def _count_zero_copy(cls: Any, name: str) -> None:
    run = cls._zero_copy

    async def counted(self: Any, *args: Any) -> None:
        ZERO_COPY_BY[name] = ZERO_COPY_BY.get(name, 0) + 1
        if name == "all_reduce":
            RUNS["zero_copy"] += 1
        await run(self, *args)

    cls._zero_copy = counted


for _cls, _name in ((lane_mod.ZeroCopyAllReduce, "all_reduce"),
                    (lane_mod.ZeroCopyAllGather, "all_gather"),
                    (lane_mod.ZeroCopyReduceScatter, "reduce_scatter"),
                    (lane_mod.ZeroCopyBroadcast, "broadcast")):
    _count_zero_copy(_cls, _name)
#: every step plan made: (its Steps class, payload bytes per peer per step)
STEP_PLANS: list[tuple[str, int]] = []
_step_plan_init = lane_mod.StepPlan.__init__


def _record_plan(self: Any, comm: Any, lane: Any, desc: Any, dtype: Any, steps: Any,
                 *args: Any) -> None:
    STEP_PLANS.append((type(steps).__name__, steps.per * np.dtype(dtype).itemsize))
    _step_plan_init(self, comm, lane, desc, dtype, steps, *args)


lane_mod.StepPlan.__init__ = _record_plan  # type: ignore[method-assign]

if os.environ.get("LANE_NO_BOARD_RANK") == sys.argv[3]:  # this rank cannot map boards

    def _refuse(pid: int, fd: int, span: int) -> Any:
        raise RuntimeError("refused by the test (not an OSError: any error falls back)")

    lane_mod.open_board = _refuse


if os.environ.get("LANE_NO_CACHE_RANK") == sys.argv[3]:  # this rank cannot read its caches
    lane_mod.largest_cache = lambda root="": 0  # (so it would cut 512 KiB steps alone)


async def pair_steps_agreed(comm: acoll.Communicator) -> dict[str, Any]:
    """A 2-rank all_reduce in one-shot steps (5 MiB + 28 bytes of float32, every rank's
    input different), against the reference; with the lane's agreed pair step."""
    from collective_cases import assert_same, make_input

    n, r = comm.size, comm.rank
    count = (5 << 18) + 7
    inputs = [make_input(k, count, np.dtype(np.float32), acoll.SUM) for k in range(n)]
    x = inputs[r].copy()
    await comm.all_reduce(x)
    assert_same(x, reference(inputs, acoll.SUM), "all_reduce in one-shot steps")
    assert comm._lane is not None
    return {"pair_step": comm._lane.pair_step, "plans": sorted(set(STEP_PLANS))}


async def _outcome(coro: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        await coro
    except acoll.AcollError as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "rank": getattr(exc, "rank", None), "after": time.monotonic() - t0}
    return {"error": None, "after": time.monotonic() - t0}


async def matrix(comm: acoll.Communicator) -> dict[str, Any]:
    checks = await check_all(comm, [1, 7, 1000, 20000, 150001], ALL_DTYPES, ALL_OPS)
    return {"checks": checks}


async def steps_matrix(comm: acoll.Communicator) -> dict[str, Any]:
    """Sizes over the (small) lane: every collective in steps."""
    counts = [1000, 4099, 65537] if comm.size == 2 else [1000, 4099]
    checks = await check_all(comm, counts, ALL_DTYPES, ALL_OPS)
    return {"checks": checks}


async def pair_large(comm: acoll.Communicator) -> dict[str, Any]:
    """2 ranks, the automatic lane (2 MiB slots): every collective over a slot, so
    all_reduce goes in one-shot steps of 512 KiB, the others in steps of at most 1 MiB per
    peer, reduce off the lane; float32 and float64, every op."""
    counts = [(5 << 18) + 7]  # 5 MiB + 28 bytes of float32
    checks = await check_all(comm, counts, [np.dtype(np.float32), np.dtype(np.float64)],
                             ALL_OPS)
    return {"checks": checks, "plans": sorted(set(STEP_PLANS))}


async def mismatch_count(comm: acoll.Communicator) -> dict[str, Any]:
    x = np.ones(4 if comm.rank == 0 else 5, np.float32)
    return await _outcome(comm.all_reduce(x))


async def mismatch_path(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0 runs a lane-sized all_reduce, the others a reduce of 4 MiB (off the lane:
    the message path)."""
    x = np.ones(2 if comm.rank == 0 else 1 << 20, np.float32)
    return await _outcome(comm.all_reduce(x) if comm.rank == 0 else comm.reduce(x))


async def mismatch_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """All ranks run all_reduces too large for one slot (in steps), of different counts."""
    x = np.ones((1 << 20) + (comm.rank == 0), np.float32)
    return await _outcome(comm.all_reduce(x))


async def mismatch_board(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0 all_gathers a block that fits a slot (one step, mailboxes); the others one
    larger than a slot (in steps, on the boards)."""
    n = comm.size
    block = 8 if comm.rank == 0 else (comm._lane.limit // 4) + 8
    return await _outcome(comm.all_gather(np.ones(block, np.int32),
                                          np.zeros(n * block, np.int32)))


async def step_group(comm: acoll.Communicator) -> dict[str, Any]:
    """Ops in steps mixed with one-slot ops, in a group and as concurrent tasks."""
    n, r = comm.size, comm.rank
    big = np.full(300_001, r + 1, np.float32)
    small = np.full(3, r, np.int64)
    gathered = np.zeros(n * 300_000, np.int32)
    async with comm.group():
        await comm.all_reduce(big)
        await comm.all_reduce(small)
        await comm.all_gather(np.full(300_000, r, np.int32), gathered)
    assert np.all(big == n * (n + 1) / 2), big
    assert list(small) == [n * (n - 1) // 2] * 3, small
    assert np.array_equal(gathered, np.repeat(np.arange(n, dtype=np.int32), 300_000))
    xs = [np.full(250_000 + k, r * 10 + k, np.float64) for k in range(3)]
    await asyncio.gather(*(comm.all_reduce(x) for x in xs), comm.all_reduce(small))
    for k, x in enumerate(xs):
        assert np.all(x == sum(q * 10 + k for q in range(n))), (k, x)
    return {"ok": True}


async def folded_late_in_group(comm: acoll.Communicator) -> dict[str, Any]:
    """Found by review (session 48): in a group, an in-place reduce_scatter in steps whose
    last step combines gives the lane's turn up once it published that step, before its
    peers' pieces are folded in; ranks 0 and 1 publish the last step late, so the next op
    runs (and combines) on rank 2 meanwhile. Rank 2's saved operand must survive it.
    (Run with ACOLL_SHM_LANE_MAX=4096: 3 steps of 512 float64 per part.)"""
    from acoll._transport import shmlane

    n, r = comm.size, comm.rank
    lane = comm._lane
    assert lane is not None
    assert lane.limit == 4096
    c = 3 * (lane.step // 8)  # a part: three steps, the last one combining
    await comm.all_reduce(np.ones(4))
    if r in (0, 1):
        publish = shmlane._Slots.publish_at

        def late(self: Any, slot: int, value: int, head: Any) -> None:
            if value >> 44 == 2:  # (the third step of an op)
                time.sleep(0.05)
            publish(self, slot, value, head)

        shmlane._Slots.publish_at = late  # type: ignore[method-assign]
    wrong = []
    for second in ("reduce_scatter", "all_reduce", "reduce_scatter"):
        a = np.concatenate([np.full(c, 100 * r + 10 * q + 1, np.float64) for q in range(n)])
        b = np.concatenate([np.full(c, 1000 * (r + 1) + q, np.float64) for q in range(n)])
        mine_a, mine_b = a[r * c:(r + 1) * c], b[r * c:(r + 1) * c]
        async with comm.group():
            await comm.reduce_scatter(a, mine_a)
            if second == "all_reduce":
                await comm.all_reduce(mine_b)
            else:
                await comm.reduce_scatter(b, mine_b)
        want_a = sum(100 * q + 10 * r + 1 for q in range(n))
        want_b = sum(1000 * (q + 1) + (q if second == "all_reduce" else r) for q in range(n))
        wrong.append([int(np.count_nonzero(mine_a != want_a)),
                      int(np.count_nonzero(mine_b != want_b))])
    return {"wrong": wrong}


async def mismatch_root(comm: acoll.Communicator) -> dict[str, Any]:
    x = np.ones(8, np.int32)
    return await _outcome(comm.broadcast(x, root=1 if comm.rank == comm.size - 1 else 0))


async def late(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 comes 0.3 s late; rank 0's loop keeps ticking meanwhile."""
    async with _LoopLag() as lag:
        await asyncio.sleep(0.05)
        if comm.rank == 1:
            await asyncio.sleep(0.3)
        x = np.full(3, comm.rank + 1, np.float64)
        await comm.all_reduce(x)
    want = comm.size * (comm.size + 1) / 2
    assert list(x) == [want] * 3, x
    return {"ticks": len(lag.lags), "worst_lag": max(lag.lags),
            "worst_busy_lag": max(lag.busy)}


async def stream(comm: acoll.Communicator) -> dict[str, Any]:
    """Back-to-back lane ops that find their peers ready still let other tasks run."""
    ticks = 0
    stop = False

    async def counter() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(counter())
    await asyncio.sleep(0)
    x = np.zeros(2, np.float32)
    t0 = time.perf_counter()
    for _ in range(3000):
        await comm.all_reduce(x)
    elapsed = time.perf_counter() - t0
    stop = True
    await task
    return {"ticks": ticks, "elapsed": elapsed}


async def timeout(comm: acoll.Communicator) -> dict[str, Any]:
    if comm.rank == 1:
        await asyncio.sleep(6)
        return {"error": "skipped"}
    return await _outcome(comm.all_reduce(np.ones(2, np.float32)))


async def silent_group(comm: acoll.Communicator) -> dict[str, Any]:
    if comm.rank == 1:
        await asyncio.sleep(6)
        return {"error": "skipped"}
    async def ops() -> None:
        async with comm.group():
            await comm.all_reduce(np.ones(2, np.float32))
            await comm.barrier()
    return await _outcome(ops())


async def killed(comm: acoll.Communicator) -> dict[str, Any]:
    await comm.all_reduce(np.ones(2, np.float32))  # the lane is warm
    if comm.rank == 1:
        await asyncio.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    return await _outcome(comm.all_reduce(np.ones(2, np.float32)))


async def killed_in_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 is SIGKILLed while every rank runs all_reduces in steps."""
    x = np.ones(1 << 22, np.float32)  # 16 MiB: many steps
    await comm.all_reduce(x)
    if comm.rank == 1:
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGKILL)

    async def forever() -> None:
        while True:
            await comm.all_reduce(x)

    return await _outcome(forever())


async def alias(comm: acoll.Communicator) -> dict[str, Any]:
    """recv given as the same memory as send in other objects (the same array, a view of
    it, memoryviews), first calls (no cached plan) and later ones, one slot and steps."""
    n, r = comm.size, comm.rank
    want = sum(10.0 ** q for q in range(n))  # (rank r gives 10**r: a wrong sum shows)
    for count in (3, 100, 5000, 300_001):
        x = np.full(count, 10.0 ** r)
        await comm.all_reduce(x, x)
        assert np.all(x == want), (count, x[:4])
        y = np.full(count, 10.0 ** r)
        await comm.all_reduce(y, y[:])
        assert np.all(y == want), (count, y[:4])
        z = np.full(count, 10.0 ** r)
        await comm.all_reduce(memoryview(z), memoryview(z))
        assert np.all(z == want), (count, z[:4])
    return {"ok": True}


async def gather_lag(comm: acoll.Communicator) -> dict[str, Any]:
    """The loop's worst lag while 128 MiB blocks are all_gathered out of place (this
    rank's own block is copied a piece per step, not in one go)."""
    n, r = comm.size, comm.rank
    block = 64 << 20
    send = np.full(block // 4, r, np.int32)
    recv = np.zeros(n * block // 4, np.int32)
    await comm.all_gather(send, recv)
    lags: list[float] = []
    busy: list[float] = []  # the part of each lag this thread spent running (CPU time)
    stop = False

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop:
            t, c = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            lag = loop.time() - t - 0.001
            lags.append(lag)
            busy.append(min(lag, time.thread_time() - c))

    tick = asyncio.create_task(ticker())
    for _ in range(3):
        await comm.all_gather(send, recv)
    stop = True
    await tick
    assert np.array_equal(recv[::1 << 20], np.repeat(np.arange(n, dtype=np.int32), 16)), recv
    return {"ticks": len(lags), "worst_lag": max(lags), "worst_busy_lag": max(busy)}


async def stalled_in_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1's loop stalls for 6 s in the middle of an all_reduce in steps (deadline 3 s)."""
    x = np.ones(1 << 22, np.float32)
    await comm.all_reduce(x)
    if comm.rank == 1:  # (inside the op: at its second combining step)
        calls = 0
        folder = lane_mod.StepPlan._folder

        def stalling(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                time.sleep(6)
            return folder(*args)

        lane_mod.StepPlan._folder = stalling  # type: ignore[method-assign]
    return await _outcome(comm.all_reduce(x))


async def skipped_in_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 skips an all_reduce in steps (deadline 3 s): the others' pieces of its first
    step arrived, but each rank folds in rank order, so most wait behind rank 1 with
    pieces of later ranks in hand; they must name rank 1 alone."""
    x = np.ones(1 << 22, np.float32)
    await comm.all_reduce(x)
    if comm.rank == 1:
        await asyncio.sleep(6)
        return {"error": "skipped"}
    return await _outcome(comm.all_reduce(x))


async def plans(comm: acoll.Communicator) -> dict[str, Any]:
    """Repeated calls on one array reuse a plan; a changed array is not fooled by it."""
    n, r = comm.size, comm.rank
    x = np.full(4, r + 1, np.float32)
    for _ in range(3):
        x[:] = r + 1
        await comm.all_reduce(x)
    assert list(x) == [n * (n + 1) / 2] * 4, x
    x.dtype = np.int32  # same bytes, another dtype: the plan must not be reused
    x[:] = r + 1
    await comm.all_reduce(x)
    assert x.dtype == np.int32
    assert list(x) == [n * (n + 1) // 2] * 4, x
    y = np.full(4, r + 1, np.float32)
    out = np.empty_like(y)
    await comm.all_reduce(y, out, op="max")
    await comm.all_reduce(y, out, op=acoll.MIN)
    assert list(out) == [1.0] * 4, out
    out.setflags(write=False)
    return await _outcome(comm.all_reduce(y, out))  # read-only now: refused by name


async def group(comm: acoll.Communicator) -> dict[str, Any]:
    n, r = comm.size, comm.rank
    xs = [np.full(5, r + k, np.int64) for k in range(4)]
    async with comm.group():
        for x in xs:
            await comm.all_reduce(x)
        b = np.full(3, r, np.int32)
        await comm.broadcast(b, root=n - 1)
    for k, x in enumerate(xs):
        assert list(x) == [sum(q + k for q in range(n))] * 5, (k, x)
    assert list(b) == [n - 1] * 3, b
    ys = [np.full(2, r * 10 + k, np.float64) for k in range(3)]
    await asyncio.gather(*(comm.all_reduce(y) for y in ys))
    for k, y in enumerate(ys):
        assert list(y) == [sum(q * 10 + k for q in range(n))] * 2, (k, y)
    await comm.barrier()
    return {"ok": True}


async def after_close(comm: acoll.Communicator) -> dict[str, Any]:
    x = np.ones(2, np.float32)
    await comm.all_reduce(x)
    await comm.close()
    errors = []
    for call in (lambda: comm.all_reduce(x), lambda: comm.broadcast(x),
                 lambda: comm.all_gather(x, np.empty(2 * comm.size, np.float32)),
                 comm.barrier):
        errors.append((await _outcome(call()))["error"])
    return {"errors": errors}


async def done_then_fail(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 completes an all_reduce, then makes an invalid call at once: rank 0's
    all_reduce, which every rank completed, must not report rank 1's later error."""
    x = np.ones(2, np.float32)
    await comm.all_reduce(x)
    if comm.rank == 0:
        await asyncio.sleep(0.05)  # rank 1 is done and failed by now
        got = await _outcome(comm.all_reduce(x))
        return {**got, "x": x.tolist()}
    await comm.all_reduce(x)
    return {**await _outcome(comm.all_reduce(x, op="bogus")), "x": x.tolist()}


async def close_inflight(comm: acoll.Communicator) -> dict[str, Any]:
    """close() right after starting a lane op waits for it, as for any op."""
    x = np.ones(2, np.float32)
    await comm.all_reduce(x)
    if comm.rank == 1:
        await asyncio.sleep(0.3)
    task = asyncio.create_task(comm.all_reduce(x))
    await asyncio.sleep(0)
    await comm.close()
    await task
    return {"x": x.tolist()}


async def late_group(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 is 1 s late to a group of 4 lane ops: rank 0 must not burn a core."""
    xs = [np.ones(2, np.float32) for _ in range(4)]
    await comm.barrier()
    if comm.rank == 1:
        await asyncio.sleep(1.0)
    cpu = time.process_time()
    async with comm.group():
        for x in xs:
            await comm.all_reduce(x)
    return {"cpu": time.process_time() - cpu, "x": [x.tolist() for x in xs]}


async def arrays(comm: acoll.Communicator) -> dict[str, Any]:
    """Calls like an earlier one (same dtype, count, op) on other or changed arrays."""
    n, r = comm.size, comm.rank
    x = np.full(4, r + 1, np.float32)
    await comm.all_reduce(x)
    x.resize(8, refcheck=True)  # nothing of acoll's refers to x any more
    x[:] = r + 1
    await comm.all_reduce(x)
    assert list(x) == [n * (n + 1) / 2] * 8, x
    x[:] = r + 1
    out = np.empty(8, np.float32)
    await comm.all_reduce(x, out)  # a plan made for in place, used out of place
    assert list(out) == [n * (n + 1) / 2] * 8, out
    y = np.full((2, 4), r + 1, np.float32)  # same dtype and count, another shape
    await comm.all_reduce(y)
    assert (y == n * (n + 1) / 2).all(), y
    bad = np.empty(8, np.float64)  # the plan's count and send dtype, a wrong recv dtype
    res = await _outcome(comm.all_reduce(x, bad))
    return {**res, "x": out.tolist()}


async def bad_op(comm: acoll.Communicator) -> dict[str, Any]:
    x = np.ones(2, np.float32)
    await comm.all_reduce(x)
    return await _outcome(comm.all_reduce(x, op=["sum"] if comm.rank == 0 else "sum"))


# ------------------------------------------------------------------ registered buffers
class _Arena:
    """Buffers carved out of one registered allocation (``acoll.empty_shared``): each
    ``take`` is a copy of an array at the next offset (a multiple of 8 bytes, plus
    ``skew``), wrapping around; calls use at most a few at once, far fewer than fit."""

    def __init__(self, nbytes: int, skew: int = 0) -> None:
        self.block = acoll.empty_shared(nbytes, np.uint8)
        self.at, self.skew = 0, skew

    def take(self, a: Any) -> Any:
        a = np.ascontiguousarray(a)
        start = -(-self.at // 16) * 16 + self.skew
        if start + a.nbytes > self.block.nbytes:
            start = self.skew
        self.at = start + a.nbytes
        view = self.block[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        return view


async def _registered(comm: acoll.Communicator, nbytes: int, skew: int = 0) -> _Arena:
    arena = _Arena(nbytes, skew)
    reg = await comm.register(arena.block)
    assert reg.index >= 0, reg
    return arena


class _LoopLag:
    """A 1 ms ticker for the block's duration: each tick's lag, and the part of it this
    thread spent running (``busy``: a stall of the loop's own code, not of the machine)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.busy: list[float] = []
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop:
            t, c = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            lag = loop.time() - t - 0.001
            self.lags.append(lag)
            self.busy.append(min(lag, time.thread_time() - c))

    async def __aenter__(self) -> _LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        assert self._task is not None
        await self._task


async def avg_no_overflow(comm: acoll.Communicator) -> dict[str, Any]:
    """float16 AVG of 60000 on every rank (the sum overflows float16): each input is
    scaled by 1/n first, as NCCL does, so every result is finite and equal to the scaled
    inputs' sum; all_reduce (in place and not), reduce (root and not) and reduce_scatter
    (in place and not), from one lane slot to steps and the native ring, plain arrays and
    registered ones (zero-copy from 512 KiB); groups too. ``send`` buffers stay as they
    were."""
    n, r = comm.size, comm.rank
    places: list[Any] = [np.array]
    if comm._lane is not None:  # (registering needs the lane)
        places.append((await _registered(comm, 24 << 20)).take)
    bad: list[str] = []
    runs = 0

    def check(got: Any, count: int, what: str) -> None:
        want = reference([np.full(count, 60000, np.float16)] * n, acoll.AVG)
        if not (np.isfinite(got).all() and np.array_equal(got, want)):
            bad.append(f"{what} count={count}: got {got[:3]} want {want[:3]}")

    for count in (7, 5000, 300_001, 600_001):
        for place in places:
            kind = "plain" if place is np.array else "registered"
            src = place(np.full(count, 60000, np.float16))
            out = place(np.zeros(count, np.float16))
            await comm.all_reduce(src, out, op="avg")
            check(out, count, f"all_reduce {kind}")
            if not (src == 60000).all():
                bad.append(f"all_reduce {kind} count={count}: send changed")
            await comm.all_reduce(src, op=acoll.AVG)
            check(src, count, f"all_reduce in place {kind}")
            mine = place(np.full(count, 60000, np.float16))
            res = place(np.zeros(count, np.float16))
            await comm.reduce(mine, res, op=acoll.AVG, root=n - 1)
            if r == n - 1:
                check(res, count, f"reduce {kind}")
            if not (mine == 60000).all():
                bad.append(f"reduce {kind} count={count}: send changed on rank {r}")
            whole = place(np.full(n * count, 60000, np.float16))
            block = place(np.zeros(count, np.float16))
            await comm.reduce_scatter(whole, block, op=acoll.AVG)
            check(block, count, f"reduce_scatter {kind}")
            if not (whole == 60000).all():
                bad.append(f"reduce_scatter {kind} count={count}: send changed")
            await comm.reduce_scatter(whole, whole[r * count:(r + 1) * count], op=acoll.AVG)
            check(whole[r * count:(r + 1) * count], count, f"reduce_scatter in place {kind}")
            rest = np.delete(np.asarray(whole), np.s_[r * count:(r + 1) * count])
            if not (rest == 60000).all():
                bad.append(f"reduce_scatter in place {kind} count={count}: others changed")
            runs += 6
        group = [np.full(count, 60000, np.float16) for _ in range(3)]
        async with comm.group():
            for g in group:
                await comm.all_reduce(g, op=acoll.AVG)
        for g in group:
            check(g, count, "all_reduce in a group")
    return {"bad": bad[:10], "runs": runs}


async def avg_in_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """Floating-point AVG all_reduces through the lane, in one shot and in steps (one-shot
    steps with 2 ranks, two-shot with more; ``AVG_FOLD=1``: the steps scale the input as
    they copy it, 0: it is scaled first): inputs that vary along the array, every element
    checked against the reference (in place and not; send buffers untouched). Counts the
    step plan runs that scaled as they copied."""
    from collective_cases import assert_same

    scaled = [0]

    def counted(cls: Any) -> None:
        run = cls.run

        async def counting(self: Any, *args: Any, **kwargs: Any) -> None:
            scaled[0] += kwargs.get("factor") is not None
            await run(self, *args, **kwargs)

        cls.run = counting

    counted(lane_mod.StepPlan)
    if "AVG_FOLD" in os.environ:
        from acoll import _communicator
        _communicator._FOLD_AVG = os.environ["AVG_FOLD"] == "1"
    n, r = comm.size, comm.rank
    bad: list[str] = []
    calls = 0
    for dt in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)):
        for count in (7, 20_011, 700_001):
            inputs = [_random_input(k, count, dt, count) for k in range(n)]
            want = reference(inputs, acoll.AVG)
            src, out = inputs[r].copy(), np.zeros(count, dt)
            for what, run, got in (
                    ("out of place", comm.all_reduce(src, out, op=acoll.AVG), out),
                    ("in place", comm.all_reduce(src, op="avg"), src)):
                await run
                calls += 1
                try:  # (the lane folds in rank order: the reference's bits)
                    assert_same(got, want, f"{what} {dt} count={count}")
                except AssertionError as exc:
                    bad.append(str(exc)[:300])
                if what == "out of place" and not np.array_equal(src, inputs[r]):
                    bad.append(f"{dt} count={count}: the send buffer changed")
    return {"bad": bad[:10], "calls": calls, "scaled": scaled[0]}


def _random_input(rank: int, count: int, dt: Any, salt: int) -> Any:
    """Rank ``rank``'s input of ``count`` x ``dt``: random values of both signs and many
    magnitudes, so that scaling before the sum and after it round differently."""
    rng = np.random.default_rng([rank, count, salt])
    return (rng.standard_normal(count) * 100).astype(dt)


async def avg_reduce_scatter_in_steps(comm: acoll.Communicator) -> dict[str, Any]:
    """Floating-point AVG reduce_scatters through the lane, blocks of one slot and of more
    (steps, which scale each piece as they copy it from the send buffer unless
    ``AVG_FOLD=0``): against the reference bit for bit, out of place (the send buffer
    untouched; a 2-D one too) and in place (the other blocks untouched). Returns how many
    step plan runs scaled as they copied and how many calls ran in steps."""
    from acoll._dtypes import BFLOAT16
    from collective_cases import assert_same

    scaled = [0]
    step_run = lane_mod.StepPlan.run

    async def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        scaled[0] += kwargs.get("factor") is not None
        await step_run(self, *args, **kwargs)

    lane_mod.StepPlan.run = counting  # type: ignore[method-assign]
    if "AVG_FOLD" in os.environ:
        from acoll import _communicator
        _communicator._FOLD_AVG = os.environ["AVG_FOLD"] == "1"
    n, r = comm.size, comm.rank
    assert comm._lane is not None
    limit = comm._lane.limit
    bad: list[str] = []
    in_steps = 0
    for dt in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16):
        for block in (7, 20_011, 300_007):
            inputs = [_random_input(k, n * block, dt, block) for k in range(n)]
            want = reference(inputs, acoll.AVG)[r * block:(r + 1) * block]
            send = inputs[r].copy()
            runs: list[tuple[str, Any, Any]] = [
                ("out of place", send, np.zeros(block, dt)),
                ("2-D send", send.reshape(n, block), np.zeros(block, dt))]
            whole = inputs[r].copy()
            runs.append(("in place", whole, whole[r * block:(r + 1) * block]))
            for what, src, dst in runs:
                await comm.reduce_scatter(src, dst, op=acoll.AVG)
                in_steps += block * dt.itemsize > limit
                try:
                    assert_same(dst, want, f"{what} {dt} block={block}")
                except AssertionError as exc:
                    bad.append(str(exc)[:300])
            if not np.array_equal(send, inputs[r]):
                bad.append(f"{dt} block={block}: the send buffer changed")
            if block == 20_011:  # (two at once: concurrent tasks, then a group)
                for how in ("tasks", "group"):
                    one, two = inputs[r].copy(), inputs[r].copy()
                    outs = [np.zeros(block, dt), two[r * block:(r + 1) * block]]
                    if how == "tasks":
                        await asyncio.gather(
                            comm.reduce_scatter(one, outs[0], op=acoll.AVG),
                            comm.reduce_scatter(two, outs[1], op=acoll.AVG))
                    else:
                        async with comm.group():
                            await comm.reduce_scatter(one, outs[0], op=acoll.AVG)
                            await comm.reduce_scatter(two, outs[1], op=acoll.AVG)
                    in_steps += 2 * (block * dt.itemsize > limit)
                    for k, res in enumerate(outs):
                        try:
                            assert_same(res, want, f"{how} {k} {dt} block={block}")
                        except AssertionError as exc:
                            bad.append(str(exc)[:300])
            others = np.delete(whole, np.s_[r * block:(r + 1) * block])
            if not np.array_equal(others, np.delete(inputs[r], np.s_[r * block:(r + 1) * block])):
                bad.append(f"{dt} block={block}: in place changed the other blocks")
    return {"bad": bad[:10], "scaled": scaled[0], "in_steps": in_steps}


async def avg_folded_group_race(comm: acoll.Communicator) -> dict[str, Any]:
    """Found by review: 2 ranks, AVG forced to fold into the one-shot steps, two calls in a
    group with an even number of steps (the first op's last slot is the second op's
    first). Rank 1 publishes the first op's last step 20 ms late and rank 0 starts that
    step's receive 50 ms late, so rank 1 reads rank 0's board and acknowledges it while
    rank 0 has not folded its own share yet, and rank 0's second op may write that slot
    meanwhile (the race is not certain to strike in a run: which steps read their own
    share off the board is returned too). Every result checked against the reference."""
    from acoll import _communicator
    from acoll._transport import shmlane
    from collective_cases import assert_same, make_input

    _communicator._FOLD_AVG = True
    n, r = comm.size, comm.rank
    lane = comm._lane
    assert lane is not None
    lane.pair_step = lane_mod.PAIR_STEP_LARGE  # (the same on both ranks: 1 MiB steps)
    count = 900_000  # (4 steps, the last a short one)
    last = -(-count * 4 // lane_mod.one_shot_step(lane)) - 1
    late = {"first": True}
    if r == 1:
        publish = shmlane._Slots.publish_at

        def publish_late(self: Any, slot: int, value: int, head: Any) -> None:
            if (isinstance(self, shmlane.Board) and late["first"]
                    and value >> shmlane._STEP_SHIFT == last):
                late["first"] = False
                time.sleep(0.02)
            publish(self, slot, value, head)

        shmlane._Slots.publish_at = publish_late  # type: ignore[method-assign]
    else:
        receive = lane_mod.StepPlan._receive

        async def receive_late(self: Any, seq: int, ctx: Any, step: int, *args: Any) -> None:
            if step == last and late["first"]:
                late["first"] = False
                await asyncio.sleep(0.05)
            await receive(self, seq, ctx, step, *args)

        lane_mod.StepPlan._receive = receive_late  # type: ignore[method-assign]
    folder = lane_mod.StepPlan._folder
    own_board: set[tuple[int, bool]] = set()  # (step, whether its own share came off the board)

    def watched(self: Any, slot: int, value: int, *args: Any) -> Any:
        own_board.add((value >> shmlane._STEP_SHIFT, bool(args[-1])))
        return folder(self, slot, value, *args)

    lane_mod.StepPlan._folder = watched  # type: ignore[method-assign]
    bad: list[str] = []
    for rep in range(3):
        late["first"] = True
        ins = [[make_input(k, count, np.dtype(np.float32), acoll.AVG, salt=10 * rep + c)
                for k in range(n)] for c in range(2)]
        a, b = ins[0][r].copy(), ins[1][r].copy()
        async with comm.group():
            await comm.all_reduce(a, op=acoll.AVG)
            await comm.all_reduce(b, op=acoll.AVG)
        for name, got, inputs in (("first", a, ins[0]), ("second", b, ins[1])):
            try:
                assert_same(got, reference(inputs, acoll.AVG), f"rep {rep} {name}")
            except AssertionError as exc:
                bad.append(str(exc)[:300])
    return {"bad": bad, "steps": last + 1, "own_board": sorted(own_board)}


async def reg_matrix(comm: acoll.Communicator) -> dict[str, Any]:
    """Every collective on buffers in a registered allocation (all_reduce, all_gather,
    reduce_scatter and broadcast of ZERO_COPY_MIN or more go zero-copy), at offsets that
    are multiples of the itemsize only, bit for bit against NumPy, in place and not."""
    arena = await _registered(comm, 48 << 20, skew=8)
    counts = [(1 << 18) + 5, 150_001] if comm.size == 2 else [(1 << 18) + 5]
    dtypes = [np.dtype(t) for t in (np.float32, np.float64, np.int32, np.float16, np.uint8)]
    checks = await check_all(comm, counts, dtypes, ALL_OPS, dev=arena.take)
    return {"checks": checks, "zc_calls": RUNS["zc_calls"], "zero_copy": RUNS["zero_copy"],
            "by": ZERO_COPY_BY}


async def reg_reuse(comm: acoll.Communicator) -> dict[str, Any]:
    """The same registered buffers, refilled at once after every call: a rank that left
    a call while a peer still read its buffers would corrupt the peer's result (and
    ranks skewed by a rank that sleeps now and then)."""
    n, r = comm.size, comm.rank
    x = acoll.empty_shared((1 << 17) + 3, np.float64)
    y = acoll.empty_shared((1 << 17) + 3, np.float64)
    await comm.register(x)
    await comm.register(y)
    bad = 0
    for i in range(150):
        x[:] = r + i
        await comm.all_reduce(x, None if i % 2 else y)
        got = x if i % 2 else y
        bad += int(np.count_nonzero(got != sum(q + i for q in range(n))))
        if r == i % n and i % 7 == 0:
            await asyncio.sleep(0.002)
    return {"bad": bad, "zero_copy": RUNS["zero_copy"]}


async def reg_reuse_colls(comm: acoll.Communicator) -> dict[str, Any]:
    """all_gather, reduce_scatter and broadcast on registered buffers, each buffer spoiled
    (-1) right after its call: a rank that left while a peer still read from it would
    give that peer -1s."""
    n, r = comm.size, comm.rank
    c = (1 << 16) + 3  # float64: 512 KiB + 24 B, the broadcast's size; the others n x that
    send = acoll.empty_shared(n * c, np.float64)
    recv = acoll.empty_shared(n * c, np.float64)
    await comm.register(send)
    await comm.register(recv)
    bad = 0
    for i in range(60):
        kind, root = i % 3, (i // 3) % n
        if kind == 0:  # (in place every other time: send is this rank's block of recv)
            mine = recv[r * c:(r + 1) * c] if i % 2 else send[:c]
            mine[:] = r + i
            await comm.all_gather(mine, recv)
            bad += int(np.count_nonzero(recv != np.repeat(np.arange(n) + i, c)))
            mine[:] = -1
        elif kind == 1:  # (in place every other time: recv is this rank's block of send)
            send[:] = np.repeat(np.arange(n) * 10 + r + i, c)
            out = send[r * c:(r + 1) * c] if i % 2 else recv[:c]
            await comm.reduce_scatter(send, out)
            bad += int(np.count_nonzero(out != sum(r * 10 + q + i for q in range(n))))
            send[:] = -1
        else:
            buf = recv[:c]
            buf[:] = r + i
            await comm.broadcast(buf, root)
            bad += int(np.count_nonzero(buf != root + i))
            buf[:] = -1
        if r == i % n and i % 5 == 0:
            await asyncio.sleep(0.002)
    return {"bad": bad, "by": ZERO_COPY_BY}


async def reg_mixed(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0's buffers are registered, the others' are not (after registering a shared
    allocation they do not use): every rank runs the plain plan, with right results."""
    n, r = comm.size, comm.rank
    arena = await _registered(comm, 8 << 20)
    count = (1 << 18) + 3
    x = arena.take(np.full(count, r + 1, np.float32)) if r == 0 else np.full(count, r + 1,
                                                                             np.float32)
    for _ in range(3):
        x[:] = r + 1
        await comm.all_reduce(x)
        assert np.all(x == n * (n + 1) / 2), x[:4]
    return {"zc_calls": RUNS["zc_calls"], "zero_copy": RUNS["zero_copy"]}


async def reg_refused(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 registers a plain NumPy array: nobody registers anything."""
    buf = np.zeros(1 << 20, np.uint8) if comm.rank == 1 else acoll.empty_shared(1 << 20,
                                                                                np.uint8)
    reg = await comm.register(buf)
    x = np.ones(1 << 18, np.float32)
    await comm.all_reduce(x)
    return {"index": reg.index, "zc_calls": RUNS["zc_calls"], "ok": bool(np.all(x == comm.size))}


async def reg_dereg(comm: acoll.Communicator) -> dict[str, Any]:
    """Zero-copy until deregistered, then the plain plan; the same array throughout."""
    n, r = comm.size, comm.rank
    x = acoll.empty_shared((1 << 19) + 1, np.float32)
    reg = await comm.register(x)
    x[:] = r + 1
    await comm.all_reduce(x)
    before = RUNS["zero_copy"]
    await comm.deregister(reg)
    x[:] = r + 1
    await comm.all_reduce(x)
    assert np.all(x == n * (n + 1) / 2), x[:4]
    again = await comm.register(x[1:])  # a sub-array registers its whole allocation
    x[:] = r + 2
    await comm.all_reduce(x)
    assert np.all(x == n * (n + 3) / 2), x[:4]
    return {"before": before, "after": RUNS["zero_copy"], "index": again.index}


async def reg_group(comm: acoll.Communicator) -> dict[str, Any]:
    """Zero-copy all_reduces in a group and as concurrent tasks, mixed with lane ops in
    steps and one-slot ops (they take the lane's turn one after the other)."""
    n, r = comm.size, comm.rank
    arena = await _registered(comm, 32 << 20)
    big = [arena.take(np.full(300_001 + k, r + k, np.float32)) for k in range(2)]
    small = np.full(3, r, np.int64)
    gathered = np.zeros(n * 300_000, np.int32)
    async with comm.group():
        await comm.all_reduce(big[0])
        await comm.all_reduce(small)
        await comm.all_reduce(big[1])
        await comm.all_gather(np.full(300_000, r, np.int32), gathered)
    for k in range(2):
        assert np.all(big[k] == sum(q + k for q in range(n))), (k, big[k][:4])
    assert list(small) == [n * (n - 1) // 2] * 3, small
    assert np.array_equal(gathered, np.repeat(np.arange(n, dtype=np.int32), 300_000))
    xs = [arena.take(np.full(200_000 + k, r * 10 + k, np.float64)) for k in range(3)]
    await asyncio.gather(*(comm.all_reduce(x) for x in xs), comm.all_reduce(small))
    for k, x in enumerate(xs):
        assert np.all(x == sum(q * 10 + k for q in range(n))), (k, x[:4])
    return {"zero_copy": RUNS["zero_copy"]}


async def reg_mismatch_count(comm: acoll.Communicator) -> dict[str, Any]:
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        await comm.all_reduce(arena.take(np.ones((1 << 18) + (comm.rank == 0), np.float32)))

    return await _outcome(call())  # (a rank still registering may get the error there)


async def reg_mismatch_plain(comm: acoll.Communicator) -> dict[str, Any]:
    """Every rank registered an allocation; rank 0 all_reduces a plain NumPy array one
    element longer than the others' registered buffers (rank 0 falls back at once, without
    reading its peers' call records: it must still name the difference)."""
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        if comm.rank == 0:
            await comm.all_reduce(np.ones((1 << 18) + 1, np.float32))
        else:
            await comm.all_reduce(arena.take(np.ones(1 << 18, np.float32)))

    return await _outcome(call())


async def reg_late_reader(comm: acoll.Communicator) -> dict[str, Any]:
    """Every rank registered an allocation. Rank 0 all_reduces a plain array and, as the
    next lane op (in one group), a registered one; the others come to the first 0.5 s
    late, on registered buffers: they must still find rank 0's call record of the
    first op, which its second op's record must not have replaced."""
    arena = await _registered(comm, 8 << 20)
    r, n = comm.rank, comm.size
    first = np.full(1 << 18, r + 1, np.float32)
    if r:
        first = arena.take(first)
        await asyncio.sleep(0.5)  # (rank 0 starts both calls meanwhile)
    second = arena.take(np.full(1 << 18, 10 * (r + 1), np.float32))

    async def both() -> None:
        async with comm.group():
            await comm.all_reduce(first)
            await comm.all_reduce(second)

    outcome = await _outcome(both())
    if outcome["error"]:
        return outcome
    total = n * (n + 1) // 2
    assert np.all(first == total), first[:4]
    assert np.all(second == 10 * total), second[:4]
    return {"zero_copy": RUNS["zero_copy"]}


async def reg_mismatch_kind(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0 all_reduces a registered buffer; the others broadcast one as large."""
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        x = arena.take(np.ones(1 << 18, np.float32))
        await (comm.all_reduce(x) if comm.rank == 0 else comm.broadcast(x))

    return await _outcome(call())


async def reg_mismatch_small(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0 all_reduces a registered buffer (zero-copy size); the others a few
    elements (one mailbox slot, no call record)."""
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        await comm.all_reduce(arena.take(np.ones(1 << 18 if comm.rank == 0 else 4,
                                                 np.float32)))

    return await _outcome(call())


async def reg_mismatch_root(comm: acoll.Communicator) -> dict[str, Any]:
    """Registered broadcasts whose roots differ (rank 0 says 0, the others 1)."""
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        await comm.broadcast(arena.take(np.ones(1 << 18, np.float32)),
                             0 if comm.rank == 0 else 1)

    return await _outcome(call())


async def reg_mismatch_gather(comm: acoll.Communicator) -> dict[str, Any]:
    """Registered all_gathers whose sizes straddle ZERO_COPY_MIN (rank 0's receive buffer
    is over it, the others' under it)."""
    async def call() -> None:
        arena = await _registered(comm, 8 << 20)
        block = (1 << 18) // comm.size if comm.rank == 0 else 16 << 10
        recv = arena.take(np.zeros(block * comm.size, np.float32))
        await comm.all_gather(arena.take(np.ones(block, np.float32)), recv)

    return await _outcome(call())


async def reg_killed(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1 is SIGKILLed while every rank runs zero-copy all_reduces of 16 MiB."""
    arena = await _registered(comm, 20 << 20)
    x = arena.take(np.ones(1 << 22, np.float32))
    await comm.all_reduce(x)
    if comm.rank == 1:
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGKILL)

    async def forever() -> None:
        while True:
            await comm.all_reduce(x)

    return {**await _outcome(forever()), "zero_copy": RUNS["zero_copy"]}


async def reg_stalled(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1's loop stalls for 6 s between its two phases of a zero-copy all_reduce
    (deadline 3 s); REG_STALL_AT=combine: before it says it finished the first."""
    arena = await _registered(comm, 8 << 20)
    x = arena.take(np.ones(1 << 20, np.float32))
    await comm.all_reduce(x)
    if comm.rank == 1 and os.environ.get("REG_STALL_AT") == "combine":
        combine = lane_mod.ZeroCopyAllReduce._combine

        async def stalling_combine(self: Any, *args: Any) -> None:
            await combine(self, *args)  # (then stalls before it publishes phase 1)
            time.sleep(6)  # noqa: ASYNC251 - stalling the loop is the point

        lane_mod.ZeroCopyAllReduce._combine = stalling_combine  # type: ignore[method-assign]
    elif comm.rank == 1:
        reached = lane_mod.ZeroCopyAllReduce._reached

        async def stalling(self: Any, seq: int, ctx: Any, step: int,
                           peers: list[int]) -> list[int]:
            if step == 1:  # (it published phase 1; phase 2 waits for the peers' first)
                time.sleep(6)  # noqa: ASYNC251 - stalling the loop is the point
            return await reached(self, seq, ctx, step, peers)

        lane_mod.ZeroCopyAllReduce._reached = stalling  # type: ignore[method-assign]
    return await _outcome(comm.all_reduce(x))


async def reg_left_early(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 1's loop stalls 5 s (deadline 3 s) between two pieces of phase 2 of a
    zero-copy all_reduce, while it copies rank 0's part out of rank 0's buffer; rank 0
    times out in the last phase and refills its buffer at once. Rank 1 must raise, not
    return a result that mixes rank 0's new bytes in (REG_CANCEL=1: rank 0's call is
    cancelled instead)."""
    r = comm.rank
    x = acoll.empty_shared(1 << 22, np.float32)  # 16 MiB: 2 MiB parts, several pieces
    await comm.register(x)
    x[:] = 1
    await comm.all_reduce(x)
    if r == 1:
        real = lane_mod.paced
        stalled = [False]

        async def stalling(pace: Any, key: Any, *args: Any) -> None:
            async def pace_then_stall() -> None:
                if key[0] == "copy" and not stalled[0]:
                    stalled[0] = True
                    time.sleep(5)  # noqa: ASYNC251 - stalling the loop is the point
                await pace()

            await real(pace_then_stall, key, *args)

        lane_mod.paced = stalling
    x[:] = 1
    if r == 0 and os.environ.get("REG_CANCEL"):
        task = asyncio.ensure_future(comm.all_reduce(x))
        await asyncio.sleep(1.0)
        task.cancel()
        try:
            out = await _outcome(task)
        except asyncio.CancelledError:
            out = {"error": "CancelledError"}
    else:
        out = await _outcome(comm.all_reduce(x))
    if r == 0:
        x[:] = 1000  # (the call failed: the buffer is the caller's again)
        await asyncio.sleep(6)
        return out
    values = sorted({float(v) for v in np.unique(x)})
    return {**out, "values": values}


async def reg_aborted_under(comm: acoll.Communicator) -> dict[str, Any]:
    """Rank 0's zero-copy all_reduce runs in a task; rank 0 aborts the communicator from
    another task while rank 1 is about to copy its last piece of rank 0's part, refills
    its buffer and blocks its loop (so the op's own task cannot react). Rank 1 must not
    return a result with rank 0's new bytes in it."""
    r = comm.rank
    x = acoll.empty_shared(1 << 22, np.float32)
    await comm.register(x)
    x[:] = 1
    await comm.all_reduce(x)
    if r == 1:
        real = lane_mod.paced

        async def stalling(pace: Any, key: Any, n: int, itemsize: int, work: Any) -> None:
            if key[0] != "copy":
                await real(pace, key, n, itemsize, work)
                return
            work(0, n - 1)
            time.sleep(4)  # noqa: ASYNC251 - stalling the loop is the point
            work(n - 1, n)  # (no pace: nothing lets this rank hear of the abort first)

        lane_mod.paced = stalling
    x[:] = 1
    if r == 0:
        task = asyncio.ensure_future(comm.all_reduce(x))
        await asyncio.sleep(1.0)  # (in the last phase's wait by now)
        comm.abort()
        x[:] = 1000  # (the communicator is gone: the buffer is the caller's again)
        time.sleep(6)  # noqa: ASYNC251 - the op's task must not run before rank 1 reads
        out = await _outcome(task)
        return out
    out = await _outcome(comm.all_reduce(x))
    return {**out, "values": sorted({float(v) for v in np.unique(x)})}


async def reg_dereg_alone(comm: acoll.Communicator) -> dict[str, Any]:
    """Every rank registers x then y; rank REG_ALONE alone deregisters x (against the
    contract): its buffer is no longer registered there, so every rank runs the plain
    plan, whichever rank it is."""
    x = acoll.empty_shared((1 << 18) + 5, np.float32)
    y = acoll.empty_shared((1 << 18) + 5, np.float32)
    rx = await comm.register(x)
    await comm.register(y)
    if comm.rank == int(os.environ["REG_ALONE"]):
        await comm.deregister(rx)
    x[:] = 1
    before = RUNS["zero_copy"]
    out = await _outcome(comm.all_reduce(x))
    return {**out, "ok": bool(np.all(x == comm.size)), "zero_copy": RUNS["zero_copy"] - before}


async def reg_lag_f16(comm: acoll.Communicator) -> dict[str, Any]:
    """The loop's worst lag while float16 buffers (a slow ufunc) are all_reduced."""
    arena = await _registered(comm, 18 << 20)
    x = arena.take(np.zeros(8 << 20, np.float16))
    await comm.all_reduce(x)
    async with _LoopLag() as lag:
        for _ in range(2):
            await comm.all_reduce(x)
    return {"ticks": len(lag.lags), "worst_busy_lag": max(lag.busy),
            "zero_copy": RUNS["zero_copy"]}


async def reg_lag(comm: acoll.Communicator) -> dict[str, Any]:
    """The loop's worst lag while 64 MiB registered buffers are all_reduced in place."""
    arena = await _registered(comm, 66 << 20)
    x = arena.take(np.zeros(16 << 20, np.float32))
    await comm.all_reduce(x)
    ops = 0
    async with _LoopLag() as lag:
        t0 = time.perf_counter()
        while True:  # at least 3 ops and 0.25 s, as rank 0 counts them
            more = np.array([ops < 3 or time.perf_counter() - t0 < 0.25], np.int32)
            await comm.broadcast(more)
            if not more[0]:
                break
            await comm.all_reduce(x)
            ops += 1
    return {"ticks": len(lag.lags), "worst_lag": max(lag.lags),
            "worst_busy_lag": max(lag.busy), "ops": ops, "zero_copy": RUNS["zero_copy"]}


async def main() -> None:
    scenario, uid, rank, n = sys.argv[1], bytes.fromhex(sys.argv[2]), *map(int, sys.argv[3:5])
    timeout_s = 3.0 if scenario in ("timeout", "silent_group", "stalled_in_steps",
                                    "skipped_in_steps", "reg_stalled",
                                    "reg_left_early") else 60.0
    try:
        # (formed with a long deadline, then the scenario's own: 2 to 4 interpreters
        # starting on a slow machine can take longer than the scenario's 3 s to form)
        comm = await acoll.init_rank(n, uid, rank, timeout=60.0)
        comm.timeout = timeout_s
    except acoll.AcollError as exc:  # a peer that formed first failed already (on purpose)
        print("RESULT " + json.dumps({"error": type(exc).__name__, "message": str(exc),
                                      "after": 0.0, "in_init": True}), flush=True)
        return
    result = await globals()[scenario](comm)
    if scenario in ("after_close", "close_inflight"):  # (closed already)
        result.update(lane=1, lane_runs=RUNS["lane"], transports=[])
        print("RESULT " + json.dumps(result), flush=True)
        return
    result["lane"] = comm._lane.limit if comm._lane is not None else 0
    result["lane_runs"] = RUNS["lane"]
    result["step_runs"] = RUNS["steps"]
    result["boards"] = comm._lane is not None and comm._lane.boards is not None
    result["transports"] = [comm.transport_name(p) for p in range(n)]
    print("RESULT " + json.dumps(result), flush=True)
    if comm.error is None:
        await comm.close()
    else:
        comm.abort()


if __name__ == "__main__":
    if os.environ.get("LANE_LOOP") == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main(), debug=os.environ.get("LANE_LOOP") == "debug")
