"""acoll's real CUDA space and staging (:mod:`acoll._memory.cuda`) run on a CPU, over a
stand-in for CuPy (``tests/fake_cupy.py``): the collective matrix over TCP, two ranks of
one process on two "devices" (every copy and kernel enqueued under the device that owns
the memory), and ``stream=`` ordering bookkeeping. What needs a real GPU (asynchrony,
the kernels themselves, DLPack of CUDA tensors) is in tests/test_gpu.py."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
from typing import Any

import numpy as np
import pytest

import acoll
import fake_cupy
from acoll._dtypes import BFLOAT16
from acoll.testing import run_ranks
from collective_cases import ALL_OPS, check_all

# (int32: an integer AVG divides the sum; the floats scale their inputs)
DTYPES = [np.dtype(np.int8), BFLOAT16, np.dtype(np.float32), np.dtype(np.int32)]


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    from acoll._memory import cuda as cuda_mod

    mod = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(cuda_mod, "launch_reduce", fake_cupy.launch_reduce)
    monkeypatch.setattr(cuda_mod, "launch_finish_avg", fake_cupy.launch_finish_avg)
    monkeypatch.setattr(cuda_mod, "launch_scale", fake_cupy.launch_scale)
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    fake_cupy.enqueued.clear()
    return mod


def _dev(device: int) -> Any:
    return lambda arr: fake_cupy.ndarray(np.array(arr), device)


def _host(buf: Any) -> np.ndarray[Any, Any]:
    return buf.get()  # type: ignore[no-any-return]


async def test_matrix_over_tcp_with_the_cuda_space(cupy: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from acoll._memory.cuda import CudaSpace, CudaStaging
    from acoll._transport.staged import StagedConnection

    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "16K")

    async def fn(comm: acoll.Communicator) -> int:
        assert isinstance(comm.mem, CudaSpace)
        assert comm.device == 0
        n = await check_all(comm, [0, 1, 7, 1000, 30001], DTYPES, ALL_OPS, dev=_dev(0),
                            host=_host)
        conn = await comm.connection(1 - comm.rank)
        assert isinstance(conn, StagedConnection)
        assert isinstance(conn.staging, CudaStaging)
        assert conn.staged_sends > 0
        return n

    results = await run_ranks(2, fn, device=0)
    assert results[0] == results[1] > 0
    kinds = {what for what, _ in fake_cupy.enqueued}
    assert {"memcpy", "reduce", "finish_avg", "scale", "record", "wait_event"} <= kinds


async def test_two_devices_in_one_process(cupy: Any) -> None:
    """Each rank's work is enqueued under its own device (the fake asserts it on every
    copy and kernel), while the other rank's work interleaves on the same thread."""
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=r, ifname="=lo")
                                   for r in range(2)))
    try:
        assert [c.device for c in comms] == [0, 1]
        xs = [fake_cupy.ndarray(np.full(100_003, c.rank + 1.0, np.float32), c.rank)
              for c in comms]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        for x in xs:
            assert (x.get() == 3).all()

        async def exchange(c: acoll.Communicator, x: Any) -> Any:
            got = fake_cupy.ndarray(np.zeros(100_003, np.float32), c.rank)
            async with c.group():
                await c.send(x, 1 - c.rank)
                await c.recv(got, 1 - c.rank)
            return got

        gots = await asyncio.gather(*(exchange(c, x) for c, x in zip(comms, xs, strict=True)))
        assert all((g.get() == 3).all() for g in gots)
        # small calls (copies on each caller's default stream, handle 0): the stream is
        # polled with its rank's device current, since handle 0 means the current device's
        small = [fake_cupy.ndarray(np.full(10, c.rank + 1.0, np.float32), c.rank)
                 for c in comms]
        fake_cupy.stream_queries.clear()
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, small, strict=True)))
        assert all((x.get() == 3).all() for x in small)
        default = [q for q in fake_cupy.stream_queries if q[0] == 0]
        assert {q[1] for q in default} == {0, 1}
        assert all(dev == current for _, dev, current in default), default
        with pytest.raises(acoll.InvalidUsage, match="buf is on cuda:1"):
            await comms[0].broadcast(xs[1])
    except BaseException:
        for c in comms:
            c.abort()
        raise
    for c in comms:
        c.abort()


