"""A conformance battery every :class:`acoll._transport.base.Transport` must pass.

In the spirit of trio's ``check_two_way_stream``: the checks below know nothing about
sockets, verbs or GPUs, only the contracts written in ``acoll/_transport/base.py``. A
transport's test module provides a ``harness`` fixture (a :class:`TransportHarness`, usually
parametrised over configurations) and subclasses :class:`TransportConformance`::

    @pytest.fixture(params=[...])
    def harness(request) -> TransportHarness:
        return request.param

    class TestMyTransport(TransportConformance):
        pass

Every await is bounded (``within``) so that a broken transport fails fast instead of
hanging until pytest-timeout kills the run.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest

from acoll._memory import Buffer, host_buffer
from acoll._transport.base import (
    META_SIZE,
    Connection,
    ConnectionLost,
    Listener,
    MessageSizeError,
    Transport,
)
from acoll.errors import AcollError, ClosedError, TransportError

__all__ = ["DEADLINE", "FailureRecorder", "GarbageCase", "Pair", "TransportConformance",
           "TransportHarness", "backlog_messages", "connect_pair", "exchange", "meta_for",
           "payload", "within"]

T = TypeVar("T")

#: Seconds any single wait in the battery may take before the test fails.
DEADLINE = 10.0
MiB = 1 << 20


async def within(aw: Awaitable[T], timeout: float = DEADLINE) -> T:
    """Await ``aw`` for at most ``timeout`` seconds.

    Futures are shielded: a timeout must not cancel a posted operation (transports do not
    support that), it only fails the test.
    """
    if isinstance(aw, asyncio.Future):
        aw = asyncio.shield(aw)
    return await asyncio.wait_for(aw, timeout)


def payload(size: int, seed: int) -> bytearray:
    """``size`` pseudo-random bytes, reproducible from ``seed``."""
    return bytearray(np.random.default_rng(seed).bytes(size))


def meta_for(n: int) -> bytes:
    """A distinct 16-byte meta for message ``n``."""
    return n.to_bytes(8, "little") + bytes(range(8))


#: An attack on a listener: given its handle, connect without the transport's client, send
#: something that is not a valid connection, and return once the listener has turned it
#: away (for socket transports: once the listener closed the raw connection).
GarbageCase = Callable[[bytes], Awaitable[None]]


@dataclass
class TransportHarness:
    """How the battery builds one configuration of a transport.

    Attributes:
        id: the name of this configuration in test ids.
        make: builds a transport (called once per endpoint, so two per connection).
        garbage: named attacks on a listener (see :data:`GarbageCase`); the battery checks
            each is refused and that a good connection still works after them.
        large: the largest message size the battery sends.
        stranger: builds a transport of the same kind holding another job's key.
        rendezvous: sends of more bytes than this may complete only once the peer posted
            the matching receive (the message is handed over, not buffered); ``None``:
            every send completes without one. The battery never waits for such a send
            before posting its receive.
        buffer: how the battery makes a :class:`~acoll._memory.Buffer` of its bytes
            (bytearrays, NumPy arrays): host memory by default; a transport that moves
            device memory runs the battery with device buffers over the same bytes.
    """

    id: str
    make: Callable[[], Transport]
    garbage: Mapping[str, GarbageCase] = field(default_factory=dict)
    large: int = 16 * MiB
    stranger: Callable[[], Transport] | None = None
    rendezvous: int | None = None
    buffer: Callable[[Any], Buffer] = host_buffer

    def __str__(self) -> str:
        return self.id

    def buffered(self, nbytes: int) -> bool:
        """Whether a send of ``nbytes`` completes before the peer posts its receive."""
        return self.rendezvous is None or nbytes <= self.rendezvous


@dataclass
class Pair:
    """Two connected endpoints: ``a`` connected to ``b``'s listener."""

    a: Connection
    b: Connection
    hello: bytes

    async def aclose(self) -> None:
        for conn in (self.a, self.b):
            conn.abort()
        for conn in (self.a, self.b):
            await within(conn.wait_closed())


