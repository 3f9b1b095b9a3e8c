"""Device buffers over host-memory transports (:mod:`acoll._transport.staged`), on a CPU.

A fake device space (``tests/fake_device.py``: host memory that acoll must treat as
device memory, whose downloads land a few loop iterations late) drives the same staging
code as CUDA: the whole collective matrix over TCP gives exact results, TCP only ever sees
host buffers, and the staged connection keeps the transport contract (the conformance
battery, with every message staged).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import acoll
from acoll import _communicator
from acoll._comm import via_host as via_host_mod
from acoll._dtypes import BFLOAT16
from acoll._memory import Buffer, MemoryKind, host_buffer
from acoll._transport.base import Connection, ConnectionLost, Listener, Transport
from acoll._transport.shm import ShmConnection, ShmTransport
from acoll._transport.staged import StagedConnection
from acoll._transport.tcp import TcpConnection, TcpTransport
from acoll.testing import run_ranks
from collective_cases import ALL_OPS, assert_result, check_all, reference
from fake_device import FakeDevArray, FakeDeviceSpace, FakeStaging, to_dev, to_host
from transport_conformance import TransportConformance, TransportHarness

KEY = bytes(range(32))
DTYPES = [np.dtype(np.int8), np.dtype(np.float16), BFLOAT16, np.dtype(np.float32),
          np.dtype(np.int64)]
COUNTS = [0, 1, 7, 1000, 100003]


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch) -> list[FakeDeviceSpace]:
    """``init_rank(device=k)`` makes a fake device space; returns every space made."""
    made: list[FakeDeviceSpace] = []

    def make(device: int) -> FakeDeviceSpace:
        made.append(FakeDeviceSpace(device))
        return made[-1]

    monkeypatch.setattr(_communicator, "device_space", make)
    return made


@pytest.fixture
def tcp_kinds(monkeypatch: pytest.MonkeyPatch) -> list[MemoryKind]:
    """The memory kind of every buffer TCP connections were handed."""
    seen: list[MemoryKind] = []
    isend, irecv = TcpConnection.isend, TcpConnection.irecv

    def spy_send(self: TcpConnection, buf: Buffer, tag: int, meta: bytes = bytes(16)) -> Any:
        seen.append(buf.kind)
        return isend(self, buf, tag, meta)

    def spy_recv(self: TcpConnection, buf: Buffer, tag: int) -> Any:
        seen.append(buf.kind)
        return irecv(self, buf, tag)

    monkeypatch.setattr(TcpConnection, "isend", spy_send)
    monkeypatch.setattr(TcpConnection, "irecv", spy_recv)
    return seen


@pytest.mark.parametrize("nranks", [2, 3])
async def test_full_matrix_on_fake_device_over_tcp(
        nranks: int, fake_devices: list[FakeDeviceSpace], tcp_kinds: list[MemoryKind],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "16K")  # many chunks: sends queue behind copies

    async def fn(comm: acoll.Communicator) -> int:
        assert comm.device == 0
        peers = [p for p in range(nranks) if p != comm.rank]
        assert {comm.transport_name(p) for p in peers} == {"socket"}
        dtypes = DTYPES if nranks == 2 else [np.dtype(np.int8), BFLOAT16, np.dtype(np.float32)]
        checks = await check_all(comm, COUNTS, dtypes, ALL_OPS, dev=to_dev(0), host=to_host)
        for p in peers:
            conn = await comm.connection(p)
            assert isinstance(conn, StagedConnection)
            assert conn.staged_sends > 0
            assert conn.staged_recvs > 0
        return checks

    results = await run_ranks(nranks, fn, device=0)
    assert len(set(results)) == 1
    assert tcp_kinds
    assert set(tcp_kinds) == {MemoryKind.HOST}
    for space in fake_devices:
        staging = space.staging()
        assert staging.downloads > 0
        assert staging.uploads > 0
        # Pooled: far fewer host buffers exist than were leased.
        assert sum(len(v) for v in staging._free.values()) < staging.leased / 10
        assert space.settles > 0  # every op without stream= waited for its work


async def test_fake_device_over_shm(fake_devices: list[FakeDeviceSpace],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Device buffers are staged over shared memory too (a host-memory transport): here
    the ranks of this process use it (in-process transport off, same-process pairs
    allowed), with messages larger than the ring."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "64K")
    monkeypatch.setenv("ACOLL_SHM_RING_SIZE", "32K")
    monkeypatch.setattr(ShmTransport, "can_connect",
                        lambda self, mine, theirs: mine.same_host(theirs))
    kinds: list[MemoryKind] = []
    isend, irecv = ShmConnection.isend, ShmConnection.irecv

    def spy_send(self: ShmConnection, buf: Buffer, tag: int, meta: bytes = bytes(16)) -> Any:
        kinds.append(buf.kind)
        return isend(self, buf, tag, meta)

    def spy_recv(self: ShmConnection, buf: Buffer, tag: int) -> Any:
        kinds.append(buf.kind)
        return irecv(self, buf, tag)

    monkeypatch.setattr(ShmConnection, "isend", spy_send)
    monkeypatch.setattr(ShmConnection, "irecv", spy_recv)

    async def fn(comm: acoll.Communicator) -> int:
        assert {comm.transport_name(p) for p in range(2) if p != comm.rank} == {"shm"}
        n = 300_001
        x = FakeDevArray(np.arange(n, dtype=np.float64) + comm.rank)
        await comm.all_reduce(x)
        np.testing.assert_array_equal(x.arr, 2 * np.arange(n) + 1)
        dtypes = [np.dtype(np.int8), BFLOAT16, np.dtype(np.float32)]
        checks = await check_all(comm, COUNTS, dtypes, ALL_OPS, dev=to_dev(0), host=to_host)
        conn = await comm.connection(1 - comm.rank)
        assert isinstance(conn, StagedConnection)
        assert conn.staged_sends > 0
        assert conn.staged_recvs > 0
        return checks

    results = await run_ranks(2, fn, device=0)
    assert len(set(results)) == 1
    assert set(kinds) == {MemoryKind.HOST}

@pytest.mark.parametrize("stream", [False, True])
async def test_small_device_all_reduce_runs_on_one_host_copy(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    """Up to ACOLL_GPU_VIA_HOST_MAX, a device all_reduce with no intra-host GPU path is the
    host algorithm on one downloaded copy: one download and one upload per op, no staged
    message, results equal to the host path's; above it, every message is staged."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_MAX", "4K")
    kw = {"stream": "s"} if stream else {}

    async def fn(comm: acoll.Communicator) -> list[int]:
        staging = fake_devices[comm.rank].staging()
        conns = [await comm.connection(p) for p in range(3) if p != comm.rank]
        assert all(isinstance(c, StagedConnection) for c in conns)
        counts = []
        for n, dtype, op in [(1, np.float32, "sum"), (1000, BFLOAT16, "max"),
                             (512, np.int64, "prod"), (1025, np.float32, "avg")]:
            before = (staging.downloads, staging.uploads,
                      sum(c.staged_sends for c in conns))  # type: ignore[attr-defined]
            ins = [(np.arange(n) % 7 + r + 1).astype(np.float64) for r in range(3)]
            base = ins[comm.rank].astype(dtype)
            x, out = FakeDevArray(base.copy()), FakeDevArray(np.zeros(n, dtype))
            waits = staging.upload_waits
            await comm.all_reduce(x, out, op, **kw)
            if base.nbytes <= 4096:
                # without stream=, the await waited for the upload; with it, it did not
                assert staging.upload_waits == waits + (0 if stream else 1)
                # made while nothing else ran: both copies on the caller's stream itself
                assert staging.on_streams[-2:] == [("download", kw.get("stream")),
                                                   ("upload", kw.get("stream"))]
            after = (staging.downloads, staging.uploads,
                     sum(c.staged_sends for c in conns))  # type: ignore[attr-defined]
            # small integers: every order of combination gives these exact values
            want = {"sum": sum(ins), "max": np.maximum.reduce(ins), "prod": np.prod(ins, 0),
                    "avg": sum(ins)}[op].astype(dtype)
            if op == "avg":
                want = (want / np.float32(3)).astype(dtype)
            np.testing.assert_array_equal(out.arr, want)
            np.testing.assert_array_equal(x.arr, base)  # the input is left alone
            counts.append(after[2] - before[2])
            if base.nbytes <= 4096:
                assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
        return counts

    for counts in await run_ranks(3, fn, device=0):
        assert counts[:3] == [0, 0, 0]  # host copies: nothing staged per message
        assert counts[3] > 0  # 4100 bytes: above the limit, staged