async def test_stream_argument_orders_on_the_callers_stream(cupy: Any) -> None:
    """Ordered calls (here the first of its size, whose page-locked block is allocated off
    the loop) start after the caller's stream's queued work and publish their result to
    it through events; an all_reduce made while nothing else runs puts its copies on the
    caller's stream (small ones, and larger ones once the pool holds a block)."""
    async def fn(comm: acoll.Communicator) -> None:
        user = cupy.cuda.Stream(non_blocking=True)
        x = fake_cupy.ndarray(np.ones(300_000, np.float32), 0)
        await comm.all_reduce(x, stream=user)
        assert len(user.waits) == 1  # later work on the caller's stream waits for ours
        assert user.waits[0].recorded_on is comm.mem.stream  # type: ignore[attr-defined]
        copies = len(fake_cupy.copies_on)
        await comm.all_reduce(x, stream=user)  # the block is pooled now: direct
        assert len(user.waits) == 1
        assert fake_cupy.copies_on[copies:].count(user.ptr) >= 2  # input down, result up
        await comm.all_reduce(x, stream=user.ptr)  # a raw handle
        torch_like = type("S", (), {"cuda_stream": user.ptr})()
        await comm.all_reduce(x, stream=torch_like)
        assert (x.get() == 16).all()
        null = cupy.cuda.get_current_stream()
        before = len(null.waits)
        await comm.all_reduce(x)  # no stream=: after CuPy's current stream's work...
        # ...and the await returned once the op's work was done: nothing is left for that
        # stream to wait for (the other rank of this loop shares it: count only our waits)
        mine = [e for e in null.waits[before:] if e.recorded_on is comm.mem.stream]  # type: ignore[attr-defined]
        assert mine == []
        assert (x.get() == 32).all()
        small = fake_cupy.ndarray(np.ones(1000, np.float32), 0)
        waits, copies = len(user.waits), len(fake_cupy.copies_on)
        await comm.all_reduce(small, stream=user)
        assert len(user.waits) == waits  # no event between streams...
        assert user.ptr in fake_cupy.copies_on[copies:]  # ...the copies are on it
        assert (small.get() == 2).all()

    await run_ranks(2, fn, device=0)


async def test_small_calls_on_two_streams_keep_the_copy_block_ordered(cupy: Any) -> None:
    """A small all_reduce with ``stream=B`` right after one with ``stream=A`` whose upload
    may still read the call's page-locked block: B's download waits for an event acoll
    recorded on A (its own, so A may be gone by then); once that upload is done, or after
    a call that waited for its upload, nothing is waited for."""
    async def fn(comm: acoll.Communicator) -> None:
        a = cupy.cuda.Stream(non_blocking=True)
        b = cupy.cuda.Stream(non_blocking=True)
        x = fake_cupy.ndarray(np.ones(100, np.float32), 0)
        await comm.all_reduce(x, stream=a)
        a.busy = True  # its upload "still running"
        await comm.all_reduce(x, stream=b)
        assert [e.recorded_on for e in b.waits] == [a]
        a.busy = False
        await comm.all_reduce(x, stream=a)  # B's upload is done: nothing to wait for
        assert a.waits == []
        b.busy = True
        await comm.all_reduce(x)  # no stream=: waits for its own upload...
        b.busy = False
        await comm.all_reduce(x, stream=b)  # ...so the next call waits for nothing
        assert len(b.waits) == 1
        assert (x.get() == 32).all()

    await run_ranks(2, fn, device=0)


async def test_stream_argument_of_the_wrong_kind_is_named(cupy: Any) -> None:
    async def fn(comm: acoll.Communicator) -> None:
        x = fake_cupy.ndarray(np.ones(10, np.float32), 0)
        with pytest.raises(acoll.InvalidUsage, match="stream= must be"):
            await comm.all_reduce(x, stream="s")

    await run_ranks(1, fn, device=0)


async def test_device_out_of_range(cupy: Any) -> None:
    uid = acoll.get_unique_id(ifname="=lo")
    with pytest.raises(acoll.InvalidUsage, match=r"device must be a CUDA device in \[0, 2\)"):
        await acoll.init_rank(1, uid, 0, device=2, ifname="=lo")


