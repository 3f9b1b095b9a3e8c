"""ShmTransport: the conformance battery (default ring, and a small ring that every large
message wraps around many times), plus shared-memory specifics: hostile handshakes and
ring data, handles, selection and settings, wake-ups and busy-polling, cleanup (no file
in /dev/shm, no fd or mapping left), a SIGKILLed peer process, and flat memory over many
operations between two processes.

The battery runs both ends in this process (the transport works there; only
``can_connect`` keeps same-process pairs on the in-process transport)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

import acoll
from acoll import _auth
from acoll._memory import host_buffer
from acoll._transport import shm, shmring
from acoll._transport.base import ConnectionLost, PeerInfo
from acoll._transport.select import select_transports
from acoll._transport.shm import ShmConnection, ShmTransport, make_shm
from acoll.errors import InvalidUsage, ProtocolError, TransportError
from acoll.errors import TimeoutError as AcollTimeoutError
from acoll.testing import run_ranks
from collective_cases import ALL_OPS, check_all
from transport_conformance import (
    FailureRecorder,
    GarbageCase,
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
HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(bool(shm.unsupported()), reason=shm.unsupported() or "-")


def _transport(ring: int = 2 * MiB, key: bytes = KEY) -> ShmTransport:
    return ShmTransport(key=key, ring_size=ring, timeout=1.0)


def _name(handle: bytes) -> bytes:
    parsed = shm._parse_handle(handle)
    assert parsed is not None
    return parsed[1]


# ------------------------------------------------------------------ hostile handshakes
async def _raw(handle: bytes, data: bytes, *, eof: bool = False) -> socket.socket:
    """A raw connection to the listener that has sent ``data`` (then EOF if asked)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, _name(handle))
        if data:
            await loop.sock_sendall(sock, data)
        if eof:
            sock.shutdown(socket.SHUT_WR)
    except BaseException:
        sock.close()
        raise
    return sock


async def _refused(sock: socket.socket) -> None:
    """Return once the listener has closed ``sock``'s connection; close it."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                if not await loop.sock_recv(sock, 4096):
                    return
            except ConnectionResetError:
                return
    finally:
        sock.close()


def _hs(hello: bytes = b"", *, magic: bytes = shm._MAGIC, version: int = shm._VERSION,
        hello_len: int | None = None, nonce: bytes = bytes(32)) -> bytes:
    """A connector's handshake header (and hello) built by hand, without a proof."""
    size = len(hello) if hello_len is None else hello_len
    return shm._HS.pack(magic, version, nonce, size) + hello


def _one(data: bytes, *, eof: bool = False) -> GarbageCase:
    async def attack(handle: bytes) -> None:
        await _refused(await _raw(handle, data, eof=eof))

    return attack


def _proved(key: bytes, *, nonce: bytes | None = None) -> GarbageCase:
    """A connector proving ``key`` (another job's), or replaying a proof made for another
    challenge (``nonce``): refused either way, and no segment is made for it."""

    async def attack(handle: bytes) -> None:
        loop = asyncio.get_running_loop()
        sock = await _raw(handle, b"")
        try:
            _m, _v, nonce_a = shm._CHAL.unpack(
                await shm._recv_exactly(loop, sock, shm._CHAL.size))
            proof = _auth.prove(key, _auth.CONNECT, shm._CONTEXT, nonce or nonce_a,
                                bytes(32), b"")
            await loop.sock_sendall(sock, _hs() + proof)
            fds: list[int] = []
            answer = b""
            try:
                answer = await shm._recv_exactly(loop, sock, shm._ACK.size, fds)
            except ConnectionError:
                pass
            assert not fds, "a segment was handed to a stranger"
            assert answer in (b"", shm._REFUSED)
            await _refused(sock)
        finally:
            sock.close()

    return attack


GARBAGE: dict[str, GarbageCase] = {
    "http": _one(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64),
    "short-then-eof": _one(b"ACSH", eof=True),
    "bad-magic": _one(_hs(magic=b"ACTC")),
    "bad-version": _one(_hs(version=99)),
    "huge-hello": _one(_hs(hello_len=1 << 20)),
    "truncated-hello": _one(_hs(hello_len=100) + b"x" * 10, eof=True),
    "silent": _one(b""),
    "no-proof": _one(_hs() + bytes(32)),
    "wrong-key": _proved(OTHER_KEY),
    "replayed": _proved(KEY, nonce=bytes(range(32))),
}


