"""InprocTransport: the conformance battery (default eager limit, and every early message
held by reference), plus its own rules: eager vs rendezvous, bounded copies, an orderly
close turning held references into copies, handles and settings."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator

import pytest

from acoll._memory import host_buffer
from acoll._transport import inproc
from acoll._transport.base import ConnectionLost, MessageSizeError, PeerInfo
from acoll._transport.inproc import InprocConnection, InprocTransport, make_inproc
from acoll.errors import ProtocolError, TransportError
from acoll.errors import TimeoutError as AcollTimeoutError
from transport_conformance import (
    DEADLINE,
    FailureRecorder,
    Pair,
    TransportConformance,
    TransportHarness,
    connect_pair,
    meta_for,
    payload,
    within,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
MiB = 1 << 20


def _harness(name: str, eager: int) -> TransportHarness:
    return TransportHarness(name, lambda: InprocTransport(key=KEY, eager=eager),
                            stranger=lambda: InprocTransport(key=OTHER_KEY, eager=eager),
                            rendezvous=eager)


HARNESSES = [_harness("eager64k", 64 << 10), _harness("eager0", 0)]


@pytest.fixture(params=HARNESSES, ids=str)
def harness(request: pytest.FixtureRequest) -> TransportHarness:
    return request.param  # type: ignore[no-any-return]


class TestInprocConformance(TransportConformance):
    """The shared battery, in process."""


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await connect_pair(HARNESSES[0])
    try:
        yield p
    finally:
        await p.aclose()


def _conns(p: Pair) -> tuple[InprocConnection, InprocConnection]:
    assert isinstance(p.a, InprocConnection)
    assert isinstance(p.b, InprocConnection)
    return p.a, p.b


async def _steps(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ eager vs rendezvous
async def test_small_early_message_is_copied_and_its_send_completes(pair: Pair) -> None:
    arrivals: list[tuple[int, bytes]] = []
    pair.b.set_arrival_callback(lambda tag, meta: arrivals.append((tag, meta)))
    data = bytearray(payload(64 << 10, 1))
    sfut = pair.a.isend(host_buffer(data), 1, meta_for(1))
    assert sfut.done()  # eager: done at once, no receive needed
    data[:] = bytes(len(data))  # the sender may reuse its buffer: a copy was kept
    out = bytearray(len(data))
    assert await within(pair.b.irecv(host_buffer(out), 1)) == meta_for(1)
    assert out == payload(64 << 10, 1)
    await _steps(2)
    assert arrivals == [(1, meta_for(1))]


async def test_large_early_message_is_held_by_reference(pair: Pair,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    stored: list[int] = []
    real = inproc._storage
    monkeypatch.setattr(inproc, "_storage", lambda n: stored.append(n) or real(n))
    arrivals: list[int] = []
    pair.b.set_arrival_callback(lambda tag, _meta: arrivals.append(tag))
    data = bytearray(payload((64 << 10) + 1, 2))
    sfut = pair.a.isend(host_buffer(data), 2, meta_for(2))
    await _steps(5)
    assert not sfut.done()  # rendezvous: the send waits for the receiver
    assert arrivals == [2]
    data[0] ^= 0xFF  # (a caller bug, here to show that nothing was copied yet)
    out = bytearray(len(data))
    assert await within(pair.b.irecv(host_buffer(out), 2)) == meta_for(2)
    await within(sfut)
    assert out == data
    assert stored == []  # straight from the sender's buffer into the receive


async def test_posted_receive_is_filled_directly(pair: Pair) -> None:
    data = payload(3 * MiB, 3)
    out = bytearray(len(data))
    rfut = pair.b.irecv(host_buffer(out), 3)
    sfut = pair.a.isend(host_buffer(data), 3, meta_for(3))
    assert await within(rfut) == meta_for(3)
    await within(sfut)
    assert out == data


async def test_size_mismatch_of_held_message_frees_the_sender(pair: Pair) -> None:
    sfut = pair.a.isend(host_buffer(payload(MiB, 4)), 4, meta_for(4))
    await _steps(2)
    assert not sfut.done()
    with pytest.raises(MessageSizeError) as info:
        await within(pair.b.irecv(host_buffer(bytearray(10)), 4))
    assert (info.value.expected, info.value.got) == (10, MiB)
    await within(sfut)  # dropped: the sender's buffer is free


async def test_tag_reused_before_receive_fails_that_send(pair: Pair) -> None:
    await within(pair.a.isend(host_buffer(b"one"), 5, meta_for(5)))
    with pytest.raises(ProtocolError, match="before the previous message"):
        await within(pair.a.isend(host_buffer(b"two"), 5, meta_for(5)))
    out = bytearray(3)
    await within(pair.b.irecv(host_buffer(out), 5))
    assert out == b"one"
    assert pair.a.failed is None


# ------------------------------------------------------------------ bounded copies
async def test_large_copy_is_bounded_per_loop_step(pair: Pair,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB message is copied in 256 KiB pieces, one per loop step: the loop keeps
    turning (a ticker runs in between) and no step copies more than one piece."""
    _a, b = _conns(pair)
    pieces: list[int] = []
    cpu: list[int] = []
    real_pump = InprocConnection._pump

    def pump(self: InprocConnection) -> None:
        before = sum(job.pos for job in self._jobs)
        t0 = time.thread_time_ns()
        real_pump(self)
        cpu.append(time.thread_time_ns() - t0)
        pieces.append(before)

    monkeypatch.setattr(InprocConnection, "_pump", pump)
    n = 64 * MiB
    data = bytearray(n)
    data[-1] = 7
    out = bytearray(n)
    ticks = 0
    rfut = b.irecv(host_buffer(out), 1)
    sfut = pair.a.isend(host_buffer(data), 1, meta_for(1))
    while not rfut.done():
        ticks += 1
        await asyncio.sleep(0)
    await within(sfut)
    assert out[-1] == 7
    assert len(cpu) >= n // inproc._SLICE
    assert ticks >= n // inproc._SLICE - 1
    cpu.sort()
    # 256 KiB of memcpy is some 20-100 us; allow for a loaded machine, but not 64 MiB
    assert cpu[len(cpu) // 2] < 2_000_000, f"median step {cpu[len(cpu) // 2]} ns"


async def test_small_message_does_not_wait_behind_a_large_one(pair: Pair) -> None:
    big = bytearray(64 * MiB)
    small = payload(MiB, 6)
    out_big, out_small = bytearray(len(big)), bytearray(len(small))
    rbig = pair.b.irecv(host_buffer(out_big), 1)
    sbig = pair.a.isend(host_buffer(big), 1, meta_for(1))
    rsmall = pair.b.irecv(host_buffer(out_small), 2)
    ssmall = pair.a.isend(host_buffer(small), 2, meta_for(2))
    await within(rsmall)
    assert not rbig.done()  # round robin: the small one finished first
    await within(asyncio.gather(rbig, sbig, ssmall))
    assert out_small == small


# ------------------------------------------------------------------ close and abort
async def test_orderly_close_turns_held_references_into_copies(pair: Pair) -> None:
    rec = FailureRecorder()
    pair.b.set_failure_callback(rec)
    data = bytearray(payload(4 * MiB, 7))
    sfut = pair.a.isend(host_buffer(data), 7, meta_for(7))
    await _steps(2)
    assert not sfut.done()
    pair.a.close(notice=b"bye")
    await within(sfut)  # copied into storage: the sender's buffer is free ...
    await within(rec.event.wait())  # ... then the peer learns of the close
    assert rec.calls[0].orderly
    assert rec.calls[0].notice == b"bye"
    data[:] = bytes(len(data))
    out = bytearray(4 * MiB)
    assert await within(pair.b.irecv(host_buffer(out), 7)) == meta_for(7)
    assert out == payload(4 * MiB, 7)
    await within(pair.a.wait_closed())


async def test_close_drop_queued_fails_held_sends(pair: Pair) -> None:
    rec = FailureRecorder()
    pair.b.set_failure_callback(rec)
    await within(pair.a.isend(host_buffer(b"small"), 1, meta_for(1)))  # eager: delivered
    held = pair.a.isend(host_buffer(payload(MiB, 2)), 2, meta_for(2))
    pair.a.close(notice=b"failed", drop_queued=True)
    await asyncio.sleep(0)
    assert held.done()
    assert isinstance(held.exception(), ConnectionLost)
    await within(rec.event.wait())
    assert rec.calls[0].notice == b"failed"
    out = bytearray(5)
    assert await within(pair.b.irecv(host_buffer(out), 1)) == meta_for(1)
    assert out == b"small"
    with pytest.raises(ConnectionLost):  # withdrawn: never delivered
        await within(pair.b.irecv(host_buffer(bytearray(MiB)), 2))


async def test_abort_while_the_receiver_copies(pair: Pair) -> None:
    rec = FailureRecorder()
    pair.b.set_failure_callback(rec)
    data = bytearray(64 * MiB)
    out = bytearray(len(data))
    rfut = pair.b.irecv(host_buffer(out), 1)
    sfut = pair.a.isend(host_buffer(data), 1, meta_for(1))
    await _steps(3)
    assert not rfut.done()
    pair.a.abort()
    assert sfut.done()
    assert isinstance(sfut.exception(), ConnectionLost)
    with pytest.raises(ConnectionLost) as info:
        await within(rfut)
    assert not info.value.orderly
    await within(rec.event.wait())
    await _steps(3)
    assert len(rec.calls) == 1
    assert not rec.calls[0].orderly


async def test_failure_callback_error_does_not_reach_the_loop(pair: Pair) -> None:
    def broken(_exc: ConnectionLost) -> None:
        raise RuntimeError("callback bug")

    pair.b.set_failure_callback(broken)
    pair.a.abort()
    await _steps(3)  # logged; the loop guard fails the test if it reached the loop
    assert pair.b.failed is not None


# ------------------------------------------------------------------ handles and selection
def _info(proc: bytes, loop: int, handle: bytes) -> PeerInfo:
    return PeerInfo(rank=0, host_hash=1, proc=proc, loop=loop, pid=1,
                    handles={"inproc": handle})


async def test_can_connect_only_same_process_and_loop() -> None:
    t = InprocTransport(key=KEY)
    l1, l2 = await t.listen(), await t.listen()
    try:
        loop = id(asyncio.get_running_loop())
        me, peer = _info(b"p", loop, l1.handle), _info(b"p", loop, l2.handle)
        assert t.can_connect(me, peer)
        assert t.can_connect(peer, me)
        assert not t.can_connect(me, _info(b"q", loop, l2.handle))  # another process
        assert not t.can_connect(me, _info(b"p", loop + 1, l2.handle))  # another loop
        forged = l2.handle[:4] + bytes(16) + l2.handle[20:]  # another process's handle
        assert not t.can_connect(me, _info(b"p", loop, forged))
        assert not t.can_connect(me, _info(b"p", loop, b"x"))
    finally:
        l1.close()
        l2.close()


async def test_connect_refuses_foreign_and_bad_handles() -> None:
    t = InprocTransport(key=KEY)
    listener = await t.listen()
    deadline = asyncio.get_running_loop().time() + DEADLINE
    try:
        other_process = listener.handle[:4] + bytes(16) + listener.handle[20:]
        other_loop = listener.handle[:20] + bytes(8) + listener.handle[28:]
        for handle in (other_process, other_loop):
            with pytest.raises(TransportError, match="another process or event loop"):
                await t.connect(handle, b"", deadline)
        with pytest.raises(ProtocolError, match="bad inproc handle"):
            await t.connect(b"ACTC", b"", deadline)
        unknown = listener.handle[:28] + bytes(16)
        with pytest.raises(TransportError, match="no inproc listener"):
            await t.connect(unknown, b"", deadline)
        with pytest.raises(AcollTimeoutError):
            await t.connect(listener.handle, b"",
                            asyncio.get_running_loop().time() - 1)
    finally:
        listener.close()


async def test_fork_renews_the_process_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    t = InprocTransport(key=KEY)
    listener = await t.listen()
    before = inproc._process
    monkeypatch.setattr(inproc, "_process", before)  # both restored after the test
    monkeypatch.setattr(inproc, "_listeners", weakref.WeakValueDictionary(inproc._listeners))
    try:
        inproc._forked()  # what a forked child runs
        assert inproc._process != before
        assert len(inproc._listeners) == 0
        with pytest.raises(TransportError):  # the parent's listener is not reachable
            await t.connect(listener.handle, b"",
                            asyncio.get_running_loop().time() + DEADLINE)
    finally:
        monkeypatch.undo()
        listener.close()


def test_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_inproc(timeout=1.0, key=KEY), InprocTransport)
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    assert make_inproc(timeout=1.0, key=KEY) is None
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "0")
    monkeypatch.setenv("ACOLL_INPROC_EAGER", "4K")
    assert InprocTransport(key=KEY).eager == 4096
    assert InprocTransport(key=KEY, eager=10).eager == 10
    with pytest.raises(ValueError, match="key"):
        InprocTransport(key=b"short")