@pytest.mark.parametrize("n", [1000, 100_000])
async def test_a_call_made_while_another_waits_its_turn_goes_after_it(cupy: Any,
                                                                       n: int) -> None:
    """Found by review: when an op ends, a call queued behind it is woken but has not run
    yet; a call made in that window must not take the direct path (which reads its input
    at the call, before the queued op wrote it)."""
    async def fn(comm: acoll.Communicator) -> float:
        s = cupy.cuda.Stream(non_blocking=True)
        x = fake_cupy.ndarray(np.ones(n, np.float32), 0)

        async def user() -> None:
            await comm.all_reduce(x, stream=s)  # op 1: direct, runs at once
            await comm.all_reduce(x, stream=s)  # op 3: made as op 1 ends, op 2 queued

        first = asyncio.ensure_future(user())
        await asyncio.sleep(0)  # op 1 runs
        second = asyncio.ensure_future(comm.all_reduce(x, stream=s))  # op 2 waits
        await asyncio.gather(first, second)
        return float(x.get()[0])

    assert await run_ranks(2, fn, device=0) == [8.0, 8.0]  # 1 -> 2 -> 4 -> 8


class _StreamTrace:
    """What the CuPy stand-in was asked to queue, in program order, as a happens-before
    graph (the stand-in runs copies at once, so an ordering bug never shows in the data):
    each copy, event record and event wait is a node after the previous node of its
    stream; a wait also comes after the record of its event that it captured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.preds: list[list[int]] = []
        self.copies: list[tuple[int, int, int, int, int]] = []  # (node, kind, dst, src, size)
        last: dict[Any, int] = {}
        recorded: dict[int, int] = {}  # id(event) -> node of its latest record

        def key(ptr: int) -> Any:
            return ptr if ptr else (0, fake_cupy._current[0])  # (0: the current device's)

        def node(stream_key: Any, after: int | None = None) -> int:
            i = len(self.preds)
            self.preds.append([p for p in (last.get(stream_key), after) if p is not None])
            last[stream_key] = i
            return i

        real_copy = fake_cupy._Runtime.memcpyAsync
        real_wait, real_record = fake_cupy.Stream.wait_event, fake_cupy.Event.record

        def memcpy(dst: int, src: int, size: int, kind: int, stream: int) -> None:
            self.copies.append((node(key(stream)), kind, dst, src, size))
            real_copy(dst, src, size, kind, stream)

        def wait_event(stream: Any, event: Any) -> None:
            node(key(stream.ptr), recorded.get(id(event)))
            real_wait(stream, event)

        def record(event: Any, stream: Any = None) -> None:
            on = stream if stream is not None else fake_cupy.get_current_stream()
            recorded[id(event)] = node(key(on.ptr))
            real_record(event, stream)

        monkeypatch.setattr(fake_cupy._Runtime, "memcpyAsync", staticmethod(memcpy))
        monkeypatch.setattr(fake_cupy.Stream, "wait_event", wait_event)
        monkeypatch.setattr(fake_cupy.Event, "record", record)

    def before(self, a: int, b: int) -> bool:
        """Whether node ``a`` happens before node ``b`` on the device."""
        seen, todo = set(), [b]
        while todo:
            for p in self.preds[todo.pop()]:
                if p == a:
                    return True
                if p not in seen and p > a:  # (predecessors come earlier in program order)
                    seen.add(p)
                    todo.append(p)
        return False

    def unordered(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        """(upload, download) node pairs of device bytes ``ptr`` to ``ptr + nbytes``:
        uploads into them queued before a download from them that need not have landed
        when the download reads (a later call on the stream reading an older value)."""
        def hits(at: int, size: int) -> bool:
            return at < ptr + nbytes and ptr < at + size

        ups = [(n, d, z) for n, kind, d, _, z in self.copies if kind == 1 and hits(d, z)]
        downs = [(n, s, z) for n, kind, _, s, z in self.copies if kind == 2 and hits(s, z)]
        return [(u, d) for u, ua, uz in ups for d, da, dz in downs
                if u < d and ua < da + dz and da < ua + uz and not self.before(u, d)]


@pytest.mark.parametrize("n", [1000, 100_000, 400_000])
async def test_a_call_queued_behind_a_direct_one_reads_its_result(
        cupy: Any, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Found by review: a direct call with ``stream=`` uploads its result on that stream
    when its ring ends; a call on the same stream made meanwhile is queued and ordered
    after the stream's work at its call, before that upload: its download must still wait
    for the upload (on a GPU the two copies are on different streams)."""
    trace = _StreamTrace(monkeypatch)

    async def fn(comm: acoll.Communicator) -> tuple[bool, float, int, int]:
        s = cupy.cuda.Stream(non_blocking=True)
        x = fake_cupy.ndarray(np.ones(n, np.float32), 0)
        if comm.rank == 1:  # rank 0's direct call waits for this rank's meanwhile (a small
            await asyncio.sleep(0.05)  # one could end within the loop pass it began in)
        first = asyncio.ensure_future(comm.all_reduce(x, stream=s))  # direct
        await asyncio.sleep(0)
        queued = not comm._exec.idle
        second = asyncio.ensure_future(comm.all_reduce(x, stream=s))  # queued: ordered
        then = comm.broadcast(x, root=1, stream=s)  # queued too (no direct path)
        await asyncio.gather(first, second, then)
        return queued, float(x.get()[0]), x.data.ptr, 4 * n

    got = await run_ranks(2, fn, device=0, together=True)
    assert got[0][0], "rank 0's second call was not queued behind its first"
    assert [v for _, v, _, _ in got] == [4.0, 4.0]
    for _, _, ptr, nbytes in got:
        assert trace.unordered(ptr, nbytes) == []


