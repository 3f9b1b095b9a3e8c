"""TcpTransport: the conformance battery (one and three sockets per connection, with a small
stripe so that messages are split across sockets), plus TCP-specific checks: hostile
handshakes on the listener, striping, handles, settings and IPv6."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest

from acoll import _auth
from acoll._memory import Buffer, host_buffer
from acoll._transport import tcp
from acoll._transport.base import ConnectionLost, MessageSizeError
from acoll._transport.matching import Matcher
from acoll._transport.tcp import TcpConnection, TcpTransport
from acoll.errors import InvalidUsage, ProtocolError
from acoll.errors import TimeoutError as AcollTimeoutError
from transport_conformance import (
    DEADLINE,
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

HANDSHAKE_TIMEOUT = 1.0  # how long the listener waits for a silent connection's handshake
KEY = bytes(range(32))  # the job's key in these tests
OTHER_KEY = bytes(range(1, 33))


def _transport(nsocks: int, stripe: int | None = None, host: str = "127.0.0.1",
               family: socket.AddressFamily = socket.AF_INET,
               key: bytes = KEY, send_threads: int = 0, split: int = -1,
               recv_threads: int = 0) -> TcpTransport:
    return TcpTransport((host, 0), family, key=key, nsocks=nsocks, stripe=stripe, bufsize=0,
                        timeout=HANDSHAKE_TIMEOUT, send_threads=send_threads, split=split,
                        recv_threads=recv_threads)


def _owned_buffer(obj: Any) -> Buffer:
    """A host buffer marked as acoll's own memory (what a space's scratch is)."""
    b = host_buffer(obj)
    b.owned = True
    return b


def _sockaddr(handle: bytes) -> tuple[socket.AddressFamily, tuple[str, int]]:
    host, port, _scope = msgpack.unpackb(handle)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, port)


def _hs(index: int = 0, nsocks: int = 1, conn_id: int = 1, hello: bytes = b"",
        *, magic: bytes = tcp._HS_MAGIC, version: int = tcp._HS_VERSION,
        hello_len: int | None = None, nonce: bytes = bytes(32)) -> bytes:
    """A connector's handshake header (and hello) built by hand, without a valid proof."""
    size = len(hello) if hello_len is None else hello_len
    return tcp._HS.pack(magic, version, index, nsocks, conn_id, nonce, size) + hello


async def _challenged(handle: bytes) -> tuple[socket.socket, bytes]:
    """A raw socket connected to the listener, and the nonce of the challenge it got."""
    loop = asyncio.get_running_loop()
    family, addr = _sockaddr(handle)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, addr)
        _m, _v, nonce_a = tcp._CHAL.unpack(await tcp._recv_exactly(loop, sock, tcp._CHAL.size))
    except BaseException:
        sock.close()
        raise
    return sock, nonce_a


async def _authed(handle: bytes, index: int, nsocks: int, conn_id: int,
                  hello: bytes = b"", key: bytes = KEY) -> socket.socket:
    """A raw socket that completed the handshake with a valid proof (a buggy insider)."""
    loop = asyncio.get_running_loop()
    sock, nonce_a = await _challenged(handle)
    try:
        nonce_c = bytes(range(100, 132))
        claims = tcp._claims(index, nsocks, conn_id, hello)
        proof = _auth.prove(key, _auth.CONNECT, tcp._CONTEXT, nonce_a, nonce_c, claims)
        await loop.sock_sendall(sock, _hs(index, nsocks, conn_id, hello, nonce=nonce_c) + proof)
        await tcp._recv_exactly(loop, sock, _auth.PROOF_SIZE)
    except BaseException:
        sock.close()
        raise
    return sock


async def _raw(handle: bytes, data: bytes, *, eof: bool = False) -> socket.socket:
    """A raw TCP connection to the listener that has sent ``data`` (then EOF if asked)."""
    loop = asyncio.get_running_loop()
    family, addr = _sockaddr(handle)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, addr)
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


def _one(data: bytes, *, eof: bool = False) -> GarbageCase:
    async def attack(handle: bytes) -> None:
        await _refused(await _raw(handle, data, eof=eof))

    return attack


def _group(first: tuple[int, int, int], second: tuple[int, int, int]) -> GarbageCase:
    """Two authenticated sockets (index, count, id) of one connection that do not fit
    together; the second must be refused."""

    async def attack(handle: bytes) -> None:
        keep = await _authed(handle, *first)
        try:
            await asyncio.sleep(0.05)  # let the listener file the first socket
            await _refused(await _authed(handle, *second))
        finally:
            keep.close()

    return attack


def _replayed() -> GarbageCase:
    """Bytes a genuine connector sent, replayed on a new socket: the nonce is stale."""

    async def attack(handle: bytes) -> None:
        first, nonce_a = await _challenged(handle)
        try:
            nonce_c = bytes(32)
            proof = _auth.prove(KEY, _auth.CONNECT, tcp._CONTEXT, nonce_a, nonce_c,
                                tcp._claims(0, 1, 9, b""))
            recorded = _hs(0, 1, 9, nonce=nonce_c) + proof
        finally:
            first.close()
        await _refused(await _raw(handle, recorded))

    return attack


def _wrong_key() -> GarbageCase:
    """A proof made with another job's key."""

    async def attack(handle: bytes) -> None:
        sock, nonce_a = await _challenged(handle)
        try:
            proof = _auth.prove(OTHER_KEY, _auth.CONNECT, tcp._CONTEXT, nonce_a, bytes(32),
                                tcp._claims(0, 1, 3, b""))
            await asyncio.get_running_loop().sock_sendall(sock, _hs(0, 1, 3) + proof)
            await _refused(sock)
        finally:
            sock.close()

    return attack