async def test_small_device_all_reduces_issued_together_and_in_groups(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch) -> None:
    """Small device all_reduces issued as concurrent tasks (the first runs at once, on the
    caller's stream; the rest queue behind it and take the ordered path) and inside a
    group: exact results, in call order on every rank, plans reused across calls."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> int:
        staging = fake_devices[comm.rank].staging()
        xs = [FakeDevArray(np.full(5 + i % 3, comm.rank + i, np.int64)) for i in range(12)]
        for _ in range(2):
            direct = len(staging.on_streams)
            await asyncio.gather(*(comm.all_reduce(x) for x in xs[:6]))
            assert len(staging.on_streams) == direct + 2  # only the first went direct
            async with comm.group():
                for x in xs[6:]:
                    await comm.all_reduce(x, op="max")
            for i, x in enumerate(xs):
                np.testing.assert_array_equal(x.arr, (2 * i + 1) if i < 6 else i + 1)
            for i, x in enumerate(xs):
                x.arr[...] = comm.rank + i
        assert len(comm._via_plans) == 1  # only the first of each gather was direct
        for i, x in enumerate(xs[:3]):  # one after another: each direct
            await comm.all_reduce(x)
            np.testing.assert_array_equal(x.arr, 2 * i + 1)
        return len(comm._via_plans)  # (count, dtype, op) seen: 5, 6, 7 x sum

    assert await run_ranks(2, fn, device=0) == [3, 3]


async def test_direct_plans_are_evicted_least_recently_used_and_fenced(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch) -> None:
    """At most 16 (count, dtype, op) plans; a hit makes a plan the newest; the evicted
    plan's page-locked block goes back to the staging pool with its last upload's fence
    (reused only after that upload), and close() gives every plan's block back alike."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    released: list[tuple[Any, Any]] = []  # (block, fence), both ranks (blocks differ)
    real = FakeStaging.release

    def spy(self: FakeStaging, block: Any, fence: Any = None) -> None:
        released.append((block, fence))
        real(self, block, fence)

    monkeypatch.setattr(FakeStaging, "release", spy)

    async def fn(comm: acoll.Communicator) -> list[int]:
        async def call(count: int) -> None:
            x = FakeDevArray(np.full(count, comm.rank + 1, np.int32))
            await comm.all_reduce(x, stream="s")
            np.testing.assert_array_equal(x.arr, 3)

        for count in range(1, 17):
            await call(count)
        await call(1)  # a hit: 1 becomes the newest, 2 the oldest
        plans = comm._via_plans
        evicted = next(p for k, p in plans.items() if k[0] == 2)
        await call(17)
        assert [k[0] for k in plans][-2:] == [1, 17]
        assert 2 not in [k[0] for k in plans]
        assert len(plans) == 16
        assert [r for r in released if r[0] is evicted.block] == [(evicted.block,
                                                                    evicted.last)]
        assert evicted.last is not None  # (stream=: the upload was not waited for)
        return sorted(k[0] for k in plans)

    results = await run_ranks(2, fn, device=0)
    assert results[0] == [1, *range(3, 18)]
    assert len(released) >= 2 * 16  # close() gave the 16 plans' blocks back on each rank


@pytest.mark.parametrize("algo", ["", "all_reduce:direct"])
async def test_ranks_may_differ_on_going_through_the_host(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        algo: str) -> None:
    """Going through the host is each rank's own choice (the same messages either way):
    rank 0 stages every message, rank 1 runs the host algorithm on its page-locked copy,
    at sizes on both sides of every threshold, with the tuner's algorithms and with the
    direct all-reduce; exact results. (Without the native ring: where it runs, every rank
    agrees on what goes through the host, see
    test_native_ring_is_off_for_device_records_that_disagree.)"""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_NATIVE", "0")
    monkeypatch.setenv("ACOLL_ALGO", algo)
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "64K")

    async def fn(comm: acoll.Communicator) -> int:
        if comm.rank == 0:
            comm._via_host_max, comm._via_auto = 0, False
        conn = await comm.connection(1 - comm.rank)
        for n in (1, 1000, 16_385, 300_001):
            for op in ("sum", "max"):
                x = FakeDevArray(np.arange(n, dtype=np.int32) % 13 + comm.rank)
                out = FakeDevArray(np.zeros(n, np.int32))
                await comm.all_reduce(x, out, op)
                base = np.arange(n, dtype=np.int32) % 13
                np.testing.assert_array_equal(out.arr, 2 * base + 1 if op == "sum"
                                              else base + 1)
                await comm.all_reduce(x, op=op)  # in place
                np.testing.assert_array_equal(x.arr, out.arr)
        return conn.staged_sends  # type: ignore[attr-defined, no-any-return]

    staged_0, staged_1 = await run_ranks(2, fn, device=0)
    assert staged_0 > 0
    assert staged_1 == 0


@pytest.mark.parametrize(("path", "ring_chunks"), [("direct", "8"), ("ordered", "8"),
                                                   ("direct", "1")])