async def test_a_pending_fence_does_not_hold_back_other_pooled_blocks(cupy: Any) -> None:
    """Found by review: blocks come back fenced on different streams (callers'); one
    whose upload is still pending on a busy stream must not make every later call of its
    size page-lock a new block."""
    async def fn(comm: acoll.Communicator) -> list[int]:
        staging = comm.mem.staging()
        busy = cupy.cuda.Stream(non_blocking=True)
        x = fake_cupy.ndarray(np.ones(300_000, np.float32), 0)  # a 2 MiB block
        await comm.all_reduce(x)  # ordered: the pool allocates the block
        await comm.all_reduce(x, stream=busy)  # direct: back fenced on `busy`
        busy.busy = True  # (its upload has not run yet)
        pooled = []
        for _ in range(4):
            await comm.all_reduce(x)
            pooled.append(sum(len(q) for q in staging._free.values()))
        busy.busy = False
        return pooled

    for pooled in await run_ranks(2, fn, device=0):
        assert pooled == [2, 2, 2, 2]  # the pending one and one reused, no more


class _MemOps:
    """A stand-in for the driver's stream memory operations: writes land at once, waits
    are only recorded (fake copies are synchronous); both join fake_cupy's log."""

    def __init__(self, works: bool = True) -> None:
        self.works = works

    def write(self, stream: int, addr: int, value: int) -> None:
        fake_cupy.enqueued.append(("write", stream, addr, value))
        if self.works:
            ctypes.c_uint32.from_address(addr).value = value

    def wait(self, stream: int, addr: int, value: int) -> None:
        fake_cupy.enqueued.append(("wait", stream, addr, value))

    def device_pointer(self, host_ptr: int) -> int:
        return host_ptr