GARBAGE: dict[str, GarbageCase] = {
    "http": _one(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16),
    "short-then-eof": _one(b"ACTC", eof=True),
    "bad-magic": _one(_hs(magic=b"ACBS")),
    "bad-version": _one(_hs(version=99)),
    "index-out-of-range": _one(_hs(index=2, nsocks=2)),
    "zero-sockets": _one(_hs(index=0, nsocks=0)),
    "too-many-sockets": _one(_hs(index=0, nsocks=17)),
    "too-many-split-sockets": _one(_hs(index=0, nsocks=34 | tcp._SPLIT_FLAG)),
    "split-odd-count": _one(_hs(index=0, nsocks=3 | tcp._SPLIT_FLAG)),
    "huge-hello": _one(_hs(hello_len=1 << 20)),
    "truncated-hello": _one(_hs(hello_len=100) + b"x" * 10, eof=True),
    "silent": _one(b""),
    "no-proof": _one(_hs() + bytes(32)),
    "wrong-key": _wrong_key(),
    "replayed": _replayed(),
    "socket-count-mismatch": _group((2, 3, 7), (0, 2, 7)),
    "duplicate-index": _group((0, 2, 8), (0, 2, 8)),
    "split-flag-mismatch": _group((0, 2 | tcp._SPLIT_FLAG, 9), (1, 2, 9)),
}




def _harness(name: str, nsocks: int, stripe: int | None = None, threads: int = 0,
             split: int = -1, recv: int = 0, owned: bool = False) -> TransportHarness:
    return TransportHarness(
        name, lambda: _transport(nsocks, stripe, send_threads=threads, split=split,
                                 recv_threads=recv), GARBAGE,
        stranger=lambda: _transport(nsocks, stripe, key=OTHER_KEY, send_threads=threads,
                                    split=split, recv_threads=recv),
        buffer=_owned_buffer if owned else host_buffer)


# (send threads forced on and off: the default depends on the CPUs of the machine; with a
# send thread the sockets are split by default)
HARNESSES = [_harness("nsocks1", 1), _harness("nsocks3-stripe64k", 3, 64 << 10),
             _harness("nsocks1-sendthread", 1, threads=1),
             _harness("nsocks3-sendthread", 3, 64 << 10, threads=1),
             _harness("nsocks1-sendthread-shared", 1, threads=1, split=0),
             _harness("nsocks2-split-nothread", 2, 64 << 10, split=1),
             # receive threads: they read early messages' storage, and (owned) receives
             # posted on acoll's own memory; never a user's buffer
             _harness("nsocks1-recvthread-owned", 1, threads=1, recv=1, owned=True),
             _harness("nsocks2-recvthread-owned", 2, 64 << 10, split=1, recv=1, owned=True),
             _harness("nsocks1-recvthread-user", 1, threads=1, recv=1)]


@pytest.fixture(params=HARNESSES, ids=str)
def harness(request: pytest.FixtureRequest) -> TransportHarness:
    return request.param  # type: ignore[no-any-return]


class TestTcpConformance(TransportConformance):
    """The shared battery, on TCP."""


# ------------------------------------------------------------------ TCP specifics
async def test_striping_uses_every_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _harness("striped", 3, 4096)
    p = await connect_pair(harness)
    try:
        assert isinstance(p.a, TcpConnection)
        assert isinstance(p.b, TcpConnection)
        assert [len(p.a._socks), len(p.b._socks)] == [3, 3]
        used: list[int] = []
        original: Callable[[TcpConnection, tcp._Sock], None] = TcpConnection._flush

        def spy(self: TcpConnection, s: tcp._Sock) -> None:
            used.append(self._socks.index(s))
            original(self, s)

        monkeypatch.setattr(TcpConnection, "_flush", spy)
        data = payload(3 * 4096 * 5 + 11, 1)
        out = bytearray(len(data))
        rfut = p.b.irecv(host_buffer(out), 1)
        await within(p.a.isend(host_buffer(data), 1, meta_for(1)))
        await within(rfut)
        assert out == data
        assert set(used) == {0, 1, 2}
        # small messages are not split: one part each, spread round-robin
        used.clear()
        for tag in range(2, 8):
            await within(p.a.isend(host_buffer(b"s" * 100), tag, meta_for(tag)))
            assert await within(p.b.irecv(host_buffer(bytearray(100)), tag)) == meta_for(tag)
        assert set(used) == {0, 1, 2}
    finally:
        await p.aclose()


async def test_connector_decides_socket_count() -> None:
    listener = await within(_transport(1).listen())
    try:
        conn = await within(_transport(4, 4096).connect(
            listener.handle, b"four", asyncio.get_running_loop().time() + DEADLINE))
        hello, peer = await within(listener.accept())
        assert hello == b"four"
        assert isinstance(peer, TcpConnection)
        assert len(peer._socks) == 4
        data = payload(100_000, 3)
        out = bytearray(len(data))
        rfut = peer.irecv(host_buffer(out), 1)
        await within(conn.isend(host_buffer(data), 1, meta_for(1)))
        await within(rfut)
        assert out == data
        for c in (conn, peer):
            c.abort()
            await within(c.wait_closed())
    finally:
        listener.close()


async def test_handle_is_msgpack_address() -> None:
    listener = await within(_transport(1).listen())
    try:
        host, port, scope = msgpack.unpackb(listener.handle)
        assert (host, scope) == ("127.0.0.1", 0)
        assert 0 < port < 65536
    finally:
        listener.close()


@pytest.mark.parametrize("handle", [b"", b"\xc1", msgpack.packb([1, 2]),
                                    msgpack.packb("127.0.0.1:1")])
async def test_bad_handle(handle: bytes) -> None:
    with pytest.raises(ProtocolError, match="bad socket handle"):
        await within(_transport(1).connect(handle, b"",
                                           asyncio.get_running_loop().time() + 5))