@pytest.mark.parametrize("nranks", [2, 3, 4])
async def test_ring_through_the_host_pipelines_its_copies(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        nranks: int, path: str, ring_chunks: str) -> None:
    """Above one chunk, a device all_reduce through the host downloads its input in pieces
    (each awaited only before the ring first reads it; fake downloads land 100 loop
    iterations late, so a piece read early would carry the block's previous contents) and
    uploads each piece of the result once it is final: exact results for several ops,
    dtypes, in place and not, with and without stream=, and every element uploaded once.
    Both where the copies go on the caller's stream (the call starts at once: direct) and
    where they are ordered after it (here: the pool must grow first). (The default;
    ACOLL_GPU_VIA_HOST_PIPELINE=0 turns it off.) With ``ACOLL_RING_CHUNKS=1`` the ring's
    chunks (whole segments) are larger than the copies' pieces."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_NATIVE", "0")  # (the Python ring: the native one copies whole)
    monkeypatch.setenv("ACOLL_RING_CHUNKS", ring_chunks)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIPELINE", "1")
    monkeypatch.setattr(via_host_mod, "PIPELINE_MIN", 0)  # (small calls pipeline too)
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    monkeypatch.setattr(FakeDeviceSpace, "delay", 100)  # downloads land late
    from acoll._comm import via_host

    if path == "ordered":
        monkeypatch.setattr(FakeStaging, "lease_now", lambda self, nbytes: None)
    copies = via_host.CallerCopies if path == "direct" else via_host.OrderedCopies

    stages: list[via_host.RingStaging] = []
    real = via_host.RingStaging.__init__

    def spy(self: via_host.RingStaging, *args: Any) -> None:
        real(self, *args)
        stages.append(self)

    monkeypatch.setattr(via_host.RingStaging, "__init__", spy)

    async def fn(comm: acoll.Communicator) -> int:
        staging = fake_devices[comm.rank].staging()
        n = 20_001
        for i, (dtype, op) in enumerate([(np.int32, "sum"), (np.float32, "max"),
                                         (np.int64, "prod"), (np.float64, "avg")]):
            ins = [((np.arange(n) * (i + 3) + r) % 5 + 1).astype(dtype)
                   for r in range(comm.size)]
            want = reference(ins, acoll.ReduceOp.coerce(op))
            for inplace, kw in ((False, {}), (True, {"stream": "s"})):
                downloads = staging.downloads
                x = FakeDevArray(ins[comm.rank].copy())
                out = None if inplace else FakeDevArray(np.zeros(n, dtype))
                await comm.all_reduce(x, out, op, **kw)
                got = x.arr if inplace else out.arr  # type: ignore[union-attr]
                assert_result(got, want, acoll.ReduceOp.coerce(op), comm.size, f"{op}")
                assert staging.downloads - downloads > 1  # in pieces
        return len(stages)

    assert all(await run_ranks(nranks, fn, device=0))
    assert all(st.uploaded == st.data.count for st in stages)
    assert all(len(st._fences) > 1 for st in stages)
    assert {type(st.copies) for st in stages} == {copies}


@pytest.mark.parametrize(("algo", "pipeline"), [("ring", "0"), ("ring", "1"), ("rd", "1"),
                                              ("direct", "1")])
async def test_larger_device_all_reduces_go_direct_once_the_pool_has_a_block(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        algo: str, pipeline: str) -> None:
    """Above the size that keeps a copy of its own, an all_reduce made while nothing else
    runs leases a pooled block at the call and puts its copies on the caller's stream
    (in pieces on the ring; whole with ACOLL_GPU_VIA_HOST_PIPELINE=0). A block of 1 MiB
    or more the pool lacks is allocated off the loop by the ordered path, which the first
    such call takes; the block goes back to the pool and the next call goes direct. With
    stream=, the block goes back fenced by the last upload. Exact results, in place and
    not."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_ALGO", f"all_reduce:{algo}")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIPELINE", pipeline)
    monkeypatch.setattr(via_host_mod, "PIPELINE_MIN", 0)  # (small calls pipeline too)
    pieces = algo == "ring" and pipeline == "1"
    if pieces:
        monkeypatch.setenv("ACOLL_NATIVE", "0")  # (the Python ring: the native one copies whole)
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "64K")
    from acoll._comm import via_host

    ran: dict[int, list[str]] = {0: [], 1: []}  # per rank, the path of each call
    for cls in (via_host.DirectLarge, via_host.ViaHost):
        monkeypatch.setattr(cls, "run", (lambda real, name: lambda self: (
            ran[self.ctx.rank].append(name), real(self))[1])(cls.run, cls.__name__))
    released: list[tuple[FakeStaging, Any]] = []
    real_release = FakeStaging.release

    def spy(self: FakeStaging, block: Any, fence: Any = None) -> None:
        released.append((self, fence))
        real_release(self, block, fence)

    monkeypatch.setattr(FakeStaging, "release", spy)

    async def fn(comm: acoll.Communicator) -> list[str]:
        staging = fake_devices[comm.rank].staging()
        for n in (100_000, 300_000):  # 400 KB, 1.2 MB of int32
            base = np.arange(n, dtype=np.int32) % 11
            for kw in ({}, {"stream": "s"}):
                for inplace in (False, True):
                    x = FakeDevArray(base + comm.rank)
                    out = None if inplace else FakeDevArray(np.zeros(n, np.int32))
                    on, rel = len(staging.on_streams), len(released)
                    waits = staging.upload_waits
                    await comm.all_reduce(x, out, **kw)
                    got = x.arr if inplace else out.arr  # type: ignore[union-attr]
                    np.testing.assert_array_equal(got, 2 * base + 1)
                    if ran[comm.rank][-1] == "DirectLarge":
                        mine = staging.on_streams[on:]
                        assert {s for _, s in mine} == {kw.get("stream")}
                        kinds = [k for k, _ in mine]
                        assert (kinds.count("download") > 1) is pieces
                        assert (kinds.count("upload") > 1) is pieces
                        # fenced by events of their own (a stream query could outlive the
                        # caller's stream, and would wait for its later work too)
                        assert all(staging.owns[on:])
                        # without stream=, the await waited for the upload
                        assert staging.upload_waits == waits + (0 if kw else 1)
                        fences = [f for st, f in released[rel:] if st is staging]
                        # waited for (no stream=): back at once; else fenced by the upload
                        assert fences == [None] if not kw else (
                            len(fences) == 1 and fences[0] is not None)
        return ran[comm.rank]

        # while another call runs or waits, or in a group: the ordered path
        ordered = len(ran[comm.rank])
        xs = [FakeDevArray(np.arange(100_000, dtype=np.int32) % 7 + comm.rank)
              for _ in range(3)]
        await asyncio.gather(*(comm.all_reduce(x) for x in xs[:2]))
        async with comm.group():
            await comm.all_reduce(xs[2])
        for x in xs:
            np.testing.assert_array_equal(x.arr, 2 * (np.arange(100_000) % 7) + 1)
        assert ran[comm.rank][ordered:] == ["DirectLarge", "ViaHost", "ViaHost"]
        return ran[comm.rank][:ordered]

    for paths in await run_ranks(2, fn, device=0):
        # 400 KB: direct from the first call; 1.2 MB: ordered once, then direct
        assert paths == ["DirectLarge"] * 4 + ["ViaHost"] + ["DirectLarge"] * 3