async def test_copy_counters_and_piecewise_copies_on_the_callers_stream(
        cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaStaging's copy counters: one pair per pooled block, kept with it; downloads
    piece by piece on the caller's stream, each followed by a write of the ready
    counter's next value; uploads each after a wait for the final counter's, on a stream
    of the staging's own ordered after the caller's work, and the caller's stream joined
    after them; a release lets every upload through."""
    from acoll._memory import cuda as cuda_mod

    monkeypatch.setattr(cuda_mod, "_MEM_OPS", [_MemOps()])
    space = cuda_mod.CudaSpace(0)
    staging = space.staging()
    view, block = staging.lease(1 << 16)
    sig = staging.signals(block)
    assert sig is not None
    assert staging.signals(block) is sig
    other = staging.signals(staging.lease(1 << 16)[1])
    assert other is not None
    assert other.ready_addr != sig.ready_addr
    sig.words[sig.READY] = 0xFFFFFFFF  # (values wrap)
    sig.begin(2)
    src = space.adopt(fake_cupy.ndarray(np.arange(16384, dtype=np.float32)), "x")
    out = fake_cupy.ndarray(np.zeros(16384, np.float32))
    dst = space.adopt(out, "y", writable=True)
    stream = space.resolve_stream(None)
    fake_cupy.enqueued.clear()
    staging.download_pieces_on(stream, view, src, [(0, 4096), (4096, 65536)], sig)
    ready = sig.device_ptr + 4 * sig.READY
    assert fake_cupy.enqueued[:4] == [("memcpy", 0), ("write", stream.ptr, ready, 0),
                                      ("memcpy", 0), ("write", stream.ptr, ready, 1)]
    assert view.array.view(np.float32).tolist() == list(range(16384))
    fake_cupy.enqueued.clear()
    fence = staging.upload_pieces_on(stream, dst, view, [(0, 8), (8, 65536)], sig)
    final = sig.device_ptr + 4 * sig.FINAL
    side = staging._side
    assert side is not None
    assert side.ptr != stream.ptr  # (never the caller's stream: see upload_pieces_on)
    assert fake_cupy.enqueued == [("record", 0), ("wait_event", 0),  # (after the caller's)
                                  ("wait", side.ptr, final, sig.final_value(0)),
                                  ("memcpy", 0),
                                  ("wait", side.ptr, final, sig.final_value(1)),
                                  ("memcpy", 0), ("record", 0)]
    assert out.get().tolist() == list(range(16384))
    fake_cupy.enqueued.clear()
    staging.join_on(stream, fence)
    assert fake_cupy.enqueued == [("wait_event", 0)]
    assert stream.waits[-1] is fence.event  # type: ignore[attr-defined]
    sig.release()
    assert int(sig.words[sig.FINAL]) == sig.final_value(1)


async def test_copy_counters_absent_or_broken_mean_whole_copies(
        cupy: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Without the driver's stream memory operations, or where a value the device writes
    does not arrive (checked once per staging), blocks get no counters: the native ring's
    copies then go whole. Logged at INFO."""
    from acoll._memory import cuda as cuda_mod

    caplog.set_level(logging.INFO, logger="acoll")
    for ops in (None, _MemOps(works=False)):
        monkeypatch.setattr(cuda_mod, "_MEM_OPS", [ops])
        staging = cuda_mod.CudaSpace(0).staging()
        block = staging.lease(1 << 16)[1]
        assert staging.signals(block) is None
        assert staging.signals(block) is None
    assert "did not arrive" in caplog.text


def test_fences_dropped_in_a_reference_cycle_never_pool_a_destroyed_event(
        cupy: Any) -> None:
    """A fence that dies in a reference cycle goes when the cyclic collector runs, which
    finalizes everything only garbage reaches: CuPy's events are destroyed in __del__,
    so an event reached only through such a fence would be destroyed before the fence's
    __del__ gave it back to the pool, and the next take would hand out a dead event (the
    copy counters' crash on an H100, session 46). The space holds a live fence's event."""
    import gc

    from acoll._memory.cuda import CudaSpace, _EventFence

    space = CudaSpace(0)

    class Holder:
        """A garbage cycle holding fences (as a finished call's objects once were)."""

    gc.collect()
    gc.disable()  # (the cycle goes at the collect below, not earlier)
    try:
        holder = Holder()
        holder.me = holder  # type: ignore[attr-defined]
        holder.fences = [_EventFence(space, space.take_event())  # type: ignore[attr-defined]
                         for _ in range(8)]
        del holder
        assert gc.collect() > 0
    finally:
        gc.enable()
    assert len(space._events) == 8
    for _ in range(8):
        event = space.take_event()
        event.record(space.stream)  # (raises on a destroyed event)
        assert event.done
    assert not space.fenced  # (the fences are gone: the space holds none of their events)


async def test_a_direct_call_on_the_native_ring_leaves_no_reference_cycle(
        cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A larger device all_reduce on the native ring with copy counters (whose hook the
    ring calls once its C call is on its way) leaves nothing for the cyclic collector:
    its fences go back to the pool when the call returns, not whenever the collector
    runs (see the test above for what that cost)."""
    import gc

    from acoll import _native
    from acoll._memory import cuda as cuda_mod

    if await _native.load_async() is None:
        pytest.skip("no C compiler: the native ring cannot be built here")
    from acoll._comm import via_host

    monkeypatch.setattr(cuda_mod, "_MEM_OPS", [_MemOps()])
    monkeypatch.setattr(via_host, "NATIVE_PIPELINE_MIN", 256 << 10)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_COUNTERS", "down")
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=0, ifname="=lo")
                                   for r in range(2)))
    try:
        assert all(c._native is not None for c in comms)
        xs = [fake_cupy.ndarray(np.full(1 << 18, c.rank + 1.0, np.float32), 0)
              for c in comms]
        for _ in range(2):  # (the first call allocates the pooled block)
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        staged = sum(len(c.mem.staging()._signals) for c in comms)
        assert staged == 2  # (the calls ran with counters)
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                await asyncio.gather(*(c.all_reduce(x)
                                       for c, x in zip(comms, xs, strict=True)))
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = sorted({type(o).__name__ for o in gc.garbage
                           if type(o).__module__.startswith("acoll")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert left == [], left
        assert all((x.get() == 3 * 2 ** 4).all() for x in xs)
    finally:
        for c in comms:
            c.abort()