async def test_connect_deadline_in_the_past() -> None:
    listener = await within(_transport(1).listen())
    deadline = asyncio.get_running_loop().time() - 1
    try:
        with pytest.raises(AcollTimeoutError, match="connecting to"):
            await within(_transport(1).connect(listener.handle, b"", deadline))
    finally:
        listener.close()


@pytest.mark.parametrize("nsocks", [0, 17, -1])
def test_nsocks_range(nsocks: int) -> None:
    with pytest.raises(InvalidUsage, match="NSOCKS"):
        _transport(nsocks)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_NSOCKS", "5")
    monkeypatch.setenv("ACOLL_SOCKET_STRIPE", "128K")
    t = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY)
    assert (t.nsocks, t.stripe) == (5, 128 << 10)
    # an explicit argument wins over the environment
    assert TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=2).nsocks == 2


async def _round_trip(p: Pair, size: int, seed: int) -> None:
    """``size`` bytes from ``p.a`` to ``p.b``, checked."""
    data = payload(size, seed)
    out = bytearray(len(data))
    rfut = p.b.irecv(host_buffer(out), 1)
    await within(p.a.isend(host_buffer(data), 1, meta_for(1)))
    await within(rfut)
    assert out == data


def _available_congestion() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def _congestion_of(sock: socket.socket) -> str:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


def test_unknown_congestion_control_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_CONGESTION", "no-such-algorithm")
    with pytest.raises(InvalidUsage, match="ACOLL_SOCKET_CONGESTION='no-such-algorithm'"):
        TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY)


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION") or "reno" not in
                    _available_congestion(), reason="needs Linux's TCP_CONGESTION and reno")
async def test_congestion_control_set_on_both_ends_of_every_socket() -> None:
    """ACOLL_SOCKET_CONGESTION reaches every data socket of a connection, both ends (reno:
    built into every Linux kernel and allowed to any user)."""
    def make() -> TcpTransport:
        return TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=2,
                            timeout=HANDSHAKE_TIMEOUT, send_threads=0, split=1,
                            congestion="reno")

    harness = TransportHarness("reno", make, GARBAGE, stranger=make)
    p = await connect_pair(harness)
    try:
        assert isinstance(p.a, TcpConnection)
        assert isinstance(p.b, TcpConnection)
        ends = [s.sock for c in (p.a, p.b) for s in c._socks]
        assert len(ends) == 8  # 2 sockets a direction, split, both ends
        assert {_congestion_of(s) for s in ends} == {"reno"}
        await _round_trip(p, 1 << 20, 3)
    finally:
        await p.aclose()
    # "system" leaves the system's default
    plain = await connect_pair(TransportHarness(
        "system", lambda: TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY,
                                       timeout=HANDSHAKE_TIMEOUT, congestion="system"),
        GARBAGE))
    try:
        assert isinstance(plain.a, TcpConnection)
        assert isinstance(plain.b, TcpConnection)
        default = tcp._proc_text("tcp_congestion_control")
        assert _congestion_of(plain.a._socks[0].sock) == default
        assert _congestion_of(plain.b._socks[0].sock) == default
    finally:
        await plain.aclose()


@pytest.mark.parametrize(("system", "cubic_allowed", "chosen"), [
    ("bbr", True, b"cubic"),  # the one system choice auto replaces
    ("bbr", False, b""),  # cubic refused (no CAP_NET_ADMIN, not allowed): bbr stays
    ("cubic", True, b""),
    ("dctcp", True, b""),  # an administrator's choice stays
    ("", True, b""),  # no /proc
])
def test_auto_congestion_replaces_only_bbr(monkeypatch: pytest.MonkeyPatch, system: str,
                                           cubic_allowed: bool, chosen: bytes) -> None:
    asked: list[str] = []

    def can_set(name: str) -> OSError | None:
        asked.append(name)
        return None if cubic_allowed else PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tcp, "_proc_text",
                        lambda name: system if name == "tcp_congestion_control" else "")
    monkeypatch.setattr(tcp, "_can_set", lambda name, family=None: can_set(name))
    monkeypatch.setattr(tcp, "_auto_choice", {})
    monkeypatch.setattr(tcp, "_TCP_CONGESTION", 13)  # (Linux's; the logic is everywhere)
    assert tcp._congestion_for("auto") == chosen
    assert tcp._congestion_for("auto") == chosen  # (decided once a network namespace)
    assert asked == (["cubic"] if system == "bbr" else [])
    # another network namespace (setns, unshare) has its own sysctl: decided again there
    monkeypatch.setattr(tcp, "_netns", lambda: -1)
    assert tcp._congestion_for("auto") == chosen
    assert asked == (["cubic", "cubic"] if system == "bbr" else [])
    assert tcp._congestion_for("system") == b"" == tcp._congestion_for("")


def test_congestion_setting_defaults_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOLL_SOCKET_CONGESTION", raising=False)
    monkeypatch.setattr(tcp, "_TCP_CONGESTION", 13)
    monkeypatch.setattr(tcp, "_auto_choice",
                        {(tcp._netns(), int(socket.AF_INET)): b"cubic"})
    assert TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY).congestion == b"cubic"
    for blank_or_keyword in ("  ", "AUTO", " Auto "):
        monkeypatch.setenv("ACOLL_SOCKET_CONGESTION", blank_or_keyword)
        assert TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY).congestion == b"cubic"
    for system in ("system", "SYSTEM"):
        monkeypatch.setenv("ACOLL_SOCKET_CONGESTION", system)
        assert TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY).congestion == b""