def _harness(name: str, ring: int) -> TransportHarness:
    return TransportHarness(name, lambda: _transport(ring), GARBAGE,
                            stranger=lambda: _transport(ring, key=OTHER_KEY))


# 64 KiB: the battery's 16 MiB messages travel in 1024 parts and wrap the ring 256 times
HARNESSES = [_harness("ring2M", 2 * MiB), _harness("ring64k", 64 << 10)]


@pytest.fixture(params=HARNESSES, ids=str)
def harness(request: pytest.FixtureRequest) -> TransportHarness:
    return request.param  # type: ignore[no-any-return]


class TestShmConformance(TransportConformance):
    """The shared battery, over shared memory (both ends in this process)."""


async def _pair(ring: int = 2 * MiB) -> Pair:
    p = await connect_pair(_harness(f"ring{ring}", ring))
    assert isinstance(p.a, ShmConnection)
    assert isinstance(p.b, ShmConnection)
    return p


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await _pair()
    try:
        yield p
    finally:
        await p.aclose()


def _conns(p: Pair) -> tuple[ShmConnection, ShmConnection]:
    assert isinstance(p.a, ShmConnection)
    assert isinstance(p.b, ShmConnection)
    return p.a, p.b


# ------------------------------------------------------------------ ring mechanics
@pytest.mark.parametrize("post_first", [True, False], ids=["posted", "unexpected"])
async def test_messages_much_bigger_than_the_ring(post_first: bool) -> None:
    """A 5 MiB message through a 16 KiB ring: 1280 parts of 4 KiB, each direction."""
    p = await _pair(16 << 10)
    try:
        a, b = _conns(p)
        assert a._part == 4096
        for src, dst in ((a, b), (b, a)):
            data = payload(5 * MiB + 13, 7)
            out = bytearray(len(data))
            if post_first:
                rfut = dst.irecv(host_buffer(out), 3)
            sfut = src.isend(host_buffer(data), 3, meta_for(3))
            if not post_first:
                await within(sfut)  # written into storage on the other side, part by part
                rfut = dst.irecv(host_buffer(out), 3)
            assert await within(rfut) == meta_for(3)
            await within(sfut)
            assert out == data
        assert a._tx.head > 300 * a._tx_ring.size  # wrapped around hundreds of times
    finally:
        await p.aclose()


async def test_a_large_ring_still_writes_parts_of_at_most_1_mib() -> None:
    """Each part is one copy on the loop: a 64 MiB ring's quarter would be a 16 MiB copy
    (and a 1 GiB ring's 256 MiB); parts stay at 1 MiB and messages arrive whole."""
    p = await _pair(64 * MiB)
    try:
        a, b = _conns(p)
        assert a._part == b._part == MiB
        data = payload(5 * MiB + 13, 9)
        out = bytearray(len(data))
        rfut = b.irecv(host_buffer(out), 4)
        writes: list[int] = []
        write = a._tx.write

        def spy(tag: int, total: int, pos: int, view: memoryview, *args: object) -> bool:
            writes.append(len(view))
            return write(tag, total, pos, view, *args)  # type: ignore[arg-type]

        a._tx.write = spy  # type: ignore[method-assign]
        await within(a.isend(host_buffer(data), 4, meta_for(4)))
        assert await within(rfut) == meta_for(4)
        assert out == data
        assert max(writes) == MiB, writes
        assert len(writes) == 6, writes
    finally:
        await p.aclose()