async def connect_pair(harness: TransportHarness, hello: bytes = b"hi",
                       listener: Listener | None = None) -> Pair:
    """Connect two fresh endpoints (or a fresh one to ``listener``)."""
    loop = asyncio.get_running_loop()
    own = listener is None
    if listener is None:
        listener = await within(harness.make().listen())
    try:
        accept = asyncio.ensure_future(listener.accept())
        try:
            a = await within(harness.make().connect(listener.handle, hello,
                                                    loop.time() + DEADLINE))
        except BaseException:
            accept.cancel()
            raise
        got_hello, b = await within(accept)
    finally:
        if own:
            listener.close()
    return Pair(a, b, got_hello)


async def exchange(src: Connection, dst: Connection, data: bytes | bytearray, tag: int,
                   meta: bytes, *, post_first: bool,
                   harness: TransportHarness | None = None) -> bytes:
    """Send ``data`` from ``src`` to ``dst``; check it arrived intact; return the meta.

    Not ``post_first``: the receive is posted once the send completed (when ``harness``
    says it completes on its own) and the message had time to arrive.
    """
    out = bytearray(len(data))
    wrap = harness.buffer if harness is not None else host_buffer
    if post_first:
        rfut = dst.irecv(wrap(out), tag)
        sfut = src.isend(wrap(data), tag, meta)
    else:
        sfut = src.isend(wrap(data), tag, meta)
        if harness is None or harness.buffered(len(data)):
            await within(sfut)
        await asyncio.sleep(0.01)  # let it arrive before the receive is posted
        rfut = dst.irecv(wrap(out), tag)
    got_meta = await within(rfut)
    await within(sfut)
    assert out == data
    return got_meta