@pytest.mark.parametrize("bad", ["cu\xffbic", "a" * 16, "cu\tbic"])
def test_impossible_congestion_names_are_invalid_usage(monkeypatch: pytest.MonkeyPatch,
                                                       bad: str) -> None:
    bad = bad.encode().decode("unicode_escape")
    monkeypatch.setenv("ACOLL_SOCKET_CONGESTION", bad)
    with pytest.raises(InvalidUsage, match="ACOLL_SOCKET_CONGESTION"):
        TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY)
    monkeypatch.delenv("ACOLL_SOCKET_CONGESTION")
    with pytest.raises(InvalidUsage, match="ACOLL_SOCKET_CONGESTION"):
        TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, congestion=bad)


async def test_listener_close_with_handshakes_in_progress() -> None:
    """Closing a listener while connections are half-way through their handshake."""
    listener = await within(_transport(3).listen())
    socks = [await _raw(listener.handle, b"AC"),  # head incomplete
             await _authed(listener.handle, 0, 3, 5),  # group partial
             await _raw(listener.handle, _hs(hello_len=10) + b"abc")]  # hello incomplete
    await asyncio.sleep(0.05)
    listener.close()
    try:
        for sock in socks:
            await within(_refused(sock))
    finally:
        for sock in socks:
            sock.close()


async def test_unaccepted_connections_released_by_listener_close() -> None:
    listener = await within(_transport(1).listen())
    conn = await within(_transport(1).connect(listener.handle, b"never accepted",
                                              asyncio.get_running_loop().time() + DEADLINE))
    pending = conn.irecv(host_buffer(bytearray(1)), 1)
    await asyncio.sleep(0.05)  # the handshake completes; the connection waits in the queue
    listener.close()
    try:
        with pytest.raises(ConnectionLost):
            await within(pending)
    finally:
        conn.abort()
        await within(conn.wait_closed())


def _have_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _have_ipv6_loopback(), reason="no IPv6 loopback")
async def test_ipv6_loopback() -> None:
    harness = TransportHarness(
        "v6", lambda: _transport(2, 4096, "::1", socket.AF_INET6), GARBAGE)
    p = await connect_pair(harness, b"v6")
    try:
        assert p.hello == b"v6"
        await _round_trip(p, 50_000, 6)
    finally:
        await p.aclose()



# ------------------------------------------------------------------ pre-authentication bounds
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_multi_socket_handshakes_do_not_leak_fds() -> None:
    """The attack of issue 6.2: many handshakes announcing more sockets than ever come,
    the attacker keeping nothing open. Nothing may stay behind on the listener."""
    listener = await within(_transport(1).listen())
    try:
        before = _open_fds()
        for i in range(300):
            sock = await _raw(listener.handle, _hs(index=0, nsocks=4, conn_id=i) + bytes(32))
            sock.close()
        good = await connect_pair(_harness("after", 1), b"ok", listener)
        await good.aclose()
        for _ in range(100):  # refusals finish within a few loop turns
            if _open_fds() <= before + 2:
                break
            await asyncio.sleep(0.02)
        assert _open_fds() <= before + 2
    finally:
        listener.close()