async def test_wrap_around_with_mixed_sizes_and_tags() -> None:
    """Many messages of uneven sizes in flight at once through a small ring, received in
    a shuffled order: every record boundary lands somewhere else in the ring."""
    p = await _pair(16 << 10)
    try:
        rng = np.random.default_rng(3)
        msgs = [(tag, payload(int(rng.choice([0, 1, 63, 64, 65, 4095, 4096, 4097, 9000])),
                              tag)) for tag in range(400)]
        outs = {tag: bytearray(len(data)) for tag, data in msgs}
        order = rng.permutation(len(msgs))
        recvs = {int(i): p.b.irecv(host_buffer(outs[int(i)]), int(i)) for i in order[:200]}
        sends = [p.a.isend(host_buffer(data), tag, meta_for(tag)) for tag, data in msgs]
        await asyncio.sleep(0.01)
        for i in order[200:]:
            recvs[int(i)] = p.b.irecv(host_buffer(outs[int(i)]), int(i))
        await within(asyncio.gather(*sends, *recvs.values()))
        for tag, data in msgs:
            assert recvs[tag].result() == meta_for(tag)
            assert outs[tag] == data, f"message {tag} corrupted"
        a, _b = _conns(p)
        assert a._tx.head > 50 * a._tx_ring.size
    finally:
        await p.aclose()


async def test_payload_placed_at_source_alignment(pair: Pair) -> None:
    """Large payloads keep their source's address modulo 64 in the ring (x86 string
    copies are slow when the destination is just past the source modulo 4096)."""
    a, b = _conns(pair)
    base = np.zeros(1 << 16, np.uint8)
    seen: list[int] = []
    original = shmring.Producer.write

    def spy(self: shmring.Producer, tag: int, total: int, offset: int, view: memoryview,
            meta: bytes, pad: int = 0) -> bool:
        seen.append(pad)
        return original(self, tag, total, offset, view, meta, pad)

    shmring.Producer.write = spy  # type: ignore[method-assign]
    try:
        for shift in (0, 5, 16, 63):
            src = base[shift:shift + 8192]
            out = bytearray(8192)
            rfut = b.irecv(host_buffer(out), shift)
            await within(a.isend(host_buffer(src), shift, meta_for(1)))
            await within(rfut)
            assert out == src.tobytes()
            assert seen[-1] == src.__array_interface__["data"][0] % 64
        small = bytearray(100)
        rfut = b.irecv(host_buffer(small), 99)
        await within(a.isend(host_buffer(b"x" * 100), 99, meta_for(1)))
        await within(rfut)
        assert seen[-1] == 0  # small payloads are not padded
    finally:
        shmring.Producer.write = original  # type: ignore[method-assign]


async def test_sends_complete_once_in_the_ring(pair: Pair) -> None:
    """A send that fits completes at once, before the peer reads anything; a larger one
    completes once its last part is in the ring."""
    a, _b = _conns(pair)
    sfut = a.isend(host_buffer(bytes(1000)), 1, meta_for(1))
    assert sfut.done()
    assert sfut.exception() is None
    big = a.isend(host_buffer(bytes(4 * MiB)), 2, meta_for(2))  # twice the ring
    assert not big.done()
    await within(big)  # the other end drains it into storage from its loop callbacks


async def test_busy_poll_needs_no_wake_up(pair: Pair) -> None:
    """While the receiver polls, the sender makes no system call for it; once the
    receiver may sleep again (next loop step), a publish wakes it with one byte."""
    a, b = _conns(pair)
    wakes: list[int] = []
    original = ShmConnection._wake

    def counting(self: ShmConnection) -> None:
        wakes.append(1)
        original(self)

    ShmConnection._wake = counting  # type: ignore[method-assign]
    try:
        out = bytearray(8)
        rfut = b.irecv(host_buffer(out), 1)
        b.poll()  # b polls: its wake-up request is withdrawn until the next loop step
        a.isend(host_buffer(b"12345678"), 1, meta_for(1))
        assert not wakes
        b.poll()
        assert rfut.done()
        assert out == b"12345678"
        await asyncio.sleep(0)  # b's loop step: it renews the request
        await asyncio.sleep(0)
        rfut = b.irecv(host_buffer(out), 2)
        a.isend(host_buffer(b"abcdefgh"), 2, meta_for(2))
        assert len(wakes) == 1
        await within(rfut)
        assert out == b"abcdefgh"
    finally:
        ShmConnection._wake = original  # type: ignore[method-assign]