class FailureRecorder:
    """A failure callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[ConnectionLost] = []
        self.event = asyncio.Event()

    def __call__(self, exc: ConnectionLost) -> None:
        self.calls.append(exc)
        self.event.set()


def backlog_messages(count: int, base: int = 10_000) -> list[tuple[int, bytearray]]:
    """Messages of uneven sizes (tiny, 64 KiB, 64 KiB, ...): on a transport that spreads
    messages over several channels, some channels lag far behind the others."""
    return [(base + i, payload(1 if i % 3 == 0 else 64 << 10, base + i)) for i in range(count)]


SIZES = [0, 1, 4095, MiB + 7, "large"]


class TransportConformance:
    """The battery. Requires a ``harness`` fixture giving a :class:`TransportHarness`."""

    @pytest.fixture
    async def pair(self, harness: TransportHarness) -> AsyncIterator[Pair]:
        p = await connect_pair(harness)
        try:
            yield p
        finally:
            await p.aclose()

    # -------------------------------------------------------------- establishment
    @pytest.mark.parametrize("hello", [b"", b"hello", bytes(range(256)) * 16])
    async def test_connect_accept_hello(self, harness: TransportHarness, hello: bytes) -> None:
        p = await connect_pair(harness, hello)
        try:
            assert p.hello == hello
            assert p.a.failed is None
            assert p.b.failed is None
            assert await exchange(p.a, p.b, b"ping", 1, meta_for(1), post_first=True,
                                  harness=harness) == meta_for(1)
            assert await exchange(p.b, p.a, b"pong", 1, meta_for(2), post_first=True,
                                  harness=harness) == meta_for(2)
        finally:
            await p.aclose()

    async def test_several_connections_one_listener(self, harness: TransportHarness) -> None:
        listener = await within(harness.make().listen())
        pairs: list[Pair] = []
        try:
            for i in range(4):
                pairs.append(await connect_pair(harness, f"c{i}".encode(), listener))
            assert [p.hello for p in pairs] == [b"c0", b"c1", b"c2", b"c3"]
            for i, p in enumerate(pairs):
                data = payload(1000 + i, i)
                await exchange(p.a, p.b, data, 7, meta_for(i), post_first=bool(i % 2),
                               harness=harness)
        finally:
            listener.close()
            for p in pairs:
                await p.aclose()

    async def test_connect_to_closed_listener(self, harness: TransportHarness) -> None:
        listener = await within(harness.make().listen())
        handle = listener.handle
        listener.close()
        loop = asyncio.get_running_loop()
        start = loop.time()
        connect = harness.make().connect(handle, b"x", start + 5.0)
        with pytest.raises(TransportError):
            await within(connect, 8.0)
        assert loop.time() - start < 6.0

    async def test_listener_close_fails_accept(self, harness: TransportHarness) -> None:
        listener = await within(harness.make().listen())
        waiters = [asyncio.ensure_future(listener.accept()) for _ in range(2)]
        await asyncio.sleep(0.01)
        listener.close()
        for waiter in waiters:
            with pytest.raises(ClosedError):
                await within(waiter)
        with pytest.raises(ClosedError):
            await within(listener.accept())
        listener.close()  # idempotent

    async def test_listener_close_keeps_accepted(self, harness: TransportHarness) -> None:
        listener = await within(harness.make().listen())
        p = await connect_pair(harness, b"h", listener)
        listener.close()
        try:
            await exchange(p.a, p.b, payload(5000, 1), 3, meta_for(3), post_first=True,
                           harness=harness)
        finally:
            await p.aclose()

    async def test_garbage_connections_refused(self, harness: TransportHarness) -> None:
        if not harness.garbage:
            pytest.skip(f"{harness.id} defines no garbage connections")
        listener = await within(harness.make().listen())
        try:
            for name, attack in harness.garbage.items():
                try:
                    await within(attack(listener.handle))
                except TimeoutError:  # pragma: no cover - reported below
                    pytest.fail(f"garbage connection {name!r} was not refused")
            good = await connect_pair(harness, b"good", listener)
            try:
                assert good.hello == b"good"
                await exchange(good.a, good.b, payload(3000, 2), 1, meta_for(1),
                               post_first=True, harness=harness)
            finally:
                await good.aclose()
        finally:
            listener.close()

    async def test_stranger_refused_both_ways(self, harness: TransportHarness) -> None:
        """A connector without the job's key gets no connection, a listener without it
        is not trusted by connectors, and the real listener keeps working."""
        if harness.stranger is None:
            pytest.skip(f"{harness.id} defines no stranger transport")
        loop = asyncio.get_running_loop()
        listener = await within(harness.make().listen())
        alien = await within(harness.stranger().listen())
        try:
            accepted = asyncio.ensure_future(listener.accept())
            with pytest.raises(AcollError):
                await within(harness.stranger().connect(listener.handle, b"x",
                                                        loop.time() + DEADLINE))
            with pytest.raises(AcollError):
                await within(harness.make().connect(alien.handle, b"x",
                                                    loop.time() + DEADLINE))
            await asyncio.sleep(0.05)
            assert not accepted.done(), "a stranger's connection was accepted"
            accepted.cancel()
            good = await connect_pair(harness, b"good", listener)
            await good.aclose()
        finally:
            listener.close()
            alien.close()

    # -------------------------------------------------------------- messages
    @pytest.mark.parametrize("post_first", [True, False], ids=["posted", "unexpected"])
    @pytest.mark.parametrize("size", SIZES)
    async def test_sizes(self, harness: TransportHarness, pair: Pair, size: int | str,
                         post_first: bool) -> None:
        n = harness.large if size == "large" else int(size)
        data = payload(n, n)
        meta = bytes(range(100, 100 + META_SIZE))
        assert await exchange(pair.a, pair.b, data, 42, meta, post_first=post_first,
                              harness=harness) == meta
        # and the other way, under the same tag
        assert await exchange(pair.b, pair.a, data, 42, meta, post_first=post_first,
                              harness=harness) == meta

    async def test_meta_and_tag_extremes(self, harness: TransportHarness, pair: Pair) -> None:
        for i, tag in enumerate([0, 1, 2**32, 2**63, 2**64 - 1]):
            meta = bytes([i]) * META_SIZE
            assert await exchange(pair.a, pair.b, payload(10, i), tag, meta,
                                  post_first=bool(i % 2), harness=harness) == meta
        assert await exchange(pair.a, pair.b, b"z", 5, bytes(META_SIZE),
                              post_first=True, harness=harness) == bytes(META_SIZE)
        # the convenience wrappers
        buf = bytearray(3)
        send = asyncio.ensure_future(pair.a.send(harness.buffer(b"abc"), 9))
        assert await within(pair.b.recv(harness.buffer(buf), 9)) == bytes(META_SIZE)
        await within(send)
        assert buf == b"abc"

    async def test_tag_reuse_after_receive(self, harness: TransportHarness,
                                           pair: Pair) -> None:
        for i in range(20):
            await exchange(pair.a, pair.b, payload(100 + i, i), 77, meta_for(i),
                           post_first=bool(i % 2), harness=harness)

    async def test_out_of_order_tags(self, harness: TransportHarness, pair: Pair) -> None:
        sizes = [0, 1, 17, 4096, 70_000, MiB + 3, 3 * MiB]
        msgs = [(1000 + i, payload(sizes[i % len(sizes)], i)) for i in range(40)]
        # a few posted before anything is sent (zero-copy path) ...
        outs = {tag: bytearray(len(data)) for tag, data in msgs}
        early = {tag: pair.b.irecv(harness.buffer(outs[tag]), tag) for tag, _ in msgs[::7]}
        sends = [pair.a.isend(harness.buffer(data), tag, meta_for(tag)) for tag, data in msgs]
        await within(asyncio.gather(*[sfut for (tag, data), sfut in zip(msgs, sends,
                                                                         strict=True)
                                      if tag in early or harness.buffered(len(data))]))
        await asyncio.sleep(0.01)
        # ... the rest posted in reverse order, after the messages arrived
        late = {tag: pair.b.irecv(harness.buffer(outs[tag]), tag)
                for tag, _ in reversed(msgs) if tag not in early}
        futs = {**early, **late}
        for tag, data in msgs:
            assert await within(futs[tag]) == meta_for(tag)
            assert outs[tag] == data, f"message {tag} corrupted"
        await within(asyncio.gather(*sends))

    async def test_full_duplex_large(self, harness: TransportHarness, pair: Pair) -> None:
        n = harness.large
        work: list[asyncio.Future[Any]] = []
        outs: list[tuple[bytearray, bytearray]] = []
        for src, dst, base in ((pair.a, pair.b, 0), (pair.b, pair.a, 100)):
            for k in range(3):
                data = payload(n + k, base + k)
                out = bytearray(len(data))
                outs.append((data, out))
                if k == 0:  # posted first
                    work.append(dst.irecv(harness.buffer(out), base + k))
                    work.append(src.isend(harness.buffer(data), base + k, meta_for(k)))
                else:
                    work.append(src.isend(harness.buffer(data), base + k, meta_for(k)))
                    work.append(dst.irecv(harness.buffer(out), base + k))
        await within(asyncio.gather(*work), 3 * DEADLINE)
        for i, (data, out) in enumerate(outs):
            assert out == data, f"message {i} corrupted"

    async def test_many_concurrent_sends(self, harness: TransportHarness, pair: Pair) -> None:
        rng = random.Random(5)
        msgs = [(tag, payload(rng.choice([0, 1, 100, 5000, 70_000, 300_000]), tag))
                for tag in range(300)]
        outs = {tag: bytearray(len(data)) for tag, data in msgs}
        order = list(range(len(msgs)))
        rng.shuffle(order)
        recvs: dict[int, asyncio.Future[bytes]] = {}
        for i in order[:100]:
            tag = msgs[i][0]
            recvs[tag] = pair.b.irecv(harness.buffer(outs[tag]), tag)
        sends = [pair.a.isend(harness.buffer(data), tag, meta_for(tag)) for tag, data in msgs]
        for i in order[100:]:
            tag = msgs[i][0]
            recvs[tag] = pair.b.irecv(harness.buffer(outs[tag]), tag)
        await within(asyncio.gather(*sends, *recvs.values()), 3 * DEADLINE)
        for tag, data in msgs:
            assert recvs[tag].result() == meta_for(tag)
            assert outs[tag] == data, f"message {tag} corrupted"

    async def test_typed_and_2d_arrays(self, harness: TransportHarness, pair: Pair) -> None:
        src = np.arange(100_003, dtype=np.float32) * 0.5
        dst = np.zeros_like(src)
        assert (src.data.format, src.data.itemsize) == ("f", 4)
        rfut = pair.b.irecv(harness.buffer(dst), 1)
        await within(pair.a.isend(harness.buffer(src), 1, meta_for(1)))
        await within(rfut)
        np.testing.assert_array_equal(src, dst)
        # 2-D arrays and the unexpected path
        src2 = np.arange(3 * 4097, dtype=np.int64).reshape(3, 4097)
        dst2 = np.zeros_like(src2)
        assert src2.data.ndim == 2
        sfut = pair.a.isend(harness.buffer(src2), 2, meta_for(2))
        if harness.buffered(src2.nbytes):
            await within(sfut)
        await asyncio.sleep(0.01)
        await within(pair.b.irecv(harness.buffer(dst2), 2))
        await within(sfut)
        np.testing.assert_array_equal(src2, dst2)

    # -------------------------------------------------------------- size mismatch
    @pytest.mark.parametrize("post_first", [True, False], ids=["posted", "unexpected"])
    @pytest.mark.parametrize(("sent", "posted"),
                             [(100, 99), (100, 101), (0, 1), (1, 0), ("large", 4096),
                              (4096, "large")])
    async def test_size_mismatch(self, harness: TransportHarness, pair: Pair,
                                 sent: int | str, posted: int | str, post_first: bool) -> None:
        n_sent = harness.large if sent == "large" else int(sent)
        n_posted = harness.large if posted == "large" else int(posted)
        data = payload(n_sent, 1)
        out = bytearray(n_posted)
        meta = meta_for(9)
        if post_first:
            rfut = pair.b.irecv(harness.buffer(out), 9)
            sfut = pair.a.isend(harness.buffer(data), 9, meta)
            await within(sfut)
        else:
            sfut = pair.a.isend(harness.buffer(data), 9, meta)
            if harness.buffered(n_sent):
                await within(sfut)
            await asyncio.sleep(0.01)
            rfut = pair.b.irecv(harness.buffer(out), 9)
        with pytest.raises(MessageSizeError) as info:
            await within(rfut)
        await within(sfut)  # the message was dropped: the send is over
        err = info.value
        assert (err.tag, err.expected, err.got, err.meta) == (9, n_posted, n_sent, meta)
        assert str(n_sent) in str(err)
        assert str(n_posted) in str(err)
        # the connection still works, both ways, for other tags and then the same tag
        assert pair.a.failed is None
        assert pair.b.failed is None
        await exchange(pair.a, pair.b, payload(5000, 2), 10, meta_for(10), post_first=True,
                       harness=harness)
        await exchange(pair.b, pair.a, payload(5000, 3), 10, meta_for(10), post_first=False,
                       harness=harness)
        await exchange(pair.a, pair.b, payload(n_sent, 4), 9, meta_for(11), post_first=True,
                       harness=harness)

    async def test_size_mismatch_then_resend_same_tag(self, harness: TransportHarness,
                                                      pair: Pair) -> None:
        """The receiver learns the real size from the error and posts again at once.

        A backlog of other messages is in flight, so the rest of the wrong-sized message
        may still be arriving when the error is raised; the error must not be delivered
        before the message has been consumed (else its tail lands in the new receive).
        """
        n = harness.large
        backlog = backlog_messages(300)
        outs = [bytearray(len(data)) for _, data in backlog]
        brecvs = [pair.b.irecv(harness.buffer(out), tag)
                  for (tag, _), out in zip(backlog, outs, strict=True)]
        bsends = [pair.a.isend(harness.buffer(data), tag, meta_for(tag)) for tag, data in backlog]
        first, second = payload(n, 1), payload(n, 2)
        small = bytearray(4096)
        rfut = pair.b.irecv(harness.buffer(small), 5)
        sfut = pair.a.isend(harness.buffer(first), 5, meta_for(1))
        with pytest.raises(MessageSizeError) as info:
            await within(rfut)
        out = bytearray(info.value.got)
        rfut = pair.b.irecv(harness.buffer(out), 5)
        # an acknowledgement from b tells a that the first message was dealt with
        ack = bytearray(1)
        afut = pair.a.irecv(harness.buffer(ack), 6)
        await within(pair.b.isend(harness.buffer(b"!"), 6, meta_for(0)))
        await within(afut)
        await within(sfut)
        await within(pair.a.isend(harness.buffer(second), 5, meta_for(2)))
        assert await within(rfut) == meta_for(2)
        assert out == second
        await within(asyncio.gather(*bsends, *brecvs))
        assert outs == [data for _, data in backlog]

    # -------------------------------------------------------------- failures
    async def test_peer_close_with_notice(self, harness: TransportHarness, pair: Pair) -> None:
        rec = FailureRecorder()
        pair.a.set_failure_callback(rec)
        pending = pair.a.irecv(harness.buffer(bytearray(10)), 1)
        pair.b.close(notice=b"bye now")
        with pytest.raises(ConnectionLost) as info:
            await within(pending)
        assert info.value.orderly is True
        assert info.value.notice == b"bye now"
        await within(rec.event.wait())
        await asyncio.sleep(0.05)
        assert len(rec.calls) == 1
        assert rec.calls[0].orderly
        assert rec.calls[0].notice == b"bye now"
        assert pair.a.failed is not None
        assert pair.a.failed.orderly
        await within(pair.b.wait_closed())
        await within(pair.a.wait_closed())

    async def test_peer_close_without_notice(self, harness: TransportHarness, pair: Pair) -> None:
        rec = FailureRecorder()
        pair.b.set_failure_callback(rec)
        pair.a.close()
        await within(rec.event.wait())
        assert rec.calls[0].orderly is True
        assert rec.calls[0].notice == b""
        with pytest.raises(ConnectionLost) as info:
            await within(pair.b.irecv(harness.buffer(bytearray(1)), 3))
        assert info.value.orderly

    async def test_close_flushes_queued_sends(self, harness: TransportHarness,
                                              pair: Pair) -> None:
        """Sends queued before close() all arrive (into receives posted in time) before the
        peer learns of the close, whatever path each message takes."""
        msgs = [*backlog_messages(60),
                *[(1000 + i, payload(size, i)) for i, size in
                  enumerate([1, 5000, harness.large, 70_000, harness.large // 3 + 1])]]
        outs = [bytearray(len(data)) for _, data in msgs]
        rec = FailureRecorder()
        pair.b.set_failure_callback(rec)
        recvs = [pair.b.irecv(harness.buffer(out), tag)
                 for (tag, _), out in zip(msgs, outs, strict=True)]
        after = pair.b.irecv(harness.buffer(bytearray(1)), 99)
        sends = [pair.a.isend(harness.buffer(data), tag, meta_for(tag)) for tag, data in msgs]
        pair.a.close(notice=b"done")
        assert await within(asyncio.gather(*recvs)) == [meta_for(tag) for tag, _ in msgs]
        for (tag, data), out in zip(msgs, outs, strict=True):
            assert out == data, f"message {tag} corrupted"
        await within(asyncio.gather(*sends))
        with pytest.raises(ConnectionLost) as info:
            await within(after)
        assert info.value.orderly
        assert info.value.notice == b"done"
        await within(rec.event.wait())
        assert rec.calls[0].orderly
        assert rec.calls[0].notice == b"done"
        await within(pair.a.wait_closed())
        await within(pair.b.wait_closed())

    async def test_messages_before_close_delivered_to_posted(self, harness: TransportHarness,
                                                             pair: Pair) -> None:
        data = payload(harness.large, 3)
        out = bytearray(len(data))
        rfut = pair.b.irecv(harness.buffer(out), 1)
        after = pair.b.irecv(harness.buffer(bytearray(1)), 2)
        await within(pair.a.isend(harness.buffer(data), 1, meta_for(1)))
        pair.a.close(notice=b"n")
        assert await within(rfut) == meta_for(1)
        assert out == data
        with pytest.raises(ConnectionLost) as info:
            await within(after)
        assert info.value.orderly
        assert info.value.notice == b"n"

    async def test_messages_before_close_receivable_after_it(self, harness: TransportHarness,
                                                             pair: Pair) -> None:
        """A message that arrived before the peer's orderly close, with no receive posted
        yet, is still delivered to a receive posted after the close."""
        rec = FailureRecorder()
        pair.b.set_failure_callback(rec)
        sfut = pair.a.isend(harness.buffer(b"early"), 5, meta_for(5))
        if harness.buffered(5):
            await within(sfut)
        await asyncio.sleep(0.01)
        pair.a.close()
        await within(sfut)  # the close flushes it
        await within(rec.event.wait())
        out = bytearray(5)
        assert await within(pair.b.irecv(harness.buffer(out), 5)) == meta_for(5)
        assert out == b"early"
        with pytest.raises(ConnectionLost):
            await within(pair.b.irecv(harness.buffer(bytearray(5)), 6))

    async def test_receive_of_arrived_message_survives_peer_close(
            self, harness: TransportHarness, pair: Pair) -> None:
        """A receive posted for a large message that had arrived is not failed by the
        peer's orderly close coming while the message is being copied into it."""
        data = payload(harness.large, 4)
        sfut = pair.a.isend(harness.buffer(data), 1, meta_for(1))
        if harness.buffered(len(data)):
            await within(sfut)
        await asyncio.sleep(0.2)  # let it arrive whole
        out = bytearray(len(data))
        rfut = pair.b.irecv(harness.buffer(out), 1)
        pair.a.close(notice=b"n")
        assert await within(rfut) == meta_for(1)
        assert out == data
        await within(sfut)

    async def test_peer_abort(self, harness: TransportHarness, pair: Pair) -> None:
        rec = FailureRecorder()
        pair.a.set_failure_callback(rec)
        pending = pair.a.irecv(harness.buffer(bytearray(10)), 1)
        pending_big = pair.a.irecv(harness.buffer(bytearray(MiB)), 2)
        pair.b.abort()
        for fut in (pending, pending_big):
            with pytest.raises(ConnectionLost) as info:
                await within(fut)
            assert info.value.orderly is False
        await within(rec.event.wait())
        await asyncio.sleep(0.05)
        assert len(rec.calls) == 1
        assert rec.calls[0].orderly is False
        assert pair.a.failed is rec.calls[0]

    async def test_peer_abort_mid_message(self, harness: TransportHarness, pair: Pair) -> None:
        rec = FailureRecorder()
        pair.a.set_failure_callback(rec)
        data = payload(harness.large, 1)
        out = bytearray(harness.large)
        pending = pair.a.irecv(harness.buffer(out), 1)
        # a large send that usually cannot leave the machine before the abort drops it
        sfut = pair.b.isend(harness.buffer(data), 1, meta_for(1))
        pair.b.abort()
        await asyncio.sleep(0)
        if not sfut.done():  # a send thread was writing it: it settles when that returns
            await within(asyncio.wait([sfut]))
        assert sfut.done()
        send_failed = sfut.exception() is not None
        if send_failed:
            assert isinstance(sfut.exception(), ConnectionLost)
            with pytest.raises(ConnectionLost) as info:
                await within(pending)
            assert not info.value.orderly
        else:  # it all went out synchronously: it may arrive, or be cut by the abort
            [outcome] = await within(asyncio.gather(pending, return_exceptions=True))
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, ConnectionLost)
                assert not outcome.orderly
            else:
                assert out == data
        await within(rec.event.wait())
        await asyncio.sleep(0.02)
        assert len(rec.calls) == 1
        assert not rec.calls[0].orderly

    async def test_ops_after_failure_fail_at_once(self, harness: TransportHarness,
                                                  pair: Pair) -> None:
        rec = FailureRecorder()
        pair.a.set_failure_callback(rec)
        pair.b.close(notice=b"x")
        await within(rec.event.wait())
        sfut = pair.a.isend(harness.buffer(b"data"), 1, meta_for(1))
        rfut = pair.a.irecv(harness.buffer(bytearray(4)), 1)
        await asyncio.sleep(0)
        for fut in (sfut, rfut):
            assert fut.done()
            assert isinstance(fut.exception(), ConnectionLost)
        # a callback set after the failure is still called, once
        late = FailureRecorder()
        pair.a.set_failure_callback(late)
        await within(late.event.wait())
        await asyncio.sleep(0.02)
        assert len(late.calls) == 1
        assert len(rec.calls) == 1

    async def test_no_failure_callback_for_a_local_close(self, harness: TransportHarness,
                                                         pair: Pair) -> None:
        """The side that closes (or aborts) hears nothing: the owner asked for it; the
        peer hears of it once."""
        mine, theirs = FailureRecorder(), FailureRecorder()
        pair.a.set_failure_callback(mine)
        pair.b.set_failure_callback(theirs)
        pair.a.close(notice=b"done")
        await within(theirs.event.wait())
        await within(pair.a.wait_closed())
        pair.a.abort()
        await asyncio.sleep(0.05)
        assert mine.calls == []
        assert len(theirs.calls) == 1
        assert theirs.calls[0].orderly

    async def test_raising_failure_callback_still_ends_the_connection(
            self, harness: TransportHarness, pair: Pair) -> None:
        """A failure callback that raises does not reach the loop's exception handler and
        does not stop the connection from ending: its receives fail, it releases."""
        loop = asyncio.get_running_loop()
        seen: list[dict[str, Any]] = []
        old = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        calls: list[ConnectionLost] = []

        def bad(exc: ConnectionLost) -> None:
            calls.append(exc)
            raise RuntimeError("the owner's callback is broken")

        try:
            pair.a.set_failure_callback(bad)
            pending = pair.a.irecv(harness.buffer(bytearray(10)), 1)
            pair.b.abort()
            with pytest.raises(ConnectionLost):
                await within(pending)
            await within(pair.a.wait_closed())
            pair.a.set_failure_callback(bad)  # set after the failure: called later, once
            await asyncio.sleep(0.05)
        finally:
            loop.set_exception_handler(old)
        assert len(calls) == 2
        assert pair.a.failed is not None
        assert seen == []

    async def test_local_close(self, harness: TransportHarness, pair: Pair) -> None:
        pending = pair.a.irecv(harness.buffer(bytearray(10)), 1)
        pair.a.close()
        with pytest.raises(ConnectionLost):
            await within(pending)
        for fut in (pair.a.isend(harness.buffer(b"x"), 2, meta_for(2)),
                    pair.a.irecv(harness.buffer(bytearray(1)), 3)):
            await asyncio.sleep(0)
            assert fut.done(), "operation posted after close() did not fail at once"
            assert isinstance(fut.exception(), ConnectionLost)
        pair.a.close()
        pair.a.close(notice=b"again")
        await within(pair.a.wait_closed())
        await within(pair.a.wait_closed())
        pair.a.abort()
        assert pair.a.failed is not None
        await within(pair.b.wait_closed())

    async def test_local_abort(self, harness: TransportHarness, pair: Pair) -> None:
        pending = pair.a.irecv(harness.buffer(bytearray(10)), 1)
        pair.a.abort()
        pair.a.abort()
        with pytest.raises(ConnectionLost):
            await within(pending)
        sfut = pair.a.isend(harness.buffer(b"x"), 2, meta_for(2))
        await asyncio.sleep(0)
        assert sfut.done()
        assert isinstance(sfut.exception(), ConnectionLost)
        pair.a.close()  # after abort: no effect
        await within(pair.a.wait_closed())
        assert pair.a.failed is not None
        with pytest.raises(ConnectionLost):
            await within(pair.b.irecv(harness.buffer(bytearray(1)), 9))

    async def test_both_close_at_once(self, harness: TransportHarness, pair: Pair) -> None:
        data = payload(MiB, 1)
        sa = pair.a.isend(harness.buffer(data), 1, meta_for(1))
        sb = pair.b.isend(harness.buffer(data), 1, meta_for(1))
        pair.a.close(b"a")
        pair.b.close(b"b")
        await within(asyncio.gather(sa, sb))
        await within(pair.a.wait_closed())
        await within(pair.b.wait_closed())
