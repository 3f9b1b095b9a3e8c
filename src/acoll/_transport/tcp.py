"""TCP transport on the event loop, with zero-copy receive into the caller's buffer.

Each connection is one or more non-blocking TCP sockets driven by ``loop.add_reader`` and
``loop.add_writer`` (plain asyncio and uvloop alike). Nothing goes through asyncio's
``Transport`` buffers: sends hand the caller's memoryview straight to ``sendmsg`` (header
and payload in one call, several queued messages per call), and receives ``recv_into``
the destination buffer directly once a header has said where the payload goes. Only
what arrives in the same read as a header (at most one staging buffer) is copied.

Data frame header (little endian, 48 bytes)::

    H magic 0xAC0D | B kind (1 data, 2 close) | B flags | I part length
    Q tag | Q message total size | Q offset of this part | 16s meta

A message larger than ``stripe`` bytes is cut into one part per socket, so with
``ACOLL_SOCKET_NSOCKS > 1`` a large message travels over several sockets at once; no part
is larger than ``_MAX_PART`` (1 GiB: the header's length field has 32 bits).

Bounded work per loop step: every reader or writer callback, and every :meth:`poll`, moves
data in calls of at most ``_IO_SLICE`` bytes (256 KiB) for receives and ``_SEND_SLICE``
(512 KiB) for sends, 0.05 to 0.3 ms of copying each, and starts no new call once ``_IO_NS``
(0.2 ms) have passed, then returns to the loop, which calls it again while the socket stays
ready. A message that waited in memory for its
receive is copied out in ``_IO_SLICE`` pieces, one per loop iteration.

Copying large sends into the kernel can run on a send thread (``ACOLL_SOCKET_SEND_THREADS``,
by default one per process when it has at least 4 CPUs). A socket with at least
``_OFFLOAD_MIN`` bytes queued hands its queued frames to the thread, unless a receive is in
progress on a socket it shares (the kernel copies of a send and a receive on one socket take
its lock in turn). The thread makes the non-blocking ``sendmsg`` calls (they copy without
the GIL) until the batch is written or the socket is full, and reports back to the loop.
Meanwhile the loop thread keeps receiving and reducing, so a rank sends and receives on two
cores, as Gloo's do. One batch per socket is in flight at a time (frames stay in order); its
socket is not closed under it (a close waits for the batch to come back).

Receive threads (``ACOLL_SOCKET_RECV_THREADS``, split sockets only: a thread reads only
sockets this side does not send on): when at least ``_RECV_OFFLOAD_MIN`` bytes of a frame's
payload are still to come and they go to acoll's own memory (an early message's storage,
or a receive posted on a buffer marked ``owned``: a reduction's scratch), the loop stops
watching the socket and a thread ``recv_into``s the payload (without the GIL) while the
loop thread reduces. A job reads at most ``_RECV_JOB_BYTES`` for at most ``_RECV_JOB_NS``
and gives up after ``_RECV_WAIT_MS`` without data (the loop then waits for the socket to
be readable), so one slow peer cannot hold the thread for the others. A user's buffer is
never read into by a thread: after a receive failed, its job may go on writing acoll's
memory until the rest of that frame part has arrived or the socket was shut down (release
shuts it down, and closes it once the job is back). If no thread can be started, the loop
thread does the work.

Split sockets (``ACOLL_SOCKET_SPLIT``, by default on when there is a send thread): a
connection opens twice ``ACOLL_SOCKET_NSOCKS`` sockets; the connector sends on the first
half, the listener on the second, each reads the other half. Then no socket is both sent on
by a thread and read by the loop, and a peer that is both source and destination (a ring of
2 ranks, all_to_all, send/recv both ways) gets the send thread too. The handshake's socket
count carries the choice (``_SPLIT_FLAG``), under the proof, so both sides agree on it.
Close frames still go on every socket (the close completes once each carried one).

Which receive a part belongs to, and where its payload goes (the posted buffer, storage
for a message that came early, or nowhere), is decided by :class:`~.matching.Matcher`;
this module only moves the bytes. Sizes from the wire are checked there before anything is
allocated or written: a part must lie inside its message, a message's size must equal the
posted receive's (else the receive fails with :class:`MessageSizeError` and the message is
read and dropped without being stored), and a message that arrives before its receive is
posted is kept in memory only up to ``ACOLL_SOCKET_MAX_EARLY`` bytes. Anything else fails
the connection with a :class:`ProtocolError` inside :class:`ConnectionLost`; no exception
escapes a loop callback.

Connection handshake on every socket (little endian), the exchange of :mod:`acoll._auth`::

    listener  -> connector  4s b"ACTC" | H version | 2x | 32s nonce_a
    connector -> listener   4s b"ACTC" | H version | H socket index | H socket count | 2x
                            Q connection id | 32s nonce_c | I hello length | hello | 32s proof
    listener  -> connector  32s proof

Both proofs cover the nonces, the socket's index and count, the connection id and the hello
(checked by the layer above), so a socket cannot be moved to another connection or replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from .. import _auth, _forkguard
from .._config import Setting, get_logger, parse_size
from .._deadline import wait_for, wait_until
from .._dtypes import empty_bytes
from .._memory import Buffer
from ..errors import AcollError, ProtocolError, TransportError
from .accepting import Evicted, HandshakeListener
from .base import META_SIZE, Connection, ConnectionLost, Transport
from .copyout import PacedCopies
from .lifecycle import FutureConnection
from .matching import Matcher, Message

__all__ = ["RawLink", "TcpConnection", "TcpListener", "TcpTransport"]

log = get_logger("NET")

NSOCKS = Setting("SOCKET_NSOCKS", int, 1, "TCP sockets per peer connection (1-16).", "NET")
STRIPE = Setting("SOCKET_STRIPE", parse_size, 1 << 20,
                 "Messages above this size are split across the sockets of a connection.",
                 "NET")
BUFSIZE = Setting("SOCKET_BUFSIZE", parse_size, 0,
                  "SO_SNDBUF/SO_RCVBUF in bytes (0: leave the kernel's autotuning).", "NET",
                  lo=0, hi=(1 << 31) - 1)
def _parse_congestion(text: str) -> str:
    """A congestion control's name, or the keywords ``auto``/``system`` (any case);
    blank is ``auto``. Raises ``ValueError`` for what no kernel name can be."""
    name = text.strip()
    if name.lower() in ("", "auto", "system"):
        return name.lower() or "auto"
    if not name.isascii() or not name.isprintable() or len(name) > 15:
        raise ValueError("not a congestion control's name (printable ASCII, at most 15 "
                         "characters), nor auto or system")
    return name


CONGESTION = Setting("SOCKET_CONGESTION", _parse_congestion, "auto",
                     "TCP congestion control of acoll's data sockets (TCP_CONGESTION): a "
                     "name such as cubic; system: the system's default; auto: cubic "
                     "where the system's default is bbr and this process may set it "
                     "(see _congestion_for), else the system's.", "NET")
SPLIT = Setting("SOCKET_SPLIT", int, -1,
                 "Give each direction of a peer connection its own sockets (1), so that a "
                 "send thread never contends with the loop's receives for a socket; 0: both "
                 "directions share them; -1: split when the process has a send thread.",
                 "NET", lo=-1, hi=1)
SEND_THREADS = Setting("SOCKET_SEND_THREADS", int, -1,
                        "Threads per process that copy large sends into the kernel (0: the "
                        "loop thread does it; -1: one when the process may use 4 CPUs or "
                        "more).", "NET", lo=-1, hi=64)
RECV_THREADS = Setting("SOCKET_RECV_THREADS", int, -1,
                       "Threads per process that copy large receives into acoll's own "
                       "memory (a reduction's scratch, early messages' storage) out of the "
                       "kernel while the loop thread reduces; only with split sockets "
                       "(0: the loop thread does it; -1: one when the process may use 4 "
                       "CPUs or more).", "NET", lo=-1, hi=64)
MAX_EARLY = Setting("SOCKET_MAX_EARLY", parse_size, 4 << 30,
                    "Largest message kept in memory when it arrives before its receive is "
                    "posted (or drained when its size is wrong); a larger one fails the "
                    "connection with ProtocolError.", "NET", lo=0)

_HDR = struct.Struct("<HBBIQQQ16s")
_MAGIC = 0xAC0D
_DATA, _CLOSE = 1, 2
_CHAL = struct.Struct("<4sH2x32s")
_HS = struct.Struct("<4sHHH2xQ32sI")
_HS_MAGIC = b"ACTC"
_HS_VERSION = 3  # (3: the socket count may carry _SPLIT_FLAG)
_CONTEXT = b"data"
_MAX_HELLO = _auth.PREAUTH_MAX_FRAME
_REFUSED = bytes(_auth.PROOF_SIZE)  # sent instead of a proof: "you do not hold the key"
_EVICTED_RETRIES = 20
_MAX_NOTICE = (1 << 16) - 64  # a close frame must fit the staging buffer
_STAGE = 1 << 16  # staging buffer for headers and small payloads
_IO_SLICE = 256 << 10  # bytes per recv_into call (and per piece of a copy-out)
_SEND_SLICE = 512 << 10  # bytes per sendmsg call (loopback sendmsg costs more per byte in
# small calls: 256 KiB calls took about 25% more CPU than unbounded ones in a profile)
_IO_NS = 200_000  # a reader/writer callback or poll starts no new call after this (ns)
_IOV = 64  # queued buffers per sendmsg call
_LINGER = 5.0  # how long a closing socket waits for the peer's EOF
_SPLIT_FLAG = 0x8000  # in the handshake's socket count: the connection's sockets are split
_RAW_FLAG = 0x4000  # in the handshake's socket count: one socket for the native ring (RawLink)
_MAX_SOCKS = 16  # sockets per connection, twice this when split
_MAX_PART = 1 << 30  # payload bytes per frame at most (the header's length field is 32 bits)
_OFFLOAD_MIN = 512 << 10  # bytes queued on a socket from which a send thread sends them
_OFFLOAD_BATCH = 8 << 20  # payload bytes handed to the send thread at once, at most
_RECV_OFFLOAD_MIN = 768 << 10  # a frame's payload left from which a receive thread reads it
# (paired runs on 16 cores: with 256 KiB, 512 KiB ring chunks lost 5 to 8% to the hand-offs)
_RECV_WAIT_MS = 2  # a receive job with nothing to read for this long goes back to the loop
# what one receive job reads at most, and for how long: then the next connection's job runs
# (one slow peer trickling a large frame must not hold the thread for the others)
_RECV_JOB_BYTES = 8 << 20
_RECV_JOB_NS = 10_000_000


_Msg = Message[asyncio.Future[bytes], None]


def _storage(nbytes: int) -> memoryview:
    # not bytearray: no zeroing pass over a large message up front
    return empty_bytes(nbytes).data


class _SendOp:
    __slots__ = ("fut", "parts_left")

    def __init__(self, fut: asyncio.Future[None], parts: int) -> None:
        self.fut = fut
        self.parts_left = parts


class _Sock:
    """One socket of a connection, with its reader and writer state."""

    __slots__ = ("close_deferred", "direct_entry", "direct_left", "direct_view", "fd",
                 "flight", "peer_done", "queue", "reading", "sent_close", "sock", "stage",
                 "stage_len", "stage_view", "writing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        # queue items: [header bytes, payload memoryview, bytes sent so far, op or None]
        self.queue: deque[list[Any]] = deque()
        self.writing = False
        self.stage = bytearray(_STAGE)
        self.stage_view = memoryview(self.stage)
        self.stage_len = 0
        self.direct_view: memoryview | None = None
        self.direct_left = 0
        self.direct_entry: _Msg | None = None
        self.peer_done = False  # the peer's close frame (or, once we are closing, EOF) came
        self.sent_close = False  # our close frame went out (and SHUT_WR)
        # items taken off the queue by a send thread's batch (empty: no batch in flight)
        self.flight: deque[list[Any]] = deque()
        self.close_deferred = False  # released while a batch was in flight: close on return
        self.reading = False  # a receive thread is reading a payload from it (no reader)


def _discard_input(sock: socket.socket) -> None:
    """Read and drop what is waiting in the receive buffer (bounded, never blocks).

    Closing a socket with unread input makes the kernel send a reset instead of a FIN, and
    a reset can overtake, at the peer, the close notice sent just before: the peer would
    then blame this rank instead of the failure the notice names.
    """
    junk = bytearray(1 << 16)
    try:
        for _ in range(256):
            if sock.recv_into(junk) <= 0:
                return
    except OSError:
        return


_TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)  # (Linux only)


def _tune(sock: socket.socket, bufsize: int, congestion: bytes = b"") -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if bufsize:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    if congestion and _TCP_CONGESTION is not None:  # (_congestion_for checked it)
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, congestion)
    sock.setblocking(False)


_CC_PROC = "/proc/sys/net/ipv4/"


def _proc_text(name: str) -> str:
    try:
        with open(_CC_PROC + name) as f:
            return f.read().strip()
    except OSError:
        return ""


def _can_set(name: str, family: socket.AddressFamily = socket.AF_INET) -> OSError | None:
    """``None`` when a socket of this process may use congestion control ``name``."""
    assert _TCP_CONGESTION is not None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name.encode())
    except OSError as exc:  # (refused, or no IPv4 socket to ask with)
        return exc
    return None


def _auto(family: socket.AddressFamily) -> bytes:
    """``auto``'s choice (see :func:`_congestion_for`)."""
    if _proc_text("tcp_congestion_control") != "bbr":
        return b""
    refused = _can_set("cubic", family)
    if refused is not None:
        log.info("ACOLL_SOCKET_CONGESTION=auto: keeping the system's bbr (cubic refused: "
                 "%s)", refused.strerror)
        return b""
    log.info("ACOLL_SOCKET_CONGESTION=auto: data sockets use cubic instead of the "
             "system's bbr")
    return b"cubic"