async def test_one_loop_step_is_bounded(pair: Pair) -> None:
    """A 64 MiB message is moved in steps of about ``_IO_NS`` each, not in one call."""
    a, b = _conns(pair)
    data = np.ones(64 * MiB, np.uint8)
    out = np.zeros_like(data)
    rfut = b.irecv(host_buffer(out), 1)
    t = time.thread_time()  # (this thread's time: not a slow machine's other processes)
    sfut = a.isend(host_buffer(data), 1, meta_for(1))
    assert time.thread_time() - t < 0.05  # the first parts only: the ring is full then
    assert not sfut.done()
    await within(asyncio.gather(sfut, rfut))
    assert (out == 1).all()


# ------------------------------------------------------------------ hostile ring data
async def _inject(conn: ShmConnection, tag: int, total: int, offset: int, data: bytes) -> None:
    """Write a record into ``conn``'s outgoing ring behind its back and wake the peer."""
    assert conn._tx.write(tag, total, offset, memoryview(data), meta_for(tag))
    conn._wake()
    await asyncio.sleep(0)


async def test_absurd_total_fails_connection(pair: Pair) -> None:
    a, b = _conns(pair)
    rec = FailureRecorder()
    b.set_failure_callback(rec)
    await _inject(a, 1, 1 << 62, 0, b"x" * 16)
    await within(rec.event.wait())
    assert "broke the protocol" in str(rec.calls[0])
    assert "ACOLL_SHM_MAX_EARLY" in str(rec.calls[0])
    with pytest.raises(ConnectionLost):
        await within(b.irecv(host_buffer(bytearray(1)), 2))


async def test_part_outside_message_fails_connection(pair: Pair) -> None:
    a, b = _conns(pair)
    pending = b.irecv(host_buffer(bytearray(16)), 1)
    await _inject(a, 1, 16, 12, b"y" * 8)
    with pytest.raises(ConnectionLost, match="exceeds message size"):
        await within(pending)


async def test_corrupt_record_fails_connection(pair: Pair) -> None:
    a, b = _conns(pair)
    pending = b.irecv(host_buffer(bytearray(4)), 1)
    pos = a._tx.head % a._tx_ring.size
    a._tx_ring.data[pos:pos + 64] = b"\xff" * 64
    a._tx.head += 64
    a._tx_ring.ctl[shmring.HEAD] = a._tx.head
    a._wake()
    with pytest.raises(ConnectionLost, match="bad record magic"):
        await within(pending)


async def test_garbage_on_control_stream_fails_connection(pair: Pair) -> None:
    a, b = _conns(pair)
    pending = b.irecv(host_buffer(bytearray(4)), 1)
    a._sock.send(b"Z")
    with pytest.raises(ConnectionLost, match="unknown frame"):
        await within(pending)