async def test_via_host_limit_follows_the_transports(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto limit: 64 MiB when every peer's transport stages device memory, 64 KiB when
    one moves it directly (GPUDirect RDMA); a set value is kept."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    class Direct:
        def memory_for(self, staging: Any) -> frozenset[MemoryKind]:
            return frozenset({MemoryKind.HOST, MemoryKind.CUDA})

    async def fn(comm: acoll.Communicator) -> list[int]:
        limits = [comm._via_limit()]
        comm._via_auto = True
        monkeypatch.setattr(comm._links, "transport_for",
                            lambda p: None if p == comm.rank else Direct())
        limits.append(comm._via_limit())
        return limits

    assert await run_ranks(2, fn, device=0) == [[64 << 20, 64 << 10]] * 2
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_MAX", "1M")
    assert await run_ranks(2, lambda c: asyncio.sleep(0, c._via_limit()),
                           device=0) == [1 << 20] * 2


async def test_via_host_can_be_turned_off(fake_devices: list[FakeDeviceSpace],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_MAX", "0")

    async def fn(comm: acoll.Communicator) -> int:
        conn = await comm.connection(1 - comm.rank)
        x = FakeDevArray(np.full(2, comm.rank + 1, np.float32))
        await comm.all_reduce(x)
        np.testing.assert_array_equal(x.arr, [3, 3])
        return conn.staged_sends  # type: ignore[attr-defined, no-any-return]

    assert all(n > 0 for n in await run_ranks(2, fn, device=0))


async def test_large_messages_and_many_chunks(fake_devices: list[FakeDeviceSpace],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "64K")
    n = 3_000_001

    async def fn(comm: acoll.Communicator) -> None:
        x = FakeDevArray(np.arange(n, dtype=np.float64) + comm.rank)
        await comm.all_reduce(x)
        np.testing.assert_array_equal(x.arr, 3 * np.arange(n) + 3)
        b = FakeDevArray(np.full(n, comm.rank, np.int32))
        await comm.broadcast(b, root=2)
        assert (b.arr == 2).all()

    await run_ranks(3, fn, device=0)


async def test_device_arguments_are_checked(fake_devices: list[FakeDeviceSpace],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> None:
        await comm.all_reduce(np.zeros(4, np.float32), FakeDevArray(np.zeros(4, np.float32)))

    with pytest.raises(acoll.InvalidUsage, match="send is in host memory"):
        await run_ranks(1, fn, device=0)

    async def wrong_device(comm: acoll.Communicator) -> None:
        await comm.all_reduce(FakeDevArray(np.zeros(4)), FakeDevArray(np.zeros(4), 1))

    with pytest.raises(acoll.InvalidUsage, match="recv is on fake device 1"):
        await run_ranks(1, wrong_device, device=0)

    async def strided(comm: acoll.Communicator) -> None:
        await comm.broadcast(FakeDevArray(np.zeros(10)[::2]))

    with pytest.raises(acoll.InvalidUsage, match="buf is not contiguous"):
        await run_ranks(1, strided, device=0)


async def test_bad_device_argument() -> None:
    uid = acoll.get_unique_id(ifname="=lo")
    for bad in (-1, 1.5, "0", True):
        with pytest.raises(acoll.InvalidUsage, match="device must be"):
            await acoll.init_rank(1, uid, 0, device=bad)  # type: ignore[arg-type]


async def test_stream_argument_needs_a_device() -> None:
    async def fn(comm: acoll.Communicator) -> None:
        with pytest.raises(acoll.InvalidUsage, match="stream= needs a GPU communicator"):
            await comm.all_reduce(np.zeros(4), stream=1)

    await run_ranks(2, fn)


async def test_stream_ordering_hooks(fake_devices: list[FakeDeviceSpace],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op starts after the caller's stream and publishes to it; only ops without
    ``stream=`` wait for their work (``settle``)."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> None:
        space = comm.mem
        assert isinstance(space, FakeDeviceSpace)
        x = FakeDevArray(np.ones(1000, np.float32))
        before = space.settles
        await comm.broadcast(x, stream="s1")
        assert space.events[-2:] == [("start", "s1"), ("finish", "s1")]
        assert space.settles == before
        # a small all_reduce made while nothing runs: its copies go on the stream itself
        await comm.all_reduce(x, stream="s1")
        assert space.staging().on_streams[-2:] == [("download", "s1"), ("upload", "s1")]
        assert space.settles == before
        await comm.all_gather(x[:10], FakeDevArray(np.zeros(20, np.float32)))
        assert space.events[-2:] == [("start", None), ("finish", None)]
        assert space.settles == before + 1
        async with comm.group():
            await comm.send(x, 1 - comm.rank, stream="g")
            await comm.recv(FakeDevArray(np.zeros(1000, np.float32)), 1 - comm.rank,
                            stream="g")
        assert [e for e in space.events if e[1] == "g"] == [("start", "g"), ("start", "g"),
                                                            ("finish", "g"), ("finish", "g")]
        assert (x.arr == 2).all()

    await run_ranks(2, fn, device=0)


async def test_split_keeps_the_device(fake_devices: list[FakeDeviceSpace],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> None:
        sub = await comm.split(comm.rank % 2)
        assert sub is not None
        async with sub:
            assert sub.device == comm.device
            assert sub.mem is not comm.mem  # its own stream and pools
            x = FakeDevArray(np.full(5, comm.rank, np.int64))
            await sub.all_reduce(x)
            assert (x.arr == (2 if comm.rank % 2 == 0 else 4)).all()

    await run_ranks(4, fn, device=0)


# ----------------------------------------------------------------------- the transport contract

class _Labelled(StagedConnection):
    """Stages *every* message: the battery's host buffers are relabelled as fake device
    memory first."""

    def __init__(self, inner: Connection, space: FakeDeviceSpace) -> None:
        super().__init__(inner, space.staging())
        self.space = space

    def _relabel(self, buf: Buffer) -> Buffer:
        return Buffer(buf.array, self.space) if buf.kind is MemoryKind.HOST else buf

    def isend(self, buf: Buffer, tag: int, meta: bytes) -> Any:
        return super().isend(self._relabel(buf), tag, meta)

    def irecv(self, buf: Buffer, tag: int) -> Any:
        return super().irecv(self._relabel(buf), tag)


class _StagedListener(Listener):
    def __init__(self, inner: Listener) -> None:
        self.inner, self.handle = inner, inner.handle

    async def accept(self) -> tuple[bytes, Connection]:
        hello, conn = await self.inner.accept()
        return hello, _Labelled(conn, FakeDeviceSpace(0))

    def close(self, notice: bytes = b"") -> None:
        self.inner.close(notice)


class _StagedTransport(Transport):
    name = "staged"

    def __init__(self, key: bytes = KEY) -> None:
        self.inner = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=key, timeout=1.0)

    async def listen(self) -> Listener:
        return _StagedListener(await self.inner.listen())

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> Connection:
        return _Labelled(await self.inner.connect(handle, hello, deadline), FakeDeviceSpace(0))


@pytest.fixture
def harness() -> TransportHarness:
    return TransportHarness("staged", _StagedTransport,
                            stranger=lambda: _StagedTransport(bytes(range(1, 33))))


class TestStagedConformance(TransportConformance):
    """The shared battery on TCP, every message staged through (late) host copies."""


def test_fake_staging_pool_reuses_after_fences() -> None:
    staging = FakeStaging(0)
    view, block = staging.lease(1000)
    assert view.nbytes == 1000
    assert block.nbytes == 4096
    staging.release(block)
    _view2, block2 = staging.lease(3000)
    assert block2 is block
    staging.release(block2)
    _, big = staging.lease(5000)
    assert big.nbytes == 8192


def test_device_views_without_a_gpu() -> None:
    """DeviceView and the contiguity rules need no CuPy; importing acoll imports no CuPy."""
    from acoll._memory.cuda import DeviceView, _contiguous

    v = DeviceView(4096, 100, np.dtype(np.float32), 0, None)
    w = v[10:20]
    assert (w.ptr, w.size, w.nbytes, w.itemsize) == (4096 + 40, 10, 40, 4)
    assert v[95:200].size == 5
    with pytest.raises(ValueError, match="contiguous"):
        v[::2]
    assert v.__cuda_array_interface__["typestr"] == "<f4"
    assert DeviceView(0, 3, BFLOAT16, 0, None).__cuda_array_interface__["typestr"] == "<u2"
    assert _contiguous((3, 4), (16, 4), 4)
    assert _contiguous((3, 4), (4, 12), 4)  # Fortran order
    assert not _contiguous((3, 4), (32, 8), 4)
    assert _contiguous((1, 4), (999, 4), 4)  # unit dimensions may have any stride
    import subprocess
    import sys

    code = "import sys, acoll; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dlpack_parsing_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DLPack reader of GPU buffers, run on CPU tensors by treating device type 1
    (CPU) as CUDA: pointer, count, dtype (bfloat16 included), strides, read-only flag."""
    torch = pytest.importorskip("torch")
    from acoll._memory import cuda as cuda_mod

    monkeypatch.setattr(cuda_mod, "_KDLCUDA", 1)
    for dtype, want in ((torch.float32, np.dtype(np.float32)), (torch.bfloat16, BFLOAT16),
                        (torch.int8, np.dtype(np.int8)), (torch.uint8, np.dtype(np.uint8))):
        t = torch.zeros(3, 5, dtype=dtype)[1:]
        view = cuda_mod._from_dlpack(t, "send", writable=True)
        assert (view.ptr, view.size, view.dtype, view.device) == (t.data_ptr(), 10, want, 0)
    assert cuda_mod._from_dlpack(torch.zeros(4, 4).t(), "x", False).size == 16
    with pytest.raises(acoll.InvalidUsage, match="send is not contiguous"):
        cuda_mod._from_dlpack(torch.zeros(8)[::2], "send", False)
    with pytest.raises(acoll.InvalidUsage, match="unsupported DLPack dtype"):
        cuda_mod._from_dlpack(torch.zeros(2, dtype=torch.complex64), "send", False)


def test_init_from_env_device_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """device="auto" binds local rank l to GPU l % ngpus (the glue, with a stand-in
    init_rank and GPU count)."""
    import asyncio
    import sys
    import types

    from acoll import _env

    calls: list[dict[str, object]] = []

    async def fake_init_rank(nranks: int, uid: object, rank: int, **kw: object) -> str:
        calls.append(kw)
        return "comm"

    fake = types.ModuleType("acoll._communicator")
    fake.init_rank = fake_init_rank  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "acoll._communicator", fake)
    monkeypatch.setattr(_env, "_gpu_count", lambda: 2)
    for name in ("ACOLL_RANK", "ACOLL_COMM_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACOLL_RANK", "3")
    monkeypatch.setenv("ACOLL_WORLD_SIZE", "4")
    monkeypatch.setenv("ACOLL_LOCAL_RANK", "3")
    monkeypatch.setenv("ACOLL_COMM_ID", "127.0.0.1:29500")
    assert asyncio.run(_env.init_from_env(device="auto")) == "comm"
    assert asyncio.run(_env.init_from_env()) == "comm"
    assert asyncio.run(_env.init_from_env(device=0)) == "comm"
    assert calls == [{"device": 1}, {}, {"device": 0}]
    with pytest.raises(acoll.InvalidUsage, match="device must be"):
        asyncio.run(_env.init_from_env(device="cuda"))


@pytest.mark.parametrize(("size", "pipeline"), [(2_000, "0"), (300_000, "0"),
                                                (300_000, "1")])
async def test_peer_abort_during_a_direct_device_all_reduce(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        size: int, pipeline: str) -> None:
    """A peer that aborts while a device all_reduce runs on the direct path (a plan's copy,
    or a pooled block with its copies pipelined on the caller's stream) fails it with
    RemoteError naming the peer, within seconds; the pooled block goes back fenced by
    the copies already enqueued."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "16K")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIPELINE", pipeline)
    if pipeline == "1":
        monkeypatch.setenv("ACOLL_NATIVE", "0")  # (the Python ring: the native one copies whole)
    monkeypatch.setattr(via_host_mod, "PIPELINE_MIN", 0)  # (small calls pipeline too)
    monkeypatch.setattr(FakeDeviceSpace, "delay", 50)
    released: list[Any] = []
    real_release = FakeStaging.release

    def spy(self: FakeStaging, block: Any, fence: Any = None) -> None:
        released.append(fence)
        real_release(self, block, fence)

    monkeypatch.setattr(FakeStaging, "release", spy)
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=0, ifname="=lo",
                                                   timeout=20) for r in range(2)))
    x = FakeDevArray(np.ones(size, np.float32))
    warm = FakeDevArray(np.ones(size, np.float32))
    await asyncio.gather(*(c.all_reduce(FakeDevArray(warm.arr.copy())) for c in comms))
    released.clear()
    staging = comms[0].mem.staging()
    assert isinstance(staging, FakeStaging)
    on = len(staging.on_streams)
    task = asyncio.ensure_future(comms[0].all_reduce(x))  # rank 1 never joins
    await asyncio.sleep(0.01)
    comms[1].abort()
    t = asyncio.get_running_loop().time()
    with pytest.raises(acoll.RemoteError, match="rank 1"):
        await task
    assert asyncio.get_running_loop().time() - t < 5
    assert ("download", None) in staging.on_streams[on:]  # (it went direct)
    if size > 2_000:
        assert len(released) == 1
        assert released[0] is not None
        if pipeline == "1":
            assert staging.on_streams[on:].count(("download", None)) > 1  # (in pieces)
    comms[0].abort()


async def test_a_direct_call_that_fails_before_it_runs_gives_its_block_back(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad stream= is refused before anything is leased; a call whose op never ran
    (here the executor refuses it) gives its pooled block back."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> None:
        staging = comm.mem.staging()
        assert isinstance(staging, FakeStaging)
        x = FakeDevArray(np.ones(100_000, np.float32))
        leased = staging.leased
        with pytest.raises(acoll.InvalidUsage, match="stream"):
            await comm.all_reduce(x, stream=3)
        assert staging.leased == leased

    await run_ranks(2, fn, device=0)
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=0, ifname="=lo")
                                   for r in range(2)))
    staging = comms[0].mem.staging()
    assert isinstance(staging, FakeStaging)

    async def refuse(*args: Any, **kw: Any) -> None:
        raise acoll.InvalidUsage("refused")

    monkeypatch.setattr(comms[0]._exec, "execute", refuse)
    with pytest.raises(acoll.InvalidUsage, match="refused"):
        await comms[0].all_reduce(FakeDevArray(np.ones(100_000, np.float32)))
    assert sum(map(len, staging._free.values())) == 1  # the block is back
    for c in comms:
        c.abort()