async def test_incomplete_authenticated_connection_expires(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_PREAUTH_TIMEOUT", "3")  # (room for a slow machine's handshake)
    listener = await within(_transport(1).listen())
    try:
        assert isinstance(listener, tcp.TcpListener)
        sock = await _authed(listener.handle, 0, 3, 77)
        for _ in range(100):
            if 77 in listener._partial:
                break
            await asyncio.sleep(0.01)
        assert 77 in listener._partial
        await within(_refused(sock))  # dropped once its deadline passed
        assert 77 not in listener._partial
    finally:
        listener.close()


async def test_silent_connection_flood_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that never answer the challenge: at most ACOLL_PREAUTH_LIMIT are kept,
    older ones are dropped for newer ones, and a genuine connector still gets through."""
    monkeypatch.setenv("ACOLL_PREAUTH_LIMIT", "16")
    listener = await within(_transport(1).listen())
    socks: list[socket.socket] = []
    try:
        assert isinstance(listener, tcp.TcpListener)
        for _ in range(100):
            socks.append(await _raw(listener.handle, b""))
        await asyncio.sleep(0.1)
        assert len(listener._gate) <= 16
        assert listener._gate.evicted >= 100 - 16
        good = await connect_pair(_harness("flooded", 1), b"ok", listener)
        await good.aclose()
    finally:
        for sock in socks:
            sock.close()
        listener.close()


# ------------------------------------------------------------------ hostile data frames
def _frame(tag: int, total: int, length: int, offset: int = 0, payload_bytes: bytes = b"",
           kind: int = tcp._DATA) -> bytes:
    return tcp._HDR.pack(tcp._MAGIC, kind, 0, length, tag, total, offset,
                         meta_for(tag)) + payload_bytes


class _RawPeer:
    """A raw socket that passed the listener's handshake, and the accepted connection."""

    def __init__(self, listener: tcp.TcpListener, sock: socket.socket,
                 conn: TcpConnection) -> None:
        self.listener, self.sock, self.conn = listener, sock, conn
        self.failures = FailureRecorder()
        conn.set_failure_callback(self.failures)

    @classmethod
    async def open(cls) -> _RawPeer:
        listener = await within(_transport(1).listen())
        assert isinstance(listener, tcp.TcpListener)
        sock = await _authed(listener.handle, 0, 1, 99)
        _hello, conn = await within(listener.accept())
        assert isinstance(conn, TcpConnection)
        return cls(listener, sock, conn)

    async def send(self, data: bytes) -> None:
        await within(asyncio.get_running_loop().sock_sendall(self.sock, data))

    async def lost(self) -> ConnectionLost:
        """The connection's failure (it must come, through the callback)."""
        await within(self.failures.event.wait())
        assert self.conn.failed is not None
        return self.failures.calls[0]

    async def close(self) -> None:
        self.conn.abort()
        await within(self.conn.wait_closed())
        self.sock.close()
        self.listener.close()


@pytest.fixture
async def raw_peer() -> AsyncIterator[_RawPeer]:
    peer = await _RawPeer.open()
    try:
        yield peer
    finally:
        await peer.close()


async def test_absurd_total_early_fails_connection(raw_peer: _RawPeer) -> None:
    """Issue 6 item 5: a message of 2**62 bytes must not be allocated (MemoryError in the
    read callback used to escape to the loop and leave the connection hanging)."""
    await raw_peer.send(_frame(1, 1 << 62, 16, payload_bytes=b"x" * 16))
    lost = await raw_peer.lost()
    assert "broke the protocol" in str(lost)
    assert "ACOLL_SOCKET_MAX_EARLY" in str(lost)
    with pytest.raises(ConnectionLost):
        await within(raw_peer.conn.irecv(host_buffer(bytearray(16)), 2))


async def test_absurd_total_against_posted_receive_fails_connection(
        raw_peer: _RawPeer) -> None:
    pending = raw_peer.conn.irecv(host_buffer(bytearray(16)), 1)
    await raw_peer.send(_frame(1, 1 << 62, 16, payload_bytes=b"x" * 16))
    with pytest.raises(ConnectionLost, match="where a receive of 16 bytes was posted"):
        await within(pending)
    await raw_peer.lost()


@pytest.mark.parametrize(("total", "length", "offset"), [
    (16, 32, 0),  # part longer than the message
    (16, 8, 12),  # part runs past the end
    (16, 8, (1 << 64) - 4),  # offset wraps around
])
async def test_part_outside_message_fails_connection(raw_peer: _RawPeer, total: int,
                                                     length: int, offset: int) -> None:
    pending = raw_peer.conn.irecv(host_buffer(bytearray(total)), 1)
    await raw_peer.send(_frame(1, total, length, offset, b"y" * length))
    with pytest.raises(ConnectionLost, match="exceeds message size"):
        await within(pending)


async def test_overlapping_parts_fail_connection(raw_peer: _RawPeer) -> None:
    buf = bytearray(16)
    pending = raw_peer.conn.irecv(host_buffer(buf), 1)
    await raw_peer.send(_frame(1, 16, 12, 0, b"a" * 12) + _frame(1, 16, 12, 4, b"b" * 12))
    with pytest.raises(ConnectionLost, match="exceed its size"):
        await within(pending)


async def test_early_message_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ACOLL_SOCKET_MAX_EARLY an early message is kept; above it the connection fails."""
    monkeypatch.setenv("ACOLL_SOCKET_MAX_EARLY", "4K")
    peer = await _RawPeer.open()
    try:
        await peer.send(_frame(1, 4096, 4096, payload_bytes=b"k" * 4096))
        await asyncio.sleep(0.05)
        out = bytearray(4096)
        assert await within(peer.conn.irecv(host_buffer(out), 1)) == meta_for(1)
        assert out == b"k" * 4096
        await peer.send(_frame(2, 4097, 1, payload_bytes=b"k"))
        assert "4097 bytes arrived before its receive was posted" in str(await peer.lost())
    finally:
        await peer.close()


async def test_wrong_size_message_is_dropped_not_stored(raw_peer: _RawPeer,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A message whose size differs from the posted receive (under the cap) fails that
    receive once drained, without keeping its bytes anywhere; the connection stays up."""
    stored: list[int] = []
    monkeypatch.setattr(tcp, "empty_bytes", lambda n: stored.append(n))
    pending = raw_peer.conn.irecv(host_buffer(bytearray(8)), 1)
    big = 3 * tcp._STAGE + 5  # arrives over several reads, mostly outside the stage
    await raw_peer.send(_frame(1, big, big, payload_bytes=b"z" * big))
    with pytest.raises(MessageSizeError):
        await within(pending)
    assert stored == []
    assert raw_peer.conn.failed is None
    out = bytearray(3)
    rfut = raw_peer.conn.irecv(host_buffer(out), 2)
    await raw_peer.send(_frame(2, 3, 3, payload_bytes=b"abc"))
    await within(rfut)
    assert out == b"abc"


@pytest.mark.parametrize(("owner", "where"), [(TcpConnection, "_parse"),
                                              (Matcher, "place"), (Matcher, "landed")])
async def test_bug_in_read_path_fails_connection_not_loop(
        raw_peer: _RawPeer, monkeypatch: pytest.MonkeyPatch, owner: type, where: str) -> None:
    """Last resort: any exception in a loop callback fails the connection with a clear
    message; nothing reaches the loop's exception handler (the loop guard checks)."""
    def broken(*_args: object) -> None:
        raise MemoryError("simulated")

    monkeypatch.setattr(owner, where, broken)
    pending = raw_peer.conn.irecv(host_buffer(bytearray(4)), 1)
    await raw_peer.send(_frame(1, 4, 4, payload_bytes=b"abcd"))
    with pytest.raises(ConnectionLost, match="internal error while reading from"):
        await within(pending)
    assert "MemoryError('simulated')" in str(await raw_peer.lost())


async def test_bug_in_a_send_batch_fails_its_connection_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that raises on the send thread fails its connection (as a bug on the loop
    thread does), settles its send, and leaves the thread serving other connections."""
    harness = _harness("t", 1, threads=1)
    p = await connect_pair(harness)
    real = tcp._write_batch
    calls = [0]

    def first_raises(sock: socket.socket, bufs: list[object], total: int
                     ) -> tuple[int, BaseException | None]:
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("simulated")
        return real(sock, bufs, total)  # type: ignore[arg-type]

    monkeypatch.setattr(tcp, "_write_batch", first_raises)
    try:
        assert isinstance(p.a, TcpConnection)
        sfut = p.a.isend(host_buffer(bytearray(1 << 20)), 1, meta_for(1))
        assert p.a._socks[0].flight
        with pytest.raises(ConnectionLost, match="internal error while sending to"):
            await within(sfut)
        p.a.abort()
        await within(p.a.wait_closed())
        q = await connect_pair(harness)
        try:
            out = bytearray(1 << 20)
            rfut = q.b.irecv(host_buffer(out), 2)
            await within(q.a.isend(host_buffer(payload(1 << 20, 2)), 2, meta_for(2)))
            await within(rfut)
            assert out == payload(1 << 20, 2)
        finally:
            await q.aclose()
    finally:
        await p.aclose()


async def _full_socket(harness: TransportHarness, size: int, count: int
                       ) -> tuple[Pair, list[asyncio.Future[None]], tcp._SendThreads | None]:
    """A pair whose peer stopped reading, with ``count`` sends of ``size`` bytes queued on
    ``a``'s first socket, filled by the loop thread (its send threads taken away: they are
    returned, to put back)."""
    p = await connect_pair(harness)
    assert isinstance(p.a, TcpConnection)
    assert isinstance(p.b, TcpConnection)
    p.b._loop.remove_reader(p.b._socks[0].fd)  # the peer stalls
    threads, p.a._threads = p.a._threads, None  # fill the socket on the loop thread
    futs = [p.a.isend(host_buffer(bytearray(size)), t, meta_for(t)) for t in range(1, count + 1)]
    await asyncio.sleep(0.2)
    return p, futs, threads


async def test_failure_close_drops_sends_a_send_thread_has_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close(drop_queued=True) while a batch of whole frames is on the send thread: when it
    comes back, every send fails and only a frame partly written stays ahead of the close
    notice (the peer has stopped reading)."""
    import threading

    p, futs, threads = await _full_socket(_harness("t", 1, threads=1), 3 << 20, 12)
    try:
        assert isinstance(p.a, TcpConnection)
        s = p.a._socks[0]
        gate = threading.Event()
        real = tcp._write_batch

        def gated(sock: socket.socket, bufs: list[object], total: int
                  ) -> tuple[int, BaseException | None]:
            gate.wait(5)
            return real(sock, bufs, total)  # type: ignore[arg-type]

        monkeypatch.setattr(tcp, "_write_batch", gated)
        p.a._threads = threads
        p.a._flush(s)  # what the writer callback would do: a batch goes out
        assert len(s.flight) > 1
        p.a.close(b"the cause", drop_queued=True)
        gate.set()
        await within(asyncio.wait(futs))
        assert sum(1 for item in s.queue if item[3] is not None) <= 1
        assert all(f.exception() is not None for f in futs[1:])
    finally:
        p.a.abort()
        p.b.abort()
        await p.aclose()