@pytest.mark.parametrize("where", ["_read", "_flush"])
async def test_bug_in_data_path_fails_connection_not_loop(
        pair: Pair, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Last resort: an exception inside a loop callback fails the connection with a clear
    message; nothing reaches the loop's exception handler (the loop guard checks)."""
    a, b = _conns(pair)
    rec = FailureRecorder()
    victim = b if where == "_read" else a
    victim.set_failure_callback(rec)
    blocker = a.isend(host_buffer(bytes(4 * MiB)), 9, meta_for(9))  # more than the ring

    def broken(*_args: object) -> None:
        raise MemoryError("simulated")

    monkeypatch.setattr(ShmConnection, where, broken)
    b._schedule()  # a loop callback of b's (reading), which wakes a (writing)
    await within(rec.event.wait())
    assert "internal error while" in str(rec.calls[0])
    assert "MemoryError('simulated')" in str(rec.calls[0])
    monkeypatch.undo()
    with pytest.raises(ConnectionLost):
        await within(blocker)


async def test_listener_out_of_memory_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    """A listener that cannot allocate a segment answers (authenticated) with no segment:
    the connector gets a TransportError saying so at once, without retrying, and the
    listener keeps working."""
    calls: list[int] = []

    def no_memory(layout: shmring.SegmentLayout) -> object:
        calls.append(layout.size)
        raise OSError(12, "Cannot allocate memory")

    lis = await _transport().listen()
    try:
        monkeypatch.setattr(shm, "_new_segment", no_memory)
        with pytest.raises(TransportError, match="could not allocate the shared segment"):
            await within(_transport().connect(lis.handle, b"x",
                                              asyncio.get_running_loop().time() + 10))
        assert len(calls) == 1
        assert "cannot make a shared segment" in caplog.text
        monkeypatch.undo()
        good = await connect_pair(_harness("after", 2 * MiB), b"ok", lis)
        await exchange_small(good)
        await good.aclose()
    finally:
        lis.close()


async def test_send_on_a_ring_the_peer_corrupted_fails_at_once(pair: Pair) -> None:
    """The consumer's position is checked before writing: a broken one fails the send
    (and the connection) instead of leaving it pending."""
    a, _b = _conns(pair)
    rec = FailureRecorder()
    a.set_failure_callback(rec)
    a._tx_ring.ctl[shmring.TAIL] = a._tx.head + 4096  # the consumer claims to be ahead
    sfut = a.isend(host_buffer(b"abc"), 1, meta_for(1))
    assert sfut.done()
    with pytest.raises(ConnectionLost, match="consumer position"):
        sfut.result()
    await within(rec.event.wait())


# ------------------------------------------------------------------ handles and selection
def _info(rank: int, *, host: int = 1, proc: bytes = b"p0", handles: dict[str, bytes]
          ) -> PeerInfo:
    return PeerInfo(rank, host, proc, 0, 100 + rank, handles)


async def test_can_connect_same_host_other_process_same_namespace() -> None:
    t = _transport()
    listeners = [await t.listen() for _ in range(2)]
    try:
        h0, h1 = (lis.handle for lis in listeners)
        other_ns = shm._HANDLE.pack(shm._MAGIC, shm._VERSION, 0, t.netns + 1, bytes(16))
        infos = {
            "me": _info(0, proc=b"A", handles={"shm": h0}),
            "other-process": _info(1, proc=b"B", handles={"shm": h1}),
            "same-process": _info(2, proc=b"A", handles={"shm": h1}),
            "other-host": _info(3, host=2, proc=b"C", handles={"shm": h1}),
            "other-netns": _info(4, proc=b"D", handles={"shm": other_ns}),
            "no-handle": _info(5, proc=b"E", handles={}),
            "bad-handle": _info(6, proc=b"F", handles={"shm": b"junk"}),
        }
        expect = {"other-process": True, "same-process": False, "other-host": False,
                  "other-netns": False, "no-handle": False, "bad-handle": False}
        for name, ok in expect.items():
            assert t.can_connect(infos["me"], infos[name]) is ok, name
        for x in infos.values():  # symmetric, whichever side asks
            for y in infos.values():
                assert t.can_connect(x, y) == t.can_connect(y, x), (x.rank, y.rank)
    finally:
        for lis in listeners:
            lis.close()


async def test_handle_format_and_bad_handles() -> None:
    t = _transport()
    lis = await t.listen()
    try:
        magic, version, lane, netns, token = shm._HANDLE.unpack(lis.handle)
        assert (magic, version, netns) == (b"ACSH", shm._VERSION, t.netns)
        assert lane * 64 == t.lane == shm.handle_lane(lis.handle)
        assert t.netns == os.stat("/proc/self/ns/net").st_ino
        assert _name(lis.handle) == b"\0acoll-shm-" + token.hex().encode()
    finally:
        lis.close()
    loop = asyncio.get_running_loop()
    for handle in (b"", b"ACIP" + bytes(28), shm._HANDLE.pack(b"ACSH", 99, 0, t.netns, token)):
        with pytest.raises(ProtocolError, match="bad shm handle"):
            await within(t.connect(handle, b"", loop.time() + 5))
    elsewhere = shm._HANDLE.pack(b"ACSH", shm._VERSION, 0, t.netns + 1, token)
    with pytest.raises(TransportError, match="network namespace"):
        await within(t.connect(elsewhere, b"", loop.time() + 5))


async def test_connect_deadline_in_the_past() -> None:
    lis = await _transport().listen()
    try:
        with pytest.raises(AcollTimeoutError):
            await within(_transport().connect(lis.handle, b"",
                                              asyncio.get_running_loop().time() - 1))
    finally:
        lis.close()


def test_settings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="acoll.NET")
    t = make_shm(timeout=5, key=KEY)
    assert isinstance(t, ShmTransport)
    assert t.capacity == 2 * MiB
    assert "NET/SHM: shared memory for ranks in other processes" in caplog.text
    monkeypatch.setenv("ACOLL_SHM_RING_SIZE", "256K")
    assert ShmTransport(key=KEY).capacity == 256 << 10
    assert ShmTransport(key=KEY, ring_size=64 << 10).capacity == 64 << 10  # argument wins
    for bad in ("1000", "8K", "2G"):
        monkeypatch.setenv("ACOLL_SHM_RING_SIZE", bad)
        with pytest.raises(InvalidUsage, match="ACOLL_SHM_RING_SIZE"):
            ShmTransport(key=KEY)
    monkeypatch.delenv("ACOLL_SHM_RING_SIZE")
    monkeypatch.setenv("ACOLL_SHM_DISABLE", "1")
    caplog.clear()
    assert make_shm(timeout=5, key=KEY) is None
    assert "disabled by ACOLL_SHM_DISABLE" in caplog.text
    names = [tr.name for tr in select_transports(("127.0.0.1", 0), socket.AF_INET,
                                                 timeout=5, key=KEY)]
    assert names == ["inproc", "socket"]
    monkeypatch.delenv("ACOLL_SHM_DISABLE")
    names = [tr.name for tr in select_transports(("127.0.0.1", 0), socket.AF_INET,
                                                 timeout=5, key=KEY)]
    assert names == ["inproc", "shm", "socket"]