async def test_copies_pipeline_by_default_above_one_mib(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults: a ring all_reduce through the host of up to 1 MiB copies its input down
    and its result up in one piece each (measured faster there); above it, in pieces.
    (On the Python ring; the native ring copies whole.)"""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_NATIVE", "0")  # (the Python ring: the native one copies whole)
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "64K")

    async def fn(comm: acoll.Communicator) -> list[int]:
        staging = comm.mem.staging()
        assert isinstance(staging, FakeStaging)
        downloads = []
        for n in (1 << 18, (1 << 18) + 1024):  # 1 MiB of int32, and a little more
            x = FakeDevArray(np.full(n, comm.rank + 1, np.int32))
            for _ in range(2):  # (the first of a size allocates its block: ordered)
                on = len(staging.on_streams)
                await comm.all_reduce(x)
            downloads.append([k for k, _ in staging.on_streams[on:]].count("download"))
            np.testing.assert_array_equal(x.arr, 6)  # (1 + 2) then doubled
        return downloads

    for downloads in await run_ranks(2, fn, device=0):
        assert downloads[0] == 1
        assert downloads[1] > 1


# ----------------------------------------------------------- the native ring through the host
_NATIVE_LIB = None


def _needs_native() -> None:
    global _NATIVE_LIB
    from acoll import _native

    _NATIVE_LIB = _NATIVE_LIB or _native.load()
    if _NATIVE_LIB is None:
        pytest.skip("no C compiler: the native ring cannot be built here")


async def _each_case(comm: acoll.Communicator, n: int, cases: list[tuple[Any, str]],
                     shift: int, counter: Callable[[], int]) -> list[int]:
    """Device all_reduces of ``n`` elements on the fake device, each (dtype, op) of
    ``cases`` out of place and then in place with ``stream=``, results checked exactly
    (inputs shifted by ``shift``); per call, how much ``counter()`` grew."""
    grew = []
    for i, (dtype, op) in enumerate(cases):
        ins = [((np.arange(n) * (i + 3) + r + shift) % 5 + 1).astype(dtype)
               for r in range(comm.size)]
        want = reference(ins, acoll.ReduceOp.coerce(op))
        for inplace, kw in ((False, {}), (True, {"stream": "s"})):
            before = counter()
            x = FakeDevArray(ins[comm.rank].copy())
            out = None if inplace else FakeDevArray(np.zeros(n, dtype))
            await comm.all_reduce(x, out, op, **kw)
            got = x.arr if inplace else out.arr  # type: ignore[union-attr]
            assert_result(got, want, acoll.ReduceOp.coerce(op), comm.size, f"{op}")
            grew.append(counter() - before)
    return grew


@pytest.fixture
def native_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[MemoryKind, int]]:
    """(memory kind, bytes) of the buffers of every native ring call."""
    from acoll._comm import native_ring

    _needs_native()
    seen: list[tuple[MemoryKind, int]] = []
    real = native_ring.NativeRing.run

    async def spy(self: Any, ctx: Any, mode: int, src: Buffer, dst: Buffer, *rest: Any
                  ) -> Any:
        seen.append((src.kind, src.nbytes))
        assert src.ptr == dst.ptr  # (in place, on the host copy)
        return await real(self, ctx, mode, src, dst, *rest)

    monkeypatch.setattr(native_ring.NativeRing, "run", spy)
    return seen


@pytest.mark.parametrize("path", ["direct", "ordered"])
@pytest.mark.parametrize("nranks", [2, 3])
async def test_native_ring_runs_device_all_reduces_through_the_host(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]], nranks: int, path: str) -> None:
    """Where every pair of ranks is joined over TCP, a device all_reduce that goes through
    the host and that the tuner gives to the ring runs on the native ring, on one whole
    copy each way (fake downloads land late: a ring that read early would sum the block's
    old contents): exact results for several dtypes and ops, in place and not, with and
    without stream=, on the direct path (copies on the caller's stream) and the ordered
    one (float16 too, since ring.c has 16-bit floats); small calls stay on the Python
    algorithms."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "16K")
    monkeypatch.setattr(FakeDeviceSpace, "delay", 30)
    if path == "ordered":
        monkeypatch.setattr(FakeStaging, "lease_now", lambda self, nbytes: None)
    cases = [(np.int32, "sum"), (np.float32, "max"), (np.int64, "prod"), (np.float64, "avg"),
             (np.float16, "sum")]

    async def fn(comm: acoll.Communicator) -> list[int]:
        assert comm._native is not None
        staging = fake_devices[comm.rank].staging()
        downloads = []
        for n in (50_001, 300):  # (the ring's, then the small algorithm's)
            downloads += await _each_case(comm, n, cases, 0,
                                          lambda: staging.downloads)
        return downloads

    for downloads in await run_ranks(nranks, fn, device=0):
        assert downloads[:10] == [1] * 10  # (whole copies on the native ring)
    kinds = {kind for kind, _ in native_runs}
    assert kinds == {MemoryKind.HOST}
    sizes = sorted({nbytes for _, nbytes in native_runs})
    assert sizes == [50_001 * 2, 50_001 * 4, 50_001 * 8], sizes  # (not the small calls)
    assert len(native_runs) == nranks * 10


@pytest.mark.parametrize(("nranks", "mode"), [(2, "1"), (3, "both"), (2, "down"), (3, "up")])
async def test_native_ring_pipelines_its_copies_through_counters(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]], nranks: int, mode: str) -> None:
    """From NATIVE_PIPELINE_MIN a rank, a device all_reduce on the native ring (direct path)
    copies in pieces beside the ring: downloads land late, one by one, bumping the block's
    ready counter (the C ring reads no piece before), and each piece of the result is
    uploaded once the ring's final counter lets it (fake: a poller, as a stream waiting on
    the counter): exact results for dtypes and ops, in place and not, with stream=, over
    many calls (the counters wrap around), every piece moved once and every upload done.
    ``down``: downloads only in pieces, the upload whole after the ring; ``up``: the
    download whole (awaited before the ring: the ring is told every piece landed), the
    uploads in pieces. Without counters (a staging that has none), with
    ACOLL_GPU_VIA_HOST_PIPELINE=0 or with ACOLL_GPU_VIA_HOST_COUNTERS=0 the copies go
    whole; without the setting (the default: both) they go in pieces."""
    from acoll._comm import via_host

    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_COUNTERS", mode)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIECE", "8K")
    monkeypatch.setattr(via_host, "NATIVE_PIPELINE_MIN", 32 << 10)  # (a rank's segment)
    monkeypatch.setattr(FakeDeviceSpace, "delay", 20)
    cases = [(np.int32, "sum"), (np.float32, "max"), (np.int64, "prod"), (np.float64, "avg")]
    n = 30_001

    async def fn(comm: acoll.Communicator) -> tuple[list[int], int]:
        staging = comm.mem.staging()
        assert isinstance(staging, FakeStaging)
        pieces = []
        for rnd in range(3):
            pieces += await _each_case(comm, n, cases, rnd, lambda: staging.piece_downloads)
        await asyncio.sleep(0.01)  # (a stream=s call's last uploads may still be going)
        assert all(f.done() for f in staging.piece_upload_fences)
        return pieces, staging.piece_uploads - staging.piece_downloads

    for pieces, unmatched in await run_ranks(nranks, fn, device=0):
        if mode == "up":  # (the download whole, then as many pieces up as the ring made)
            assert all(p == 0 for p in pieces), pieces
            assert unmatched > 2 * len(pieces)
        else:  # (4- and 8-byte items in 8 KiB pieces)
            assert all(p > 2 for p in pieces), pieces
            assert (unmatched == 0) == (mode != "down")  # (as many pieces up as down)
    assert {kind for kind, _ in native_runs} == {MemoryKind.HOST}
    assert len(native_runs) == nranks * 24

    async def whole(comm: acoll.Communicator) -> tuple[int, int]:
        staging = comm.mem.staging()
        assert isinstance(staging, FakeStaging)
        before = staging.piece_downloads, staging.downloads
        x = FakeDevArray(np.full(n, comm.rank + 1, np.float32))
        await comm.all_reduce(x)
        np.testing.assert_array_equal(x.arr, sum(range(1, comm.size + 1)))
        return staging.piece_downloads - before[0], staging.downloads - before[1]

    monkeypatch.setattr(FakeStaging, "signalled", False)
    assert await run_ranks(2, whole, device=0) == [(0, 1)] * 2
    monkeypatch.setattr(FakeStaging, "signalled", True)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIPELINE", "0")
    assert await run_ranks(2, whole, device=0) == [(0, 1)] * 2
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_PIPELINE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_COUNTERS", "0")
    assert await run_ranks(2, whole, device=0) == [(0, 1)] * 2
    monkeypatch.delenv("ACOLL_GPU_VIA_HOST_COUNTERS")
    for pieces, downloads in await run_ranks(2, whole, device=0):
        assert pieces > 2
        assert downloads == 1  # (one call's download, in pieces)