async def test_split_connection_sends_on_its_own_half() -> None:
    """Split: each side sends on its half of the sockets (the connector the first, the
    listener the second) and reads the other, striping within its half; so a large send
    goes to the send thread even while a receive is in progress on the connection."""
    harness = _harness("split", 2, 64 << 10, threads=1)
    p = await connect_pair(harness)
    try:
        assert isinstance(p.a, TcpConnection)
        assert isinstance(p.b, TcpConnection)
        assert [len(p.a._socks), len(p.b._socks)] == [4, 4]
        # the listener files sockets by index, so socket i is the same TCP stream on both
        a_send = {p.a._socks.index(x) for x in p.a._send_socks}
        b_send = {p.b._socks.index(x) for x in p.b._send_socks}
        assert (a_send, b_send) == ({0, 1}, {2, 3}) or (a_send, b_send) == ({2, 3}, {0, 1})
        for c in (p.a, p.b):  # poll() reads the half the peer sends on
            assert {c._socks.index(x) for x in c._poll_socks} == {0, 1, 2, 3} - {
                c._socks.index(x) for x in c._send_socks}
        pending = p.a.irecv(host_buffer(bytearray(1 << 20)), 99)  # a receive in progress
        p.b._loop.remove_reader(p.b._socks[0].fd)  # the peer stalls on the first socket
        big = [p.a.isend(host_buffer(payload(4 << 20, t)), t, meta_for(t)) for t in (1, 2)]
        assert any(s.flight for s in p.a._send_socks), "the send went to the send thread"
        outs = [bytearray(4 << 20) for _ in range(2)]
        p.b._loop.add_reader(p.b._socks[0].fd, p.b._on_readable, p.b._socks[0])
        got = [p.b.irecv(host_buffer(o), t) for o, t in zip(outs, (1, 2), strict=True)]
        await within(asyncio.gather(*big, *got))
        assert outs == [payload(4 << 20, 1), payload(4 << 20, 2)]
        back = p.b.isend(host_buffer(payload(1 << 20, 99)), 99, meta_for(99))
        await within(asyncio.gather(back, pending))
    finally:
        await p.aclose()


@pytest.mark.parametrize(("nsocks", "stripe"), [(1, None), (3, 64 << 10)])
async def test_messages_go_in_parts_of_at_most_max_part(
        monkeypatch: pytest.MonkeyPatch, nsocks: int, stripe: int | None) -> None:
    """No frame carries more than _MAX_PART payload bytes (the header's length field has 32
    bits: a 4 GiB message on one socket raised struct.error); larger messages and stripes
    go in several parts and arrive whole."""
    monkeypatch.setattr(tcp, "_MAX_PART", 100_000)
    sizes: list[int] = []
    real = tcp._HDR.pack

    class Spy:
        size = tcp._HDR.size

        @staticmethod
        def pack(*fields: object) -> bytes:
            sizes.append(int(fields[3]))  # type: ignore[call-overload]
            return real(*fields)

        unpack_from = tcp._HDR.unpack_from

    monkeypatch.setattr(tcp, "_HDR", Spy)
    p = await connect_pair(_harness("parts", nsocks, stripe, split=0))
    try:
        data = payload((1 << 20) + 5, 3)
        out = bytearray(len(data))
        got = p.b.irecv(host_buffer(out), 7)
        await within(p.a.isend(host_buffer(data), 7, meta_for(7)))
        await within(got)
        assert out == data
        assert max(sizes) <= 100_000
        assert sum(sizes) >= len(data)
    finally:
        await p.aclose()