def test_unsupported_platforms(monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="acoll.NET")
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")
    assert "x86-64" in shm.unsupported()
    assert make_shm(timeout=5, key=KEY) is None
    assert "NET/SHM: not used (needs x86-64" in caplog.text


# ------------------------------------------------------------------ cleanup
def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:acoll-shm" in line for line in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


async def test_nothing_left_behind() -> None:
    """No name in /dev/shm at any time (memfd), and once both ends are closed no mapping
    of a segment and no descriptor is left in this process."""
    gc.collect()  # segments of earlier tests that only the collector unmaps: not ours
    shm_before, maps_before, fds_before = _dev_shm(), _maps(), _fds()
    lis = await _transport().listen()
    pairs = [await connect_pair(_harness("c", 2 * MiB), b"x", lis) for _ in range(3)]
    assert _maps() == maps_before + 6  # each end maps the segment once; its fd is closed
    assert _dev_shm() == shm_before
    for i, p in enumerate(pairs):
        await exchange_small(p)
        if i == 0:
            p.a.close()  # orderly
            await within(p.a.wait_closed())
            await within(p.b.wait_closed())
        await p.aclose()
    lis.close()
    await asyncio.sleep(0)
    assert _maps() == maps_before
    assert _fds() == fds_before
    assert _dev_shm() == shm_before


async def exchange_small(p: Pair) -> None:
    out = bytearray(3)
    rfut = p.b.irecv(host_buffer(out), 1)
    await within(p.a.isend(host_buffer(b"abc"), 1, meta_for(1)))
    await within(rfut)
    assert out == b"abc"


# ------------------------------------------------------------------ a peer process dies
_CHILD = """
import asyncio, sys, time
from acoll._memory import host_buffer
from acoll._transport.shm import ShmTransport

async def main() -> None:
    t = ShmTransport(key=bytes.fromhex(sys.argv[2]))
    conn = await t.connect(bytes.fromhex(sys.argv[1]), b"child",
                           asyncio.get_running_loop().time() + 10)
    await conn.isend(host_buffer(bytes(3 << 20)), 1, bytes(16))
    print("sent", flush=True)
    time.sleep(60)  # its loop stands still: nothing is read from now on

asyncio.run(main())
"""