def test_automatic_copy_piece_is_a_quarter_of_the_call_from_2_to_4_mib() -> None:
    """The copy counters' automatic piece: a quarter of the call, at least 2 MiB and at
    most 4 MiB; pieces never cross a rank's segment, so a 4 MiB call on 2 ranks copies
    one piece per segment each way, and a 64 MiB call on 4 ranks four per segment."""
    from acoll._comm.native_ring import staged_pieces
    from acoll._comm.via_host import auto_piece

    mib = 1 << 20
    assert [auto_piece(n * mib) // mib for n in (1, 4, 8, 12, 16, 64, 1024)] == [
        2, 2, 2, 3, 4, 4, 4]
    for nbytes, ranks, per_segment in ((4 * mib, 2, 1), (16 * mib, 2, 2), (64 * mib, 4, 4),
                                       (16 * mib, 4, 1)):
        count = nbytes // 4
        downloads, uploads = staged_pieces(count, ranks, 0, auto_piece(nbytes) // 4)
        assert len(downloads) == len(uploads) == ranks * per_segment
        assert sum(b - a for a, b in downloads) == count


async def test_concurrent_device_all_reduces_take_turns_on_the_native_ring(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]]) -> None:
    """Device all_reduces made together (tasks of one rank; the first goes direct, the
    others are queued and ordered) take their places on the native ring's links in their
    sequence order on every rank: exact results, none swapped, and they work in a group."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setattr(FakeDeviceSpace, "delay", 30)
    n = 40_000

    async def fn(comm: acoll.Communicator) -> bool:
        xs = [FakeDevArray(np.full(n, comm.rank + 10 * k, np.int32)) for k in range(5)]
        await asyncio.gather(*(comm.all_reduce(x) for x in xs))
        for k, x in enumerate(xs):
            np.testing.assert_array_equal(x.arr, sum(r + 10 * k for r in range(comm.size)))
        ys = [FakeDevArray(np.full(n, comm.rank + k, np.float32)) for k in range(3)]
        async with comm.group():
            for y in ys:
                await comm.all_reduce(y)
        for k, y in enumerate(ys):
            np.testing.assert_array_equal(y.arr, sum(r + k for r in range(comm.size)))
        return True

    assert all(await run_ranks(3, fn, device=0))
    assert len(native_runs) == 3 * 8


async def test_an_op_failing_outside_acolls_errors_fails_the_communicator_at_once(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]]) -> None:
    """Found by review: a queued device all_reduce whose page-locked block could not be
    had (an error of the device library, not acoll's) left its place in the native
    ring's line held, so this rank's next native op waited out its deadline, and the
    peer waited in the failed op. Now the rank raises the library's error, the
    communicator fails, the peer gets RemoteError at once and later calls raise."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setattr(FakeStaging, "lease_now", lambda self, nbytes: None)  # (ordered)
    real = FakeStaging.lease_async

    async def lease_async(self: FakeStaging, nbytes: int) -> Any:
        if self is fake_devices[0].staging():
            raise RuntimeError("page-locked allocation failed")
        return await real(self, nbytes)

    monkeypatch.setattr(FakeStaging, "lease_async", lease_async)

    async def fn(comm: acoll.Communicator) -> tuple[str, str, float]:
        x = FakeDevArray(np.ones(50_001, np.float32))
        start = time.monotonic()
        with pytest.raises(Exception) as first:
            await comm.all_reduce(x)
        with pytest.raises(acoll.AcollError) as later:
            await comm.all_reduce(x)
        return repr(first.value), str(later.value), time.monotonic() - start

    (mine, mine_later, t0), (peer, peer_later, t1) = await run_ranks(
        2, fn, device=0, timeout=20)
    assert mine == "RuntimeError('page-locked allocation failed')"
    assert "all_reduce #0 failed on rank 0: RuntimeError" in mine_later
    assert "RemoteError" in peer
    assert "all_reduce #0 failed on rank 0" in peer
    assert "all_reduce #0 failed on rank 0" in peer_later
    assert max(t0, t1) < 10  # (not the 20 s deadline)


async def _native_pair(size: int) -> list[acoll.Communicator]:
    """Two fake-device communicators of this loop (over TCP: ACOLL_INPROC_DISABLE=1), after
    one all_reduce of ``size`` float32 (their staging blocks and raw links made)."""
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=0, ifname="=lo",
                                                   timeout=20) for r in range(2)))
    await asyncio.gather(*(c.all_reduce(FakeDevArray(np.ones(size, np.float32)))
                           for c in comms))
    return list(comms)