#: auto's choice per network namespace (the sysctl is one per namespace), by family
_auto_choice: dict[tuple[int, int], bytes] = {}


def _netns() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def _congestion_for(name: str, family: socket.AddressFamily = socket.AF_INET) -> bytes:
    """What ``_tune`` sets as TCP_CONGESTION for setting ``name`` (``b""``: nothing).

    ``auto`` replaces a system default of ``bbr`` by ``cubic``. Measured on 4 hosts
    joined by 10 Gbit/s links (bench/netns_shaped.py, README, session 36): acoll's
    all_reduce reached 87 to 89% of the line at 16 MiB under bbr, with runs dipping to 77
    to 83% at 64 MiB, and 92.5 to 94.8% at every size with cubic, in three rounds of
    each. A ring is as fast as its slowest flow at every moment, and bbr slows a flow on
    purpose now and then (its gain cycles, and ProbeRTT, four packets for 200 ms when
    its RTT estimate ages): the likely cause, not proven. cubic queues more in the
    links (1.3 against 0.2 ms there) without costing the ring. Any other system choice
    (cubic, dctcp, reno...) is the administrator's and stays.

    Raises:
        InvalidUsage: an explicit name the kernel refuses (not built, or not allowed to
            this user).
    """
    if name in ("", "system"):
        return b""
    if _TCP_CONGESTION is None:
        if name == "auto":
            return b""
        from ..errors import InvalidUsage

        raise InvalidUsage(f"ACOLL_SOCKET_CONGESTION={name!r}: this platform has no "
                           "TCP_CONGESTION socket option")
    if name == "auto":
        key = (_netns(), int(family))
        choice = _auto_choice.get(key)
        if choice is None:
            choice = _auto_choice[key] = _auto(family)
        return choice
    refused = _can_set(name, family)
    if refused is not None:
        from ..errors import InvalidUsage

        raise InvalidUsage(
            f"ACOLL_SOCKET_CONGESTION={name!r}: the kernel refuses it ({refused.strerror}; "
            f"available: {_proc_text('tcp_available_congestion_control') or 'unknown'}; "
            "a process without CAP_NET_ADMIN may set only those in "
            "net.ipv4.tcp_allowed_congestion_control)") from refused
    return name.encode()