async def test_split_setting_resolves_by_send_threads(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """ACOLL_SOCKET_SPLIT: -1 splits when there is a send thread; 0 and 1 force it."""
    assert _transport(1, send_threads=1).split
    assert not _transport(1, send_threads=0).split
    assert _transport(1, send_threads=0, split=1).total == 2
    monkeypatch.setenv("ACOLL_SOCKET_SPLIT", "0")
    t = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=3, send_threads=1)
    assert (t.split, t.total, t.wire_count) == (False, 3, 3)
    monkeypatch.setenv("ACOLL_SOCKET_SPLIT", "1")
    t = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=3, send_threads=0)
    assert (t.split, t.total, t.wire_count) == (True, 6, 6 | tcp._SPLIT_FLAG)


async def test_send_thread_takes_queue_behind_a_partly_written_frame() -> None:
    """Whether sends go to the thread depends on what is queued, not on the head frame's
    rest: once the socket filled in the middle of a frame, the frames behind it still go
    to the thread (they used to stay on the loop thread until the queue ran dry)."""
    p, futs, threads = await _full_socket(_harness("t", 1, threads=1, split=0), 512 << 10, 32)
    try:
        assert isinstance(p.a, TcpConnection)
        s = p.a._socks[0]
        head = s.queue[0]
        assert 0 < head[2] < len(head[0]) + head[1].nbytes, "the socket filled mid-frame"
        p.a._threads = threads
        p.a._flush(s)  # what the writer callback does once the socket has room
        assert s.flight, "the queue behind a partly written frame stayed on the loop"
    finally:
        p.a.abort()
        p.b.abort()
        await asyncio.wait(futs)
        await p.aclose()