def _released(comms: list[acoll.Communicator]) -> bool:
    """Every piecewise upload of these fake-device communicators went (a failed op's
    stream is let through, never left waiting on its counter)."""
    return all(f.done() for c in comms
               for f in c.mem.staging().piece_upload_fences)  # type: ignore[attr-defined]


@pytest.mark.parametrize("copies", ["pieces", "whole"])
async def test_a_peer_aborting_during_a_native_device_all_reduce_fails_it(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]], copies: str) -> None:
    """A device all_reduce on the native ring whose peer aborts ends in RemoteError naming
    the peer within seconds; the communicator then refuses calls. With piecewise copies,
    the failed op's uploads are let through (nothing waits on its counter forever)."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_COUNTERS", "1")
    monkeypatch.setattr(via_host_mod, "NATIVE_PIPELINE_MIN", 256 << 10)  # (a rank's part)
    monkeypatch.setattr(FakeStaging, "signalled", copies == "pieces")
    size = 300_000
    comms = await _native_pair(size)
    assert len(native_runs) == 2
    task = asyncio.ensure_future(comms[0].all_reduce(FakeDevArray(np.ones(size, np.float32))))
    await asyncio.sleep(0.05)
    comms[1].abort()
    t = asyncio.get_running_loop().time()
    with pytest.raises(acoll.RemoteError, match="rank 1"):
        await task
    assert asyncio.get_running_loop().time() - t < 5
    with pytest.raises(acoll.AcollError):
        await comms[0].all_reduce(FakeDevArray(np.ones(size, np.float32)))
    await asyncio.sleep(0.01)
    assert _released(comms)
    assert (sum(c.mem.staging().piece_downloads for c in comms) > 0  # type: ignore[attr-defined]
            ) == (copies == "pieces")
    for c in comms:
        c.abort()


@pytest.mark.parametrize("copies", ["pieces", "whole"])
async def test_cancelling_a_native_device_all_reduce_fails_every_rank(
        fake_devices: list[FakeDeviceSpace], monkeypatch: pytest.MonkeyPatch,
        native_runs: list[tuple[MemoryKind, int]], copies: str) -> None:
    """A device all_reduce on the native ring cancelled mid-op (its peer never joins)
    returns the cancellation at once, fails its communicator, and the peer's next call
    fails too, naming the cancel; no C call or block is left behind (the next op of a
    fresh pair of communicators runs), and with piecewise copies the cancelled op's
    uploads are let through."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_COUNTERS", "1")
    monkeypatch.setattr(via_host_mod, "NATIVE_PIPELINE_MIN", 256 << 10)  # (a rank's part)
    monkeypatch.setattr(FakeStaging, "signalled", copies == "pieces")
    size = 300_000
    comms = await _native_pair(size)
    task = asyncio.ensure_future(comms[0].all_reduce(FakeDevArray(np.ones(size, np.float32))))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    t = asyncio.get_running_loop().time()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.get_running_loop().time() - t < 2
    with pytest.raises(acoll.AcollError, match="cancel"):
        await comms[1].all_reduce(FakeDevArray(np.ones(size, np.float32)))
    await asyncio.sleep(0.01)
    assert _released(comms)
    for c in comms:
        c.abort()
    uid = acoll.get_unique_id(ifname="=lo")
    fresh = await asyncio.gather(*(acoll.init_rank(2, uid, r, device=0, ifname="=lo",
                                                   timeout=20) for r in range(2)))
    xs = [FakeDevArray(np.full(size, r + 1, np.float32)) for r in range(2)]
    await asyncio.gather(*(c.all_reduce(x) for c, x in zip(fresh, xs, strict=True)))
    for x in xs:
        np.testing.assert_array_equal(x.arr, 3)
    await asyncio.gather(*(c.close() for c in fresh))
    assert len(native_runs) >= 5


