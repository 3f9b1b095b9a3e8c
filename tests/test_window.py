"""Posting windows (:mod:`acoll._transport.window`): a connection that caps operations in
flight still behaves as the transport contract says, and collectives run over it."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import acoll
from acoll._memory import host_buffer
from acoll._transport.base import Connection, Listener, Transport
from acoll._transport.tcp import TcpConnection, TcpTransport
from acoll._transport.window import WindowedConnection, windowed
from acoll.testing import run_ranks
from transport_conformance import TransportConformance, TransportHarness, connect_pair, within

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


class _CappedListener(Listener):
    def __init__(self, inner: Listener, limit: int) -> None:
        self.inner, self.limit, self.handle = inner, limit, inner.handle

    async def accept(self) -> tuple[bytes, Connection]:
        hello, conn = await self.inner.accept()
        return hello, WindowedConnection(conn, self.limit)

    def close(self, notice: bytes = b"") -> None:
        self.inner.close(notice)


class _CappedTransport(Transport):
    """TCP whose connections take at most ``limit`` operations per direction at once."""

    name = "capped"

    def __init__(self, limit: int, key: bytes = KEY) -> None:
        self.inner = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=key, timeout=1.0)
        self.limit = limit

    async def listen(self) -> Listener:
        return _CappedListener(await self.inner.listen(), self.limit)

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> Connection:
        return WindowedConnection(await self.inner.connect(handle, hello, deadline),
                                  self.limit)


@pytest.fixture(params=[1, 3], ids=lambda n: f"window{n}")
def harness(request: pytest.FixtureRequest) -> TransportHarness:
    limit = request.param
    return TransportHarness(f"window{limit}", lambda: _CappedTransport(limit),
                            stranger=lambda: _CappedTransport(limit, OTHER_KEY))


class TestWindowedConformance(TransportConformance):
    """The shared battery, on TCP behind a posting window of 1 and 3."""


async def test_window_never_exceeds_its_limit() -> None:
    harness = TransportHarness("w2", lambda: _CappedTransport(2))
    pair = await connect_pair(harness)
    try:
        a, b = pair.a, pair.b
        assert isinstance(a, WindowedConnection)
        assert isinstance(b, WindowedConnection)
        peak = 0
        real = b.inner.irecv

        def counting(buf: object, tag: int) -> asyncio.Future[bytes]:
            nonlocal peak
            peak = max(peak, b._recvs.inflight)  # counts this one already
            return real(buf, tag)  # type: ignore[arg-type]

        b._recvs.post = counting
        outs = [bytearray(8) for _ in range(20)]
        recvs = [b.irecv(host_buffer(out), i) for i, out in enumerate(outs)]
        assert b._recvs.inflight == 2
        assert len(b._recvs.queue) == 18
        sends = [a.isend(host_buffer(bytes([i]) * 8), i, bytes(16)) for i in range(20)]
        await within(asyncio.gather(*recvs, *sends))
        assert peak == 2
        assert [out[0] for out in outs] == list(range(20))
    finally:
        await pair.aclose()


async def test_uncapped_connection_is_not_wrapped() -> None:
    harness = TransportHarness("tcp", lambda: TcpTransport(("127.0.0.1", 0), socket.AF_INET,
                                                           key=KEY, timeout=1.0))
    pair = await connect_pair(harness)
    try:
        assert windowed(pair.a) is pair.a
    finally:
        await pair.aclose()


async def test_collectives_over_capped_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring algorithms post many chunks at once; with two in flight per direction they
    are queued and still finish with exact results."""
    monkeypatch.setattr(TcpConnection, "max_inflight", 2, raising=False)
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: acoll.Communicator) -> None:
        n, r = comm.size, comm.rank
        x = np.arange(50_001, dtype=np.float64) + r
        await comm.all_reduce(x)
        np.testing.assert_array_equal(x, n * np.arange(50_001) + sum(range(n)))
        out = np.empty(3 * 10_000, np.int32)
        await comm.all_gather(np.full(10_000, r, np.int32), out)
        np.testing.assert_array_equal(out, np.repeat(np.arange(3), 10_000))
        b = np.full(30_000, r, np.float32)
        await comm.broadcast(b, root=1)
        assert (b == 1).all()
        conn = await comm.connection((r + 1) % n)
        assert isinstance(conn, WindowedConnection)

    await run_ranks(3, fn)