class _SendThreads:
    """Daemon threads running send batches (callables) in submission order.

    A batch never blocks: it writes until done or until the socket is full, so one slow
    peer cannot hold the threads. A batch must report its own outcome (it catches
    everything); a thread survives whatever a batch raises anyway. The threads start on
    the first batch submitted in a process (a forked child that inherited this object
    starts its own).
    """

    def __init__(self, count: int, kind: str = "send") -> None:
        self._count = count
        self._kind = kind
        self._pid = -1  # the process whose threads run the queue
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        if self._pid != os.getpid():
            self._start()
        self._jobs.put(job)

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._jobs = queue.SimpleQueue()  # (a parent's leftover jobs are not ours)
            for i in range(self._count):
                threading.Thread(target=self._run, args=(self._jobs,),
                                 name=f"acoll-{self._kind}-{i}", daemon=True).start()
            self._pid = os.getpid()

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            job = jobs.get()
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a last resort
                log.exception("a socket thread's job raised")


_pools: dict[str, _SendThreads] = {}  # the process's socket threads, by kind
_threads_lock = threading.Lock()


def _forget_threads() -> None:
    global _threads_lock
    _pools.clear()
    _threads_lock = threading.Lock()  # (it may have been held by another thread at fork)


os.register_at_fork(after_in_child=_forget_threads)


def _pool_for(kind: str, setting: Setting[int], count: int | None) -> _SendThreads | None:
    """The process's ``kind`` threads per ``setting`` (-1: one when the process may use 4
    CPUs or more), made on first use; ``None`` for none."""
    n = setting.resolve(count)
    if n < 0:
        n = 1 if len(os.sched_getaffinity(0)) >= 4 else 0
    if n == 0:
        return None
    with _threads_lock:
        pool = _pools.get(kind)
        if pool is None:
            pool = _pools[kind] = _SendThreads(min(n, 16), kind)
        return pool


def _threads_for(count: int | None = None) -> _SendThreads | None:
    """The process's send threads per ``ACOLL_SOCKET_SEND_THREADS``, or ``None`` for none."""
    return _pool_for("send", SEND_THREADS, count)


def _recv_threads_for(count: int | None = None) -> _SendThreads | None:
    """The process's receive threads per ``ACOLL_SOCKET_RECV_THREADS``, or ``None``."""
    return _pool_for("recv", RECV_THREADS, count)


def _read_payload(sock: socket.socket, view: memoryview, left: int
                  ) -> tuple[int, bool, BaseException | None]:
    """Read up to ``left`` bytes into ``view`` from non-blocking ``sock`` (at most
    ``_RECV_JOB_BYTES``, for at most ``_RECV_JOB_NS``), waiting for data at most
    ``_RECV_WAIT_MS`` at a time: ``(bytes read, end of file, error or None)``; never
    raises. Runs on a receive thread; touches nothing but its arguments."""
    got = 0
    left = min(left, _RECV_JOB_BYTES)
    until = time.perf_counter_ns() + _RECV_JOB_NS
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while got < left and time.perf_counter_ns() < until:
            try:
                n = sock.recv_into(view[got:], left - got)
            except (BlockingIOError, InterruptedError):
                if not poller.poll(_RECV_WAIT_MS):
                    break  # (the peer is slow: the loop takes the socket back meanwhile)
                continue
            if n == 0:
                return got, True, None
            got += n
    except BaseException as exc:  # OSError: the connection broke; anything else: a bug
        return got, False, exc
    return got, False, None


def _write_batch(sock: socket.socket, bufs: list[Any], total: int
                 ) -> tuple[int, BaseException | None]:
    """Write ``bufs`` (``total`` bytes) with non-blocking ``sendmsg`` calls until all is
    written or the socket is full: ``(bytes written, error or None)``; never raises. Runs
    on a send thread; touches nothing but its arguments."""
    written = 0
    start = 0
    try:
        while written < total:
            n = sock.sendmsg(bufs[start:start + _IOV])
            written += n
            while n and start < len(bufs):  # drop what went out
                first = bufs[start]
                size = len(first) if isinstance(first, bytes) else first.nbytes
                if n >= size:
                    n -= size
                    start += 1
                else:
                    bufs[start] = first[n:]
                    n = 0
    except (BlockingIOError, InterruptedError):
        pass
    except BaseException as exc:  # OSError: the connection broke; anything else: a bug
        return written, exc
    return written, None


def _queued_at_least(queue: deque[list[Any]], nbytes: int) -> bool:
    """Whether the first ``_IOV`` items of a send queue still hold ``nbytes`` unsent.

    The test is on what is queued, not on the head alone: a batch that came back with
    the socket full leaves its last frame partly written, and judging by that frame's
    rest kept every later frame on the loop thread until the queue ran dry (large
    all-reduces with 512 KiB chunks sent almost everything there)."""
    left = nbytes
    for i, item in enumerate(queue):
        left -= len(item[0]) + item[1].nbytes - item[2]
        if left <= 0:
            return True
        if i + 1 >= _IOV:
            break
    return False