async def test_sigkilled_peer_process_fails_connection_at_once() -> None:
    """The peer process is killed while a receive waits and while this end's send waits
    for room in a full ring: both fail with ConnectionLost within a few milliseconds
    (end of file on the control socket), not after a timeout; nothing stays in /dev/shm."""
    shm_before = _dev_shm()
    lis = await _transport().listen()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, lis.handle.hex(), KEY.hex(),
        stdout=asyncio.subprocess.PIPE)
    try:
        hello, conn = await within(lis.accept())
        assert hello == b"child"
        assert isinstance(conn, ShmConnection)
        assert str(child.pid) in conn.peer
        rec = FailureRecorder()
        conn.set_failure_callback(rec)
        out = bytearray(3 << 20)
        await within(conn.irecv(host_buffer(out), 1))
        assert child.stdout is not None
        assert await within(child.stdout.readline()) == b"sent\n"
        pending = conn.irecv(host_buffer(bytearray(10)), 2)
        blocked = conn.isend(host_buffer(bytes(8 * MiB)), 3, meta_for(3))
        await asyncio.sleep(0.05)  # the child reads nothing: the ring stays full
        assert not blocked.done()
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        for fut in (pending, blocked):
            with pytest.raises(ConnectionLost, match="closed the connection unexpectedly"):
                await within(fut, 5)
        assert time.monotonic() - t0 < 4.0  # (at once, not a deadline: `within` gives 5)
        await within(rec.event.wait())
        assert not rec.calls[0].orderly
        await within(conn.wait_closed())
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        lis.close()
    if child.returncode == 255:
        # asyncio's watcher found the child already reaped by something else in this
        # test process ("Unknown child process", reported as 255): it is gone all the same
        with pytest.raises(ProcessLookupError):
            os.kill(child.pid, 0)
    else:
        assert child.returncode == -signal.SIGKILL
    assert _dev_shm() == shm_before


# ------------------------------------------------------------------ communicator level
@pytest.fixture
def shm_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of this process talk over shared memory (in-process transport off, and the
    shared-memory transport told that every pair of this host is fair game)."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setattr(ShmTransport, "can_connect",
                        lambda self, mine, theirs: mine.same_host(theirs))


@pytest.mark.parametrize("nranks", [2, 3])
async def test_full_matrix_one_loop_over_shm(nranks: int, shm_in_process: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SHM_RING_SIZE", "64K")  # 16 KiB parts: messages split
    from collective_cases import ALL_DTYPES, COUNTS

    async def fn(comm: acoll.Communicator) -> int:
        assert {comm.transport_name(p) for p in range(nranks) if p != comm.rank} == {"shm"}
        return await check_all(comm, COUNTS, ALL_DTYPES, ALL_OPS)

    results = await run_ranks(nranks, fn)
    assert len(set(results)) == 1


def test_memory_flat_over_many_ops_between_processes() -> None:
    """10,000 all-reduces (8 B to 64 KiB) and 500 of 1 MiB between two processes over
    shared memory: after a warm-up, the resident set grows by less than 1 MiB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    proc = subprocess.run(
        [sys.executable, "-m", "acoll.run", "-n", "2", "--", sys.executable,
         str(HERE / "mp_rss.py")], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if " rss " in line]
    assert len(lines) == 2, proc.stdout
    for line in lines:  # "[rank R] rank R via shm: rss +K KiB over N ops"
        assert " via shm:" in line, line
        grown = int(line.split(" rss ")[1].split(" KiB")[0])
        assert grown < 1024, line  # a leak of 100 bytes per op would show



async def test_a_listener_segment_with_a_bad_header_is_a_protocol_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 48): the connector's check of the listener's segment
    header raised BufferError (closing the mapping while a view of it was still held)
    over the ProtocolError naming the problem."""
    made = shm._new_segment

    def garbled(layout: shmring.SegmentLayout) -> tuple[int, object]:
        fd, mm = made(layout)
        mm[:8] = b"NOTACOLL"
        return fd, mm

    monkeypatch.setattr(shm, "_new_segment", garbled)
    transport = shm.ShmTransport(key=KEY, ring_size=1 << 16, timeout=2.0)
    listener = await transport.listen()
    try:
        with pytest.raises(acoll.ProtocolError, match="not an acoll shared-memory segment"):
            await transport.connect(listener.handle, b"hi", time.monotonic() + 3)
        await asyncio.sleep(0.2)
    finally:
        listener.close()