@pytest.mark.parametrize("threads", [0, 1])
async def test_bug_in_write_path_fails_connection_not_loop(
        monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    harness = _harness("w", 1, threads=threads)
    p = await connect_pair(harness)
    try:
        assert isinstance(p.a, TcpConnection)
        failures = FailureRecorder()
        p.a.set_failure_callback(failures)
        data = bytearray(64 << 20)  # more than the socket buffers: the writer callback runs
        sfut = p.a.isend(host_buffer(data), 1, meta_for(1))
        # inline: the writer callback is waiting; threaded: a batch is out
        assert p.a._socks[0].writing or p.a._socks[0].flight

        def broken(*_args: object) -> None:
            raise RuntimeError("simulated")

        # (the threaded path calls _account when its batch returns, then _flush)
        monkeypatch.setattr(TcpConnection, "_flush", broken)
        monkeypatch.setattr(TcpConnection, "_account", broken)
        with pytest.raises(ConnectionLost, match="internal error while sending to"):
            await within(sfut)
        await within(failures.event.wait())
    finally:
        await p.aclose()


def _record_thread_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(address, bytes) of every payload a receive thread is handed, from now on."""
    import numpy as np

    reads: list[tuple[int, int]] = []
    real = tcp._read_payload

    def recording(sock: socket.socket, view: memoryview, left: int
                  ) -> tuple[int, bool, BaseException | None]:
        reads.append((int(np.frombuffer(view, np.uint8).ctypes.data), left))
        return real(sock, view, left)

    monkeypatch.setattr(tcp, "_read_payload", recording)
    return reads


def _inside(reads: list[tuple[int, int]], buf: Any) -> bool:
    import numpy as np

    lo = int(np.frombuffer(buf, np.uint8).ctypes.data)
    return any(lo <= addr < lo + len(buf) for addr, _ in reads)


async def test_receive_thread_reads_owned_memory_and_storage_never_a_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive thread reads large payloads into a receive posted on acoll's own memory
    and into an early message's storage; a receive posted on a user's buffer is read by
    the loop thread only (the thread may write a moment after a receive failed)."""
    reads = _record_thread_reads(monkeypatch)
    size = 8 << 20
    p = await connect_pair(_harness("recv", 1, threads=1, recv=1))
    try:
        assert isinstance(p.b, TcpConnection)
        assert p.b._recv_threads is not None
        owned, user, early = (bytearray(size) for _ in range(3))
        got = p.b.irecv(_owned_buffer(owned), 1)
        await within(asyncio.gather(p.a.isend(host_buffer(payload(size, 1)), 1), got))
        assert owned == payload(size, 1)
        assert _inside(reads, owned), "the owned receive went to the receive thread"
        before = len(reads)
        got = p.b.irecv(host_buffer(user), 2)
        await within(asyncio.gather(p.a.isend(host_buffer(payload(size, 2)), 2), got))
        assert user == payload(size, 2)
        assert not _inside(reads, user), "a thread wrote into a user's buffer"
        sent = p.a.isend(host_buffer(payload(size, 3)), 3)  # arrives before its receive
        await within(sent)
        for _ in range(200):  # (the thread may take a moment to start reading it)
            if len(reads) > before:
                break
            await asyncio.sleep(0.025)
        assert len(reads) > before, "the early message's storage went to the thread"
        await within(p.b.irecv(host_buffer(early), 3))
        assert early == payload(size, 3)
        assert not _inside(reads, early)
    finally:
        await p.aclose()


@pytest.mark.parametrize("how", ["abort", "peer_abort"])
async def test_failure_while_a_receive_thread_reads(monkeypatch: pytest.MonkeyPatch,
                                                     how: str) -> None:
    """The connection fails while a receive thread reads a payload: the receive fails,
    the thread's job ends (the socket is shut down under it) and only then is the socket
    closed; nothing is left reading."""
    reads = _record_thread_reads(monkeypatch)
    p = await connect_pair(_harness("recv", 1, threads=1, recv=1))
    try:
        assert isinstance(p.a, TcpConnection)
        assert isinstance(p.b, TcpConnection)
        got = p.b.irecv(_owned_buffer(bytearray(256 << 20)), 1)
        p.a.isend(host_buffer(bytearray(256 << 20)), 1)
        for _ in range(2000):
            if any(s.reading for s in p.b._socks):
                break
            await asyncio.sleep(0.001)
        assert any(s.reading for s in p.b._socks), "a receive thread took the payload"
        if how == "abort":
            p.b.abort()
        else:
            p.a.abort()
        with pytest.raises(ConnectionLost):
            await within(got)
        await within(p.b.wait_closed())
        assert all(s.fd < 0 and not s.reading for s in p.b._socks)
        assert reads
    finally:
        await p.aclose()


def test_receive_threads_only_with_split_sockets() -> None:
    """ACOLL_SOCKET_RECV_THREADS: a receive thread reads sockets this side never sends on,
    so unsplit connections get none."""
    assert _transport(1, send_threads=1, recv_threads=1).recv_threads is not None
    assert _transport(1, send_threads=1, split=0, recv_threads=1).recv_threads is None
    assert _transport(1, send_threads=1, recv_threads=0).recv_threads is None


def _count_jobs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes a receive job was given, bytes it read) for every job from now on."""
    jobs: list[tuple[int, int]] = []
    real = tcp._read_payload

    def counting(sock: socket.socket, view: memoryview, left: int
                 ) -> tuple[int, bool, BaseException | None]:
        got = real(sock, view, left)
        jobs.append((left, got[0]))
        return got

    monkeypatch.setattr(tcp, "_read_payload", counting)
    return jobs


async def _raw_send(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await asyncio.sleep(0.001)


def _data_header(tag: int, length: int) -> bytes:
    return tcp._HDR.pack(tcp._MAGIC, tcp._DATA, 0, length, tag, length, 0, bytes(16))


async def test_a_peer_stalled_mid_frame_leaves_the_receive_thread_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that found nothing to read hands the socket back to the loop, which waits for
    it to be readable (no job every 2 ms while the peer is silent); the frame completes
    once the rest comes."""
    jobs = _count_jobs(monkeypatch)
    p = await connect_pair(_harness("recv", 1, threads=1, recv=1))
    try:
        assert isinstance(p.a, TcpConnection)
        size = 8 << 20
        data = bytes(range(256)) * (size // 256)
        out = bytearray(size)
        got = p.b.irecv(_owned_buffer(out), 7)
        sock = p.a._send_socks[0].sock
        await _raw_send(sock, _data_header(7, size) + data[:1 << 20])
        # Until the thread has read what came (no new job for 0.2 s; on a loaded machine
        # the first MiB can take longer than any fixed pause), at most 10 s: a thread that
        # polls the silent peer never goes quiet, and the check below then fails.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            before = len(jobs)
            await asyncio.sleep(0.2)
            if len(jobs) == before:
                break
        during = len(jobs)
        await asyncio.sleep(0.4)
        assert len(jobs) - during <= 1, "the receive thread polled a silent peer"
        await _raw_send(sock, data[1 << 20:])
        await within(got)
        assert out == data
    finally:
        await p.aclose()


async def test_a_receive_job_reads_a_bounded_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """One job reads at most _RECV_JOB_BYTES, then goes to the back of the thread's queue
    (a peer trickling a large frame cannot hold the thread for the others)."""
    monkeypatch.setattr(tcp, "_RECV_JOB_BYTES", 1 << 20)
    jobs = _count_jobs(monkeypatch)
    p = await connect_pair(_harness("recv", 1, threads=1, recv=1))
    try:
        size = 8 << 20
        out = bytearray(size)
        got = p.b.irecv(_owned_buffer(out), 1)
        await within(asyncio.gather(p.a.isend(host_buffer(payload(size, 1)), 1), got))
        assert out == payload(size, 1)
        assert len(jobs) >= 6
        assert all(read <= 1 << 20 for _, read in jobs)
    finally:
        await p.aclose()


@pytest.mark.parametrize("which", ["recv", "send"])
async def test_a_socket_thread_that_cannot_start_leaves_the_work_to_the_loop(
        monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """submit() failing (no thread could be started) falls back to the loop thread: the
    messages arrive, nothing is left marked as in a thread, the connection closes."""
    def refuse(self: tcp._SendThreads, job: Callable[[], None]) -> None:
        raise RuntimeError("can't start new thread")

    p = await connect_pair(_harness("t", 1, threads=1, recv=1))
    try:
        assert isinstance(p.a, TcpConnection)
        assert isinstance(p.b, TcpConnection)
        pool = p.b._recv_threads if which == "recv" else p.a._threads
        assert pool is not None
        monkeypatch.setattr(pool, "submit", refuse.__get__(pool))
        for tag in (1, 2):
            out = bytearray(4 << 20)
            got = p.b.irecv(_owned_buffer(out), tag)
            await within(asyncio.gather(p.a.isend(host_buffer(payload(4 << 20, tag)), tag),
                                        got))
            assert out == payload(4 << 20, tag)
        assert (p.b._recv_threads if which == "recv" else p.a._threads) is None
        assert not any(s.reading or s.flight for c in (p.a, p.b) for s in c._socks)
    finally:
        await p.aclose()
    await within(p.a.wait_closed())
    await within(p.b.wait_closed())