async def test_a_cancelled_wait_closed_ends_while_a_send_waits_for_its_copy() -> None:
    """wait_closed waits for the sends still queued behind their copies; a caller that is
    cancelled meanwhile ends at once (its cancellation used to be swallowed there)."""
    class NeverFence:
        def done(self) -> bool:
            return False

        async def wait(self) -> None:
            await asyncio.Event().wait()

    class Staging:
        kind = MemoryKind.CUDA

        def lease(self, nbytes: int) -> tuple[Any, Any]:
            return host_buffer(np.zeros(nbytes, np.uint8)), None

        def download(self, host: Any, buf: Any) -> NeverFence:
            return NeverFence()

        def release(self, block: Any, fence: Any = None) -> None:
            pass

    class Inner:
        max_inflight = 4
        failed = None
        aborted = False

        def set_failure_callback(self, callback: Any) -> None:
            pass

        def abort(self) -> None:
            self.aborted = True

        async def wait_closed(self) -> None:
            pass

    class DeviceBuffer:
        kind = MemoryKind.CUDA
        nbytes = 16

    conn = StagedConnection(Inner(), Staging())  # type: ignore[arg-type]
    sent = conn.isend(DeviceBuffer(), 1, b"")  # type: ignore[arg-type]
    closing = asyncio.ensure_future(conn.wait_closed())
    await asyncio.sleep(0.05)
    assert not closing.done()  # (waiting for the queued send)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 5)
    conn.abort()
    with pytest.raises(ConnectionLost):
        await sent
    await asyncio.wait_for(conn.wait_closed(), 5)