def _unsent(item: list[Any]) -> tuple[bytes | None, memoryview]:
    """What of queue ``item`` is still to be written: the rest of its header (``None``
    once the header is out) and the rest of its payload."""
    hdr, view, sent = item[0], item[1], item[2]
    if sent < len(hdr):
        return (hdr[sent:] if sent else hdr), view
    return None, view[sent - len(hdr):]


def _fail_items(items: deque[list[Any]], exc: ConnectionLost) -> None:
    """Fail the sends of queue ``items`` not yet done (marked retrieved), and empty it."""
    for item in items:
        op = item[3]
        if op is not None and not op.fut.done():
            op.fut.set_exception(exc)
            op.fut.exception()
    items.clear()


class TcpConnection(FutureConnection):
    """A :class:`~.base.Connection` over one or more TCP sockets. See the module doc."""

    def __init__(self, socks: list[socket.socket], peer: str, stripe: int, *,
                 max_early: int | None = None, threads: _SendThreads | None = None,
                 send_half: int | None = None, recv_threads: _SendThreads | None = None
                 ) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = threads
        # (a receive thread reads only sockets this side never sends on)
        self._recv_threads = recv_threads if send_half is not None else None
        self._match: Matcher[asyncio.Future[bytes], None] = Matcher(
            _storage, max_early=MAX_EARLY.resolve(max_early),
            limit_name="ACOLL_SOCKET_MAX_EARLY")
        # receives completing from storage, copied out one piece per loop step
        self._copies = PacedCopies(self._loop,
                                   lambda exc: self._internal_error("receiving from", exc))
        self._socks = [_Sock(s) for s in socks]
        # split (send_half 0: the connector's, 1: the listener's): this side sends on its
        # half of the sockets only and reads the other half, so a send thread and the
        # loop's reads never share a socket
        self._split = send_half is not None
        if send_half is None:
            self._send_socks = self._poll_socks = self._socks
        else:
            half = len(self._socks) // 2
            self._send_socks = self._socks[half * send_half:half * (send_half + 1)]
            # (:meth:`poll` reads the peer's half; readers stay on every socket)
            self._poll_socks = self._socks[half * (1 - send_half):half * (2 - send_half)]
        self.peer = peer
        self._stripe = max(stripe, 1 << 12)
        self._rr = 0
        self._failed: ConnectionLost | None = None
        self._on_failure: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        self._dropping = False  # closing on the failure path (close(drop_queued=True))
        self._peer_notice = b""
        self._released: asyncio.Future[None] = self._loop.create_future()
        for s in self._socks:
            self._loop.add_reader(s.fd, self._on_readable, s)

    # ------------------------------------------------------------------ public
    def isend(self, buffer: Buffer, tag: int, meta: bytes = bytes(META_SIZE)
              ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self._failed is not None or self._closing:
            fut.set_exception(self._failed or ConnectionLost("connection is closing"))
            fut.exception()  # awaiting it still raises; abandoned, it must not log
            return fut
        buf = buffer.view()
        total = buf.nbytes
        send = self._send_socks
        nsocks = len(send)
        if nsocks == 1 or total <= self._stripe:
            per = total
        else:
            per = -(-total // nsocks)
            per = -(-per // 4096) * 4096
        per = min(per, _MAX_PART)
        parts = [(o, min(per, total - o)) for o in range(0, total, per)] if total else [(0, 0)]
        op = _SendOp(fut, len(parts))
        for offset, length in parts:
            s = send[self._rr]
            self._rr = (self._rr + 1) % nsocks
            hdr = _HDR.pack(_MAGIC, _DATA, 0, length, tag, total, offset, meta)
            s.queue.append([hdr, buf[offset:offset + length], 0, op])
            if len(s.queue) == 1:
                self._flush(s)
        return fut

    def poll(self) -> None:
        """Read what has arrived on every socket the peer sends on, within one ``_IO_NS``
        time budget."""
        until = time.perf_counter_ns() + _IO_NS
        for s in self._poll_socks:
            if s.fd >= 0 and not s.peer_done:
                try:
                    self._read(s, until)
                except Exception as exc:
                    self._internal_error("reading from", exc)

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        if self._closing or self._failed is not None:
            return
        self._closing = True
        notice = notice[:_MAX_NOTICE]
        lost = ConnectionLost("the connection was closed locally")
        self._fail_pending(lost, sends=False)
        if drop_queued:
            # Failure path: queued data no longer matters and must not hold the notice (or
            # the owner's waits) behind a peer that may have stopped reading.
            self._dropping = True  # (sends a send thread has out are dropped on return)
            self._drop_queued_sends(lost)
        for s in self._socks:
            hdr = _HDR.pack(_MAGIC, _CLOSE, 0, len(notice), 0, 0, 0, bytes(META_SIZE))
            s.queue.append([hdr, memoryview(notice), 0, None])
            if len(s.queue) == 1:
                self._flush(s)
        self._loop.call_later(_LINGER, self._release_guarded)

    def abort(self) -> None:
        if self._failed is None:
            self._failed = ConnectionLost("the connection was aborted locally")
        if self._closing:
            # A close notice may still be queued (a failure being reported): give it one
            # non-blocking chance to leave, so the peer learns the cause, not just an EOF.
            for s in self._socks:
                if s.fd >= 0 and s.queue and not s.sent_close:
                    self._flush(s)
        self._fail_pending(self._failed, sends=True)
        self._release()

    def _drop_queued_sends(self, exc: ConnectionLost) -> None:
        """Fail every queued send now; a frame already half written is still finished
        (the stream must stay well framed for the close frame that follows)."""
        for s in self._socks:
            head = s.queue[0] if s.queue and s.queue[0][2] > 0 else None
            _fail_items(s.queue, exc)
            if head is not None:
                s.queue.append(head)

    # ------------------------------------------------------------------ failure
    def _fail_pending(self, exc: ConnectionLost, *, sends: bool) -> None:
        # Futures failed here are marked retrieved: the owner learns of the failure through
        # the failure callback, and ops that were abandoned must not log "never retrieved".
        for msg in self._match.fail(exc):
            self._deliver(msg)
        if not self._match.keeping:
            # (after the peer's orderly close, a message that had fully arrived is still
            # delivered: its copy into the posted receive goes on)
            self._copies.fail(exc)
        for s in self._socks:
            # a part still arriving must not keep writing into a buffer whose receive failed:
            # the rest of it is read and dropped
            s.direct_view = s.direct_entry = None
        if sends:
            for s in self._socks:
                _fail_items(s.queue, exc)  # (a batch in flight settles its sends on return)

    def _settle_lost(self, exc: ConnectionLost) -> None:
        self._fail_pending(exc, sends=True)
        self._release()

    def _release(self) -> None:
        # Whatever is still pending can no longer complete: fail it, never leave it hanging.
        self._fail_pending(self._failed or ConnectionLost("the connection was closed locally",
                                                          orderly=True), sends=True)
        for s in self._socks:
            if s.fd < 0:
                continue
            if s.flight or s.reading:
                # a socket thread is using it: close when its job is back
                self._loop.remove_reader(s.fd)
                self._want_writable(s, False)
                with contextlib.suppress(OSError):
                    # cuts a send batch short (EPIPE), ends a receive job (end of file)
                    s.sock.shutdown(socket.SHUT_RDWR)
                s.close_deferred = True
                continue
            self._close_sock(s)
        if self._failed is None:
            self._failed = ConnectionLost("the connection was closed locally", orderly=True)
        self._check_released()

    def _close_sock(self, s: _Sock) -> None:
        if s.fd < 0:
            return
        self._loop.remove_reader(s.fd)
        self._want_writable(s, False)
        _discard_input(s.sock)
        s.sock.close()
        s.fd = -1
        s.close_deferred = False

    def _check_released(self) -> None:
        if not self._released.done() and all(x.fd < 0 for x in self._socks):
            self._released.set_result(None)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._released)

    # ------------------------------------------------------------------ writing
    def _on_writable(self, s: _Sock) -> None:
        try:
            self._flush(s)
        except Exception as exc:
            self._internal_error("sending to", exc)

    def _flush(self, s: _Sock) -> None:
        """Write queued frames for ``_IO_NS`` at most, in calls of ``_SEND_SLICE`` payload
        bytes (headers ride along, so a chunk of exactly that size is not left with a
        48-byte tail for a later call); the writer callback does the rest in later loop
        steps (registered while anything is queued). A large payload at the head of the
        queue goes to a send thread instead (see the module doc)."""
        if s.flight:
            return  # a send thread has the head of the stream; it reports back
        queue = s.queue
        sock = s.sock
        if (self._threads is not None and queue
                and (self._split or not self._match.receiving)
                and _queued_at_least(queue, _OFFLOAD_MIN)):
            # (unless the connection is split, a receive on it would contend with the send
            # thread for the socket: with a peer that is both source and destination, sends
            # then stay here)
            self._offload(s)
            return
        until = time.perf_counter_ns() + _IO_NS
        while queue:
            bufs: list[Any] = []
            size = 0
            room = _SEND_SLICE  # payload bytes this call may still carry
            for item in queue:
                head, view = _unsent(item)
                if head is not None:
                    bufs.append(head)
                    size += len(head)
                if view.nbytes > room:
                    view = view[:room]
                bufs.append(view)
                size += view.nbytes
                room -= view.nbytes
                if room <= 0 or len(bufs) >= _IOV:
                    break
            try:
                n = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._lost(ConnectionLost(f"send to {self.peer} failed: {exc}"))
                return
            if not self._account(s, n):
                return
            if n < size:
                break  # partial write: the kernel buffer is full
            if time.perf_counter_ns() >= until:
                break
        self._want_writable(s, bool(queue))

    def _want_writable(self, s: _Sock, want: bool) -> None:
        if s.fd < 0:
            return
        if want and not s.writing:
            self._loop.add_writer(s.fd, self._on_writable, s)
            s.writing = True
        elif not want and s.writing:
            self._loop.remove_writer(s.fd)
            s.writing = False

    def _account(self, s: _Sock, n: int, queue: deque[list[Any]] | None = None) -> bool:
        """Record ``n`` more bytes of ``queue`` (``s``'s queue by default) as sent: complete
        the sends they finish. False when that closed the socket (our close frame went out
        last)."""
        if queue is None:
            queue = s.queue
        while n and queue:
            item = queue[0]
            size_item = len(item[0]) + item[1].nbytes
            take = min(n, size_item - item[2])
            item[2] += take
            n -= take
            if item[2] < size_item:
                break
            queue.popleft()
            op = item[3]
            if op is None:  # the close frame went out: half-close, wait for the EOF
                with contextlib.suppress(OSError):
                    s.sock.shutdown(socket.SHUT_WR)
                s.sent_close = True
                self._closed_socket(s)
                if s.fd < 0:
                    return False
                continue
            op.parts_left -= 1
            if op.parts_left == 0 and not op.fut.done():
                op.fut.set_result(None)
        return True

    def _offload(self, s: _Sock) -> None:
        """Hand the frames at the head of ``s``'s queue to a send thread."""
        assert self._threads is not None
        bufs: list[Any] = []
        total = payload = 0
        queue, flight = s.queue, s.flight
        while queue and payload < _OFFLOAD_BATCH and len(flight) < _IOV:
            item = queue.popleft()
            flight.append(item)
            head, view = _unsent(item)
            if head is not None:
                bufs.append(head)
                total += len(head)
            bufs.append(view)
            total += view.nbytes
            payload += view.nbytes
        self._want_writable(s, False)
        loop, sock = self._loop, s.sock

        def batch() -> None:
            try:
                written, err = _write_batch(sock, bufs, total)
            except BaseException as exc:  # (a bug: the connection fails on return)
                written, err = 0, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._offloaded, s, written, total, err)

        try:
            self._threads.submit(batch)  # (may fail to start its thread: the loop sends)
        except Exception as exc:
            log.warning("send thread unavailable (%r): the loop thread sends", exc)
            self._threads = None
            s.queue.extendleft(reversed(flight))
            s.flight = deque()
            self._flush(s)

    def _offloaded(self, s: _Sock, written: int, total: int, err: BaseException | None
                   ) -> None:
        """A send thread's batch came back (on the loop thread): the sends it finished
        complete; the rest go back to the head of the queue, or fail if the connection
        ended meanwhile (closing on the failure path, only a frame partly written goes
        back: the stream must stay framed for the close notice)."""
        flight, s.flight = s.flight, deque()
        try:
            if err is not None and not isinstance(err, OSError):
                # a bug in the batch: fail the connection, as on the loop thread
                raise err if isinstance(err, Exception) else RuntimeError(repr(err))
            open_ = s.fd >= 0 and self._account(s, written, flight) and not s.close_deferred
            if flight and (self._failed is not None or not open_):
                self._fail_items(flight)
            elif flight and self._dropping:
                head = flight[0]
                partial = 0 < head[2] < len(head[0]) + head[1].nbytes
                self._fail_items(flight)
                if partial:
                    flight.append(head)  # (its send failed; its bytes still go out)
            s.queue.extendleft(reversed(flight))
            if s.close_deferred:
                if not s.reading:
                    self._close_sock(s)
                    self._check_released()
                return
            if not open_ or self._failed is not None:
                return
            if err is not None:
                self._lost(ConnectionLost(f"send to {self.peer} failed: {err}"))
            elif written < total:
                self._want_writable(s, bool(s.queue))  # the socket is full: wait for room
            else:
                self._flush(s)
        except Exception as exc:
            self._internal_error("sending to", exc)
            self._fail_items(flight)

    def _fail_items(self, items: deque[list[Any]]) -> None:
        _fail_items(items, self._failed or ConnectionLost("the connection was closed locally"))

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _offloadable(s: _Sock) -> bool:
        """Whether the payload arriving on ``s`` goes to memory acoll owns (an early
        message's storage, or a receive posted on a buffer marked ``owned``): only such a
        payload is read by a receive thread, which may still be writing for a moment after
        the receive failed; a user's buffer is never written after its receive ended."""
        entry = s.direct_entry
        return entry is not None and not entry.drop and (
            entry.storage is not None or entry.owned)

    def _offload_recv(self, s: _Sock) -> bool:
        """Hand the rest of the payload arriving on ``s`` to a receive thread (False: none
        could take it); the loop stops watching ``s`` until the job is back
        (:meth:`_recv_returned`)."""
        threads = self._recv_threads
        assert threads is not None
        assert s.direct_view is not None
        loop, sock, view, left = self._loop, s.sock, s.direct_view, s.direct_left

        def job() -> None:
            try:
                got, eof, err = _read_payload(sock, view, left)
            except BaseException as exc:  # (a bug: the connection fails on return)
                got, eof, err = 0, False, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._recv_returned, s, got, eof, err)

        try:
            threads.submit(job)  # (may fail to start its thread: the loop reads on)
        except Exception as exc:
            log.warning("receive thread unavailable (%r): the loop thread reads", exc)
            self._recv_threads = None
            return False
        self._loop.remove_reader(s.fd)
        s.reading = True
        return True

    def _recv_returned(self, s: _Sock, got: int, eof: bool, err: BaseException | None
                       ) -> None:
        """A receive thread's job came back (on the loop thread): account what it read,
        then read on here (or hand the rest to a thread again)."""
        s.reading = False
        try:
            if s.close_deferred:  # released meanwhile
                if not s.flight:
                    self._close_sock(s)
                    self._check_released()
                return
            if s.fd < 0 or self._failed is not None:
                return
            if err is not None and not isinstance(err, OSError):
                raise err if isinstance(err, Exception) else RuntimeError(repr(err))
            if got:
                entry = s.direct_entry
                s.direct_left -= got
                if s.direct_left:
                    if s.direct_view is not None:
                        s.direct_view = s.direct_view[got:]
                else:
                    s.direct_view = s.direct_entry = None
                if entry is not None:
                    done = self._match.landed(entry, got)
                    if done is not None:
                        self._deliver(done)
            if err is not None:
                self._lost(ConnectionLost(f"receive from {self.peer} failed: {err}"))
                return
            if eof:
                self._eof(s)
                return
            if s.fd >= 0 and not s.peer_done:
                self._loop.add_reader(s.fd, self._on_readable, s)
                if got:  # (a job that found nothing waits for the socket to be readable)
                    self._read(s, time.perf_counter_ns() + _IO_NS)
        except Exception as exc:
            self._internal_error("receiving from", exc)

    def _on_readable(self, s: _Sock) -> None:
        try:
            self._read(s, time.perf_counter_ns() + _IO_NS)
        except Exception as exc:
            self._internal_error("reading from", exc)

    def _read(self, s: _Sock, until: int) -> None:
        """Read and dispatch from ``s`` (calls of ``_IO_SLICE`` bytes at most) until it has
        no more data or ``perf_counter_ns()`` passes ``until``."""
        if s.reading:
            return  # (a receive thread has the socket; it reports back)
        sock = s.sock
        try:
            while True:
                if s.direct_left:
                    view = s.direct_view
                    if (view is not None and s.direct_left >= _RECV_OFFLOAD_MIN
                            and self._recv_threads is not None and self._offloadable(s)
                            and self._offload_recv(s)):
                        return
                    want = min(s.direct_left, _IO_SLICE)
                    if view is None:  # the payload is dropped: read it into the stage
                        want = min(want, _STAGE)
                        n = sock.recv_into(s.stage_view, want)
                    else:
                        n = sock.recv_into(view, want)
                    if n == 0:
                        self._eof(s)
                        return
                    s.direct_left -= n
                    entry = s.direct_entry
                    if s.direct_left:
                        if view is not None:
                            s.direct_view = view[n:]
                    else:
                        s.direct_view = s.direct_entry = None
                    if entry is not None:
                        done = self._match.landed(entry, n)
                        if done is not None:
                            self._deliver(done)
                    if n < want:
                        return
                else:
                    room = _STAGE - s.stage_len
                    n = sock.recv_into(s.stage_view[s.stage_len:], room)
                    if n == 0:
                        self._eof(s)
                        return
                    s.stage_len += n
                    self._parse(s)
                    if n < room or s.fd < 0 or s.peer_done:
                        return
                if time.perf_counter_ns() >= until:
                    return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._lost(ConnectionLost(f"receive from {self.peer} failed: {exc}"))
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))

    def _eof(self, s: _Sock) -> None:
        if self._closing:
            s.peer_done = True
            self._closed_socket(s)
            return
        self._lost(ConnectionLost(f"{self.peer} closed the connection unexpectedly"))

    def _closed_socket(self, s: _Sock) -> None:
        """One socket finished its part of an orderly close; end the connection when all have.

        The peer's close frame travels behind its data on every socket, so the close is only
        complete (and data sent before it all received) once each socket has carried one.
        Closing ourselves, we also wait until our own close frame left on every socket.
        """
        if s.peer_done and s.fd >= 0:
            self._loop.remove_reader(s.fd)  # only the EOF can follow
        if not all(x.peer_done for x in self._socks):
            return
        if self._closing:
            if all(x.sent_close for x in self._socks):
                self._release()
        else:
            self._lost(ConnectionLost(f"{self.peer} closed the connection", orderly=True,
                                      notice=self._peer_notice))

    def _parse(self, s: _Sock) -> None:
        stage = s.stage
        pos = 0
        end = s.stage_len
        hsize = _HDR.size
        match = self._match
        while end - pos >= hsize:
            magic, kind, _flags, length, tag, total, offset, meta = _HDR.unpack_from(stage, pos)
            if magic != _MAGIC:
                raise ProtocolError(f"bad data frame magic {magic:#x}")
            if kind == _CLOSE:
                if length > _MAX_NOTICE:
                    raise ProtocolError(f"close notice of {length} bytes is too large")
                if end - pos - hsize < length:
                    break
                self._peer_notice = bytes(stage[pos + hsize:pos + hsize + length])
                s.stage_len = 0
                s.peer_done = True
                self._closed_socket(s)
                return
            if kind != _DATA:
                raise ProtocolError(f"unknown data frame kind {kind}")
            msg, dest = match.place(tag, total, offset, length, meta)
            if match.arrivals:  # a message that came before its receive: tell the owner
                for early_tag, early_meta in match.arrivals:
                    self._notify_arrival(self._loop, early_tag, early_meta)
                match.arrivals.clear()
            pos += hsize
            avail = end - pos
            take = length if length <= avail else avail
            if take and dest is not None:
                dest[:take] = s.stage_view[pos:pos + take]
            pos += take
            if take < length:
                s.direct_view = dest[take:] if dest is not None else None
                s.direct_left = length - take
                s.direct_entry = msg
                match.landed(msg, take)  # never completes it: the rest is still to come
                break
            done = match.landed(msg, length)
            if done is not None:
                self._deliver(done)
        if pos:
            rest = end - pos
            if rest:
                stage[:rest] = stage[pos:end]
            s.stage_len = rest



class TcpListener(HandshakeListener):
    """Accepts authenticated TCP connections and assembles multi-socket ones.

    Every accepted socket runs the exchange of :mod:`acoll._auth` (see the module doc)
    within ``ACOLL_PREAUTH_TIMEOUT``; at most ``ACOLL_PREAUTH_LIMIT`` sockets may be in it
    at once (the oldest is dropped for a newcomer). Authenticated sockets of a connection
    that announced several wait for the others at most that long too, in at most that
    many incomplete connections.
    """

    kind = "data"

    def __init__(self, sock: socket.socket, handle: bytes, stripe: int, bufsize: int,
                 handshake_timeout: float, key: bytes, threads: _SendThreads | None = None,
                 recv_threads: _SendThreads | None = None, congestion: bytes = b"") -> None:
        self._sock = sock
        self.handle = handle
        self._stripe = stripe
        self._threads = threads
        self._recv_threads = recv_threads
        self._bufsize = bufsize
        self._congestion = congestion
        self._key = key
        # connection id -> (socket count, sockets by index, expiry timer) while they arrive
        self._partial: dict[int, tuple[int, dict[int, socket.socket], asyncio.TimerHandle]]
        self._partial = {}
        super().__init__(sock, handshake_timeout)

    async def _handshake(self, sock: socket.socket, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = self._handshake_deadline()
        try:
            _tune(sock, self._bufsize, self._congestion)
            nonce_a = _auth.new_nonce()
            await wait_for(loop.sock_sendall(
                sock, _CHAL.pack(_HS_MAGIC, _HS_VERSION, nonce_a)), self._left(deadline))
            head = await wait_for(_recv_exactly(loop, sock, _HS.size),
                                          self._left(deadline))
            magic, version, index, nsocks, conn_id, nonce_c, hello_len = _HS.unpack(head)
            if magic != _HS_MAGIC or version != _HS_VERSION:
                raise ProtocolError("not an acoll data connection")
            split = nsocks & _SPLIT_FLAG
            raw = nsocks & _RAW_FLAG
            count = nsocks & ~(_SPLIT_FLAG | _RAW_FLAG)
            if (not (0 <= index < count <= (2 * _MAX_SOCKS if split else _MAX_SOCKS))
                    or hello_len > _MAX_HELLO or (split and count % 2)
                    or (raw and (split or count != 1))):
                raise ProtocolError("bad handshake fields")
            rest = await wait_for(
                _recv_exactly(loop, sock, hello_len + _auth.PROOF_SIZE), self._left(deadline))
            hello, proof = rest[:hello_len], rest[hello_len:]
            claims = _claims(index, nsocks, conn_id, hello)
            if not _auth.verify(proof, self._key, _auth.CONNECT, _CONTEXT, nonce_a, nonce_c,
                                claims):
                # an explicit refusal, so the connector does not take it for an eviction
                with contextlib.suppress(OSError):
                    sock.send(_REFUSED)
                raise ProtocolError("the connector does not hold this job's key")
            await wait_for(loop.sock_sendall(sock, _auth.prove(
                self._key, _auth.ACCEPT, _CONTEXT, nonce_a, nonce_c, claims)),
                self._left(deadline))
        except (OSError, asyncio.TimeoutError, ProtocolError) as exc:
            self._refusals.refused("refused data connection from %s: %s", addr, exc)
            sock.close()
            return
        except BaseException:  # cancelled by close(), or dropped for a newer connection
            sock.close()
            raise
        self._add_socket(sock, addr, index, nsocks, conn_id, hello)

    def _add_socket(self, sock: socket.socket, addr: Any, index: int, nsocks: int,
                    conn_id: int, hello: bytes) -> None:
        if self._closed:
            sock.close()
            return
        entry = self._partial.get(conn_id)
        if entry is None:
            while len(self._partial) >= self._gate.limit:
                self._expire(next(iter(self._partial)))
            timer = asyncio.get_running_loop().call_later(self._timeout, self._expire, conn_id)
            entry = self._partial[conn_id] = (nsocks, {}, timer)
        expected, group, timer = entry
        if expected != nsocks or index in group:
            log.warning("refused data connection from %s: socket %d/%d does not fit "
                        "connection %#x", addr, index, nsocks, conn_id)
            sock.close()
            return
        group[index] = sock
        count = nsocks & ~(_SPLIT_FLAG | _RAW_FLAG)
        if len(group) == count:
            del self._partial[conn_id]
            timer.cancel()
            socks = [group[i] for i in range(count)]
            if nsocks & _RAW_FLAG:
                self._offer(hello, RawLink(socks[0], f"{addr[0]}:{addr[1]}"))
                return
            conn = TcpConnection(socks, f"{addr[0]}:{addr[1]}", self._stripe,
                                 threads=self._threads, recv_threads=self._recv_threads,
                                 send_half=1 if nsocks & _SPLIT_FLAG else None)
            self._offer(hello, conn)

    def _expire(self, conn_id: int) -> None:
        entry = self._partial.pop(conn_id, None)
        if entry is None:
            return
        nsocks, group, timer = entry
        timer.cancel()
        log.warning("data connection %#x dropped: %d of its %d sockets arrived in time",
                    conn_id, len(group), nsocks)
        for sock in group.values():
            sock.close()

    def _close_pending(self) -> None:
        for conn_id in list(self._partial):
            self._expire(conn_id)


class RawLink(Connection):
    """One authenticated TCP socket that carries no acoll frames: a link of the native
    ring (:mod:`acoll._comm.native_ring`), read or written only by its owner's worker
    thread, never watched by the event loop. :meth:`isend` and :meth:`irecv` fail.

    While the owner marks it ``busy`` (a native call has its descriptor), :meth:`abort`
    only shuts the socket down (the call sees the end of the stream at once); the socket
    is closed when the owner calls :meth:`idle` afterwards, so its descriptor number is
    never reused under a running call.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.busy = False
        self._failed: ConnectionLost | None = None
        self._closed = False

    @property
    def failed(self) -> ConnectionLost | None:
        return self._failed

    def fileno(self) -> int:
        return -1 if self._closed else self.sock.fileno()

    def isend(self, buf: Buffer, tag: int, meta: bytes = bytes(META_SIZE)
              ) -> asyncio.Future[None]:
        return self._refuse()

    def irecv(self, buf: Buffer, tag: int) -> asyncio.Future[bytes]:
        return self._refuse()

    def _refuse(self) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_exception(ProtocolError("a raw link carries no messages"))
        fut.exception()
        return fut

    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        pass  # (its owner learns of failures from the native calls themselves)

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        self.abort()

    def abort(self) -> None:
        if self._failed is None:
            self._failed = ConnectionLost("the connection was aborted locally")
        if self._closed:
            return
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if not self.busy:
            self._closed = True
            self.sock.close()

    def idle(self) -> None:
        """The owner's call is back: close now if :meth:`abort` came meanwhile."""
        self.busy = False
        if self._failed is not None and not self._closed:
            self._closed = True
            self.sock.close()

    async def wait_closed(self) -> None:
        return


def _claims(index: int, nsocks: int, conn_id: int, hello: bytes) -> bytes:
    return struct.pack("<HHQ", index, nsocks, conn_id) + hello


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("connection closed during handshake")
        got += k
    return bytes(buf)


class TcpTransport(Transport):
    """Plain TCP sockets on the event loop (NCCL's ``Socket`` net)."""

    name = "socket"

    def __init__(self, sockaddr: tuple[Any, ...], family: socket.AddressFamily, *,
                 key: bytes, nsocks: int | None = None, stripe: int | None = None,
                 bufsize: int | None = None, timeout: float = 30.0,
                 send_threads: int | None = None, split: int | None = None,
                 recv_threads: int | None = None, congestion: str | None = None) -> None:
        if len(key) < 16:
            raise ValueError("TcpTransport needs the job's authentication key")
        self.key = key
        self.sockaddr = (sockaddr[0], 0, *sockaddr[2:])
        self.family = family
        self.nsocks = NSOCKS.resolve(nsocks)
        if not 1 <= self.nsocks <= _MAX_SOCKS:
            from ..errors import InvalidUsage

            raise InvalidUsage(f"ACOLL_SOCKET_NSOCKS={self.nsocks}: must be 1..{_MAX_SOCKS}")
        self.stripe = STRIPE.resolve(stripe)
        self.bufsize = BUFSIZE.resolve(bufsize)
        cc = CONGESTION.resolve(congestion)
        try:
            cc = _parse_congestion(cc)  # (an argument has not been through it)
        except ValueError as exc:
            from ..errors import InvalidUsage

            raise InvalidUsage(f"ACOLL_SOCKET_CONGESTION={cc!r} is invalid: {exc}") from None
        self.congestion = _congestion_for(cc, family)
        self.timeout = timeout
        self.threads = _threads_for(send_threads)
        split = SPLIT.resolve(split)
        self.split = self.threads is not None if split < 0 else bool(split)
        self.recv_threads = _recv_threads_for(recv_threads) if self.split else None
        # sockets a connection opens, and the count its handshake states
        self.total = self.nsocks * 2 if self.split else self.nsocks
        self.wire_count = self.total | (_SPLIT_FLAG if self.split else 0)

    async def listen(self) -> TcpListener:
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            sock.bind(self.sockaddr)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {self.sockaddr[0]}: {exc}") from exc
        name = sock.getsockname()
        handle = msgpack.packb([name[0], name[1], name[3] if len(name) == 4 else 0])
        return TcpListener(sock, handle, self.stripe, self.bufsize, self.timeout, self.key,
                           self.threads, self.recv_threads, self.congestion)

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> TcpConnection:
        socks, peer = await self._open(handle, hello, deadline, self.total, self.wire_count)
        return TcpConnection(socks, peer, self.stripe, threads=self.threads,
                             recv_threads=self.recv_threads,
                             send_half=0 if self.split else None)

    async def connect_raw(self, handle: bytes, hello: bytes, deadline: float) -> RawLink:
        """One authenticated socket to the listener of ``handle`` that carries no frames
        (:class:`RawLink`: the native ring's); the listener offers it as a RawLink too."""
        socks, peer = await self._open(handle, hello, deadline, 1, 1 | _RAW_FLAG)
        return RawLink(socks[0], peer)

    async def _open(self, handle: bytes, hello: bytes, deadline: float, total: int,
                    wire_count: int) -> tuple[list[socket.socket], str]:
        try:
            host, port, scope = msgpack.unpackb(handle)
        except Exception as exc:
            raise ProtocolError(f"bad socket handle: {exc}") from exc
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addr: tuple[Any, ...] = (host, port, 0, scope) if family == socket.AF_INET6 else (
            host, port)
        loop = asyncio.get_running_loop()
        conn_id = int.from_bytes(os.urandom(8), "little")
        socks: list[socket.socket] = []
        try:
            for index in range(total):
                for attempt in range(_EVICTED_RETRIES):
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    socks.append(sock)
                    _forkguard.hold(sock)
                    _tune(sock, self.bufsize, self.congestion)
                    await wait_until(loop.sock_connect(sock, addr), deadline,
                                     f"connecting to {host}:{port}")
                    try:
                        await wait_until(self._authenticate(loop, sock, index, conn_id, hello,
                                                            wire_count),
                                         deadline, f"handshake with {host}:{port}")
                        break
                    except Evicted:
                        # the listener dropped us unanswered (busy, or making room under
                        # a flood of unauthenticated connections): connect again
                        socks.pop().close()
                        log.info("data connection to %s:%d dropped during its handshake; "
                                 "retrying (%d)", host, port, attempt + 1)
                        await asyncio.sleep(min(0.01 * 2 ** attempt, 0.5))
                else:
                    raise TransportError(f"{host}:{port} kept dropping the handshake")
        except BaseException as exc:
            for sock in socks:
                sock.close()
            if isinstance(exc, OSError) and not isinstance(exc, AcollError):
                raise TransportError(f"cannot connect to {host}:{port}: {exc}") from exc
            raise
        return socks, f"{host}:{port}"

    async def _authenticate(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            index: int, conn_id: int, hello: bytes, wire_count: int) -> None:
        """Connector side of the exchange (module doc); raises ProtocolError on a bad peer."""
        try:
            magic, version, nonce_a = _CHAL.unpack(await _recv_exactly(loop, sock, _CHAL.size))
        except ConnectionError:
            raise Evicted from None
        if magic != _HS_MAGIC or version != _HS_VERSION:
            raise ProtocolError("the listener is not an acoll data listener")
        nonce_c = _auth.new_nonce()
        claims = _claims(index, wire_count, conn_id, hello)
        head = _HS.pack(_HS_MAGIC, _HS_VERSION, index, wire_count, conn_id, nonce_c,
                        len(hello))
        await loop.sock_sendall(sock, head + hello + _auth.prove(
            self.key, _auth.CONNECT, _CONTEXT, nonce_a, nonce_c, claims))
        try:
            proof = await _recv_exactly(loop, sock, _auth.PROOF_SIZE)
        except ConnectionError:
            raise Evicted from None
        if proof == _REFUSED:
            raise ProtocolError("the listener refused the connection: this rank does not "
                                "hold the job's key")
        if not _auth.verify(proof, self.key, _auth.ACCEPT, _CONTEXT, nonce_a, nonce_c,
                            claims):
            raise ProtocolError("the listener failed to prove it holds the job's key")
