"""In-process transport: ranks of one process and one event loop hand messages over in
memory, copied once into the posted receive, with no socket.

Design
------
Connections come in pairs (``a`` and ``b``), each the other's ``_peer``. A send on ``a`` is
handed to ``b``'s :class:`~.matching.Matcher` *by reference* (:meth:`~.matching.Matcher.hold`):
nothing is copied until the receive exists.

- Receive posted: the receiver copies the sender's bytes straight into it, then both
  futures complete. Copies of more than ``_SYNC_COPY`` bytes run through the receiver's
  copy queue, at most ``_SLICE`` bytes (256 KiB, some 20-50 us) per loop step per
  connection (the first piece at once), round robin, so a 64 MiB message never holds the
  loop for long and a small message never waits behind a large one for more than a step.
- Receive not posted yet (*early*): a message of up to ``ACOLL_INPROC_EAGER`` bytes is
  copied into storage at once and its send completes (eager); a larger one stays a
  reference to the sender's buffer, and the send completes only once the receiver copied
  it (rendezvous). Either way the receiver's arrival callback is notified.
- Orderly close: the closing end's held sends are copied into storage (through its copy
  queue, bounded the same way) and complete; sends being copied by the peer finish; then
  the peer learns of the close (``ConnectionLost(orderly=True, notice=...)``) and keeps the
  complete early messages receivable. With ``drop_queued``, held sends are withdrawn from
  the peer's matcher and fail at once instead.
- Abort / internal error: the end's unfinished sends fail and are withdrawn or marked
  dead (a receiver copying one stops and fails that receive), its receives fail, and the
  peer learns of it on the next loop step (``ConnectionLost``, not orderly), once.
- Every cross-connection effect that could run inside the peer's own code (completing
  the peer's close, telling it of a failure) is scheduled with ``loop.call_soon``; the
  failure callback runs from that loop callback, before any pending future fails (as
  TCP's read path does), never inside a caller's frame. A local ``abort`` reports nothing
  to its own callback. No exception reaches the loop's handler: internal errors end the
  connection.

Reaching a listener: a process-global registry maps handles to listeners. A handle is
``b"ACIP" | 16-byte process nonce | loop id | 16-byte random token``; the nonce is renewed
in a forked child. :meth:`InprocTransport.can_connect` accepts a pair only when both
:class:`~.base.PeerInfo` records and both handles name this process and the same loop, and
:meth:`InprocTransport.connect` refuses a handle of another process or loop, or of a closed
listener, with :class:`~acoll.errors.TransportError`. Both ends must hold the same job key
(compared with :func:`hmac.compare_digest`); a stranger is refused both ways.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import struct
import weakref
from collections import deque
from collections.abc import Callable

from .._config import Setting, get_logger, parse_bool, parse_size
from .._dtypes import empty_bytes
from .._memory import Buffer
from ..errors import ProtocolError, TransportError
from ..errors import TimeoutError as AcollTimeoutError
from .base import (
    META_SIZE,
    Capability,
    Connection,
    ConnectionLost,
    PeerInfo,
    QueuedListener,
    Transport,
)
from .lifecycle import call_failure_callback
from .matching import Matcher, Message

__all__ = ["DISABLE", "EAGER", "InprocConnection", "InprocListener", "InprocTransport",
           "make_inproc"]

log = get_logger("NET")

DISABLE = Setting("INPROC_DISABLE", parse_bool, False,
                  "Never use the in-process transport (ranks of one process then use the "
                  "network).", "NET")
EAGER = Setting("INPROC_EAGER", parse_size, 64 << 10,
                "In-process messages up to this size that arrive before their receive are "
                "copied at once (the send completes); larger ones wait, by reference, until "
                "the receive is posted.", "NET")

_SLICE = 256 << 10  # bytes a connection's copy queue moves per loop step
_SYNC_COPY = 64 << 10  # copies up to this size are done at once, outside the queue
_HANDLE = struct.Struct("<4s16sQ16s")
_MAGIC = b"ACIP"

_process = os.urandom(16)  # this process, among every process that might see a handle
_listeners: weakref.WeakValueDictionary[bytes, InprocListener] = weakref.WeakValueDictionary()


def _forked() -> None:
    global _process
    _process = os.urandom(16)  # a forked child is another process ...
    _listeners.clear()  # ... and its copies of the parent's listeners serve nobody


os.register_at_fork(after_in_child=_forked)

# _Send.state
_HELD, _COPYING, _STORED = 0, 1, 2


class _Send:
    """One sent message until the receiver has it. ``view`` is what the receiver copies
    from: the sender's buffer (held, copying) or a private copy (stored)."""

    __slots__ = ("dead", "fut", "job", "meta", "owner", "state", "tag", "view")

    def __init__(self, owner: InprocConnection, fut: asyncio.Future[None], view: memoryview,
                 tag: int, meta: bytes) -> None:
        self.owner = owner
        self.fut: asyncio.Future[None] | None = fut  # None once completed or failed
        self.view = view
        self.tag = tag
        self.meta = meta
        self.state = _HELD
        self.job: _Copy | None = None  # the copy that converts it into storage (closing)
        self.dead = False  # the sender gave up its buffer (aborted): do not read ``view``


class _Copy:
    """A copy run by a connection's queue: into a receive, or a held send into storage."""

    __slots__ = ("dead", "dst", "meta", "pos", "send", "src", "token")

    def __init__(self, src: memoryview, dst: memoryview, send: _Send | None,
                 token: asyncio.Future[bytes] | None, meta: bytes) -> None:
        self.src = src
        self.dst = dst
        self.send = send
        self.token = token  # the receive it fills (None: converting ``send`` to storage)
        self.meta = meta
        self.pos = 0
        self.dead = False


_Msg = Message[asyncio.Future[bytes], _Send]


class InprocConnection(Connection):
    """One end of an in-process connection (see the module doc). Made in pairs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, eager: int) -> None:
        self._loop = loop
        self.peer_name = name
        self._eager = eager
        self._peer: InprocConnection | None = None
        self._match: Matcher[asyncio.Future[bytes], _Send] = Matcher(_storage)
        self._sends: set[_Send] = set()  # this end's sends not completed yet
        self._jobs: deque[_Copy] = deque()
        self._pumping = False  # a _pump is scheduled
        self._failed: ConnectionLost | None = None
        self._on_failure: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        self._notice = b""
        self._released: asyncio.Future[None] = loop.create_future()

    @classmethod
    def pair(cls, loop: asyncio.AbstractEventLoop, eager: int
             ) -> tuple[InprocConnection, InprocConnection]:
        """Two connected ends (the connector's, the acceptor's)."""
        a, b = cls(loop, "inproc acceptor", eager), cls(loop, "inproc connector", eager)
        a._peer, b._peer = b, a
        return a, b

    # ------------------------------------------------------------------ public
    @property
    def failed(self) -> ConnectionLost | None:
        return self._failed

    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        self._on_failure = callback
        if self._failed is not None:
            self._loop.call_soon(call_failure_callback, callback, self._failed)

    def isend(self, buffer: Buffer, tag: int, meta: bytes = bytes(META_SIZE)
              ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self._failed is not None or self._closing or self._peer is None:
            fut.set_exception(self._failed or ConnectionLost("connection is closing"))
            fut.exception()  # awaiting it still raises; abandoned, it must not log
            return fut
        view = buffer.view()
        send = _Send(self, fut, view, tag, bytes(meta))
        self._sends.add(send)
        peer = self._peer
        try:
            msg = peer._match.hold(tag, view.nbytes, send.meta, send)
        except ProtocolError as exc:  # the tag was reused before its message was received
            self._sends.discard(send)
            fut.set_exception(exc)
            return fut
        if msg is not None:
            peer._deliver(msg)
            return fut
        if peer._match.arrivals:
            for early in peer._match.take_arrivals():
                peer._notify_arrival(peer._loop, *early)
        if view.nbytes <= self._eager:  # eager: keep a copy, the send is done
            send.view = memoryview(bytes(view))
            send.state = _STORED
            self._settle(send, None)
        return fut

    def irecv(self, buffer: Buffer, tag: int) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = self._loop.create_future()
        try:
            msg = self._match.post(tag, buffer.view(), fut)
        except ProtocolError as exc:
            fut.set_exception(exc)
            return fut
        if msg is not None:
            self._deliver(msg)
        return fut

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        if self._closing or self._failed is not None:
            return
        self._closing = True
        self._notice = bytes(notice)
        lost = ConnectionLost("the connection was closed locally")
        self._fail_receives(lost, keep=False)
        for send in list(self._sends):
            if send.state != _HELD:
                continue  # being copied by the peer: it finishes
            peer = self._peer
            if drop_queued:
                if peer is not None:
                    peer._match.withdraw(send.tag, send)
                self._settle(send, lost)
            else:  # everything sent before an orderly close is delivered: keep a copy
                job = _Copy(send.view, _storage(send.view.nbytes), send, None, b"")
                send.job = job
                self._start(job)
        self._maybe_closed()

    def abort(self) -> None:
        if self._failed is None:
            self._end(ConnectionLost("the connection was aborted locally"), tell_peer=True,
                      report=False)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._released)

    # ------------------------------------------------------------------ delivery
    def _deliver(self, msg: _Msg) -> None:
        """Carry out a delivery of this end's matcher (see :class:`~.matching.Message`)."""
        fut, send = msg.token, msg.ref
        if msg.error is not None or send is None or send.dead:
            error = msg.error or ConnectionLost(f"{self.peer_name} dropped the message")
            if fut is not None and not fut.done():
                fut.set_exception(error)
                fut.exception()  # awaiting it still raises; abandoned, it must not log
            if send is not None:  # the message is dropped: the sender's buffer is free
                _release(send)
            return
        assert fut is not None
        assert msg.dest is not None
        if send.state == _HELD:
            send.state = _COPYING
            if send.job is not None:  # it was being converted to storage: no need now
                send.job.dead = True
                send.job = None
        self._start(_Copy(send.view, msg.dest, send, fut, msg.meta))

    def _start(self, job: _Copy) -> None:
        """Copy small jobs now; queue larger ones, and start the queue if it is idle."""
        if job.dst.nbytes <= _SYNC_COPY:
            job.dst[:] = job.src
            self._copied(job)
            return
        self._jobs.append(job)
        if not self._pumping:
            self._pump()  # the first piece at once

    def _pump(self) -> None:
        """Move up to ``_SLICE`` bytes of queued copies, round robin; again next step."""
        self._pumping = False
        try:
            budget = _SLICE
            jobs = self._jobs
            while jobs and budget > 0:
                job = jobs.popleft()
                if job.dead:
                    continue
                send = job.send
                if send is not None and send.dead and job.token is not None:
                    self._fail_copy(job, ConnectionLost(
                        f"{self.peer_name} failed while its message was being received"))
                    continue
                pos = job.pos
                end = min(pos + budget, job.dst.nbytes)
                job.dst[pos:end] = job.src[pos:end]
                budget -= end - pos
                job.pos = end
                if end < job.dst.nbytes:
                    jobs.append(job)
                else:
                    self._copied(job)
            if jobs:
                self._pumping = True
                self._loop.call_soon(self._pump)
        except Exception as exc:
            self._internal_error("copying", exc)

    def _copied(self, job: _Copy) -> None:
        send = job.send
        if job.token is None:  # a held send converted to storage
            assert send is not None
            send.view, send.state, send.job = job.dst, _STORED, None
            self._settle(send, None)
            return
        if not job.token.done():
            job.token.set_result(job.meta)
        if send is not None:
            _release(send)

    def _fail_copy(self, job: _Copy, exc: Exception) -> None:
        job.dead = True
        if job.token is not None and not job.token.done():
            job.token.set_exception(exc)
            job.token.exception()
        if job.send is not None and job.token is not None:
            _release(job.send)

    def _settle(self, send: _Send, exc: Exception | None) -> None:
        """Complete (or fail) this end's ``send``; once. May finish a pending close."""
        fut = send.fut
        if fut is None:
            return
        send.fut = None
        self._sends.discard(send)
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
                fut.exception()
        if self._closing:
            self._maybe_closed()

    # ------------------------------------------------------------------ the end
    def _fail_receives(self, exc: ConnectionLost, *, keep: bool) -> None:
        """Fail this end's receives; with ``keep`` (the peer closed in order), complete
        early messages stay receivable and copies under way finish."""
        msgs = self._match.peer_closed(exc) if keep else self._match.fail(exc)
        for msg in msgs:
            self._deliver(msg)
        if not keep:
            for job in self._jobs:
                if job.token is not None:
                    self._fail_copy(job, exc)

    def _maybe_closed(self) -> None:
        """Closing, and every send finished: tell the peer (next step), release."""
        if self._sends or self._released.done() or self._failed is not None:
            return
        self._failed = ConnectionLost("the connection was closed locally", orderly=True)
        peer, self._peer = self._peer, None
        if peer is not None:
            self._loop.call_soon(peer._peer_ended, ConnectionLost(
                f"{peer.peer_name} closed the connection", orderly=True, notice=self._notice))
        self._released.set_result(None)

    def _peer_ended(self, exc: ConnectionLost) -> None:
        """The peer closed (orderly) or failed; called from the loop."""
        try:
            self._peer = None
            if self._closing and self._failed is None:
                # both closed at once: nothing can complete what is left any more
                for send in list(self._sends):
                    self._settle(send, exc)
                self._maybe_closed()
            self._end(exc, tell_peer=False, report=True)
        except Exception as exc2:
            self._internal_error("ending the connection to", exc2)

    def _end(self, exc: ConnectionLost, *, tell_peer: bool, report: bool) -> None:
        """Fail everything pending with ``exc`` and release; tell the peer if asked.

        With ``report`` (the connection broke: not a local abort or close) the failure
        callback runs first, synchronously, so that the owner's state is updated before
        any waiter resumes; ``report`` is only given from loop callbacks."""
        if self._failed is None:
            self._failed = exc
            if report and self._on_failure is not None and not self._closing:
                call_failure_callback(self._on_failure, exc)
        elif self._released.done():
            return
        peer, self._peer = self._peer, None
        if tell_peer and peer is not None:
            for send in self._sends:
                if send.state == _HELD:
                    peer._match.withdraw(send.tag, send)
                if send.state != _STORED:
                    send.dead = True  # its buffer is given back: nobody may read it now
            self._loop.call_soon(peer._peer_ended, ConnectionLost(
                f"{peer.peer_name} aborted the connection", notice=self._notice))
        self._fail_receives(exc, keep=exc.orderly and not tell_peer)
        for send in list(self._sends):
            if send.job is not None:
                send.job.dead = True
            self._settle(send, exc)
        if not self._released.done():
            self._released.set_result(None)

    def _internal_error(self, what: str, exc: BaseException) -> None:
        """Last resort of every loop callback: a bug fails the connection, never the loop."""
        log.error("internal error while %s %s", what, self.peer_name, exc_info=exc)
        try:
            self._end(ConnectionLost(f"internal error while {what} {self.peer_name}: "
                                     f"{exc!r}"), tell_peer=True, report=True)
        except Exception:
            log.exception("failing the connection to %s raised", self.peer_name)


def _release(send: _Send) -> None:
    """The receiver is done with ``send`` (copied, or dropped it): the sender's buffer is
    free, so its send completes (if it had not yet)."""
    if send.job is not None:
        send.job.dead = True
        send.job = None
    send.owner._settle(send, None)


def _storage(nbytes: int) -> memoryview:
    return empty_bytes(nbytes).data  # pages faulted in as written, no zeroing pass


class InprocListener(QueuedListener):
    """Hands out the acceptor's end of every connection made to ``handle``."""

    def __init__(self, handle: bytes, key: bytes, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.handle = handle
        self.key = key
        self.loop = loop
        _listeners[handle] = self

    def offer(self, hello: bytes, conn: InprocConnection) -> None:
        self._offer(hello, conn)

    def close(self, notice: bytes = b"") -> None:
        if self._closed:
            return
        self._closed = True
        if _listeners.get(self.handle) is self:
            del _listeners[self.handle]
        self._close_queue(notice)


def _parse_handle(handle: bytes) -> tuple[bytes, int] | None:
    """``(process nonce, loop id)`` of an in-process handle, or ``None``."""
    if len(handle) != _HANDLE.size:
        return None
    magic, process, loop_id, _token = _HANDLE.unpack(handle)
    return None if magic != _MAGIC else (process, loop_id)


class InprocTransport(Transport):
    """Ranks in this process and this event loop (see the module doc)."""

    name = "inproc"
    capabilities = Capability.SAME_PROCESS

    def __init__(self, *, key: bytes, eager: int | None = None) -> None:
        if len(key) < 16:
            raise ValueError("InprocTransport needs the job's authentication key")
        self.key = key
        self.eager = EAGER.resolve(eager)

    def can_connect(self, mine: PeerInfo, theirs: PeerInfo) -> bool:
        if not mine.same_process(theirs) or mine.loop != theirs.loop:
            return False
        a = _parse_handle(mine.handles.get(self.name, b""))
        b = _parse_handle(theirs.handles.get(self.name, b""))
        return a is not None and a == b and a[0] == _process

    def joins(self, a: PeerInfo, b: PeerInfo) -> bool:
        """(:meth:`can_connect` without the check that the process is this one.)"""
        if not a.same_process(b) or a.loop != b.loop:
            return False
        x = _parse_handle(a.handles.get(self.name, b""))
        return x is not None and x == _parse_handle(b.handles.get(self.name, b""))

    async def listen(self) -> InprocListener:
        loop = asyncio.get_running_loop()
        handle = _HANDLE.pack(_MAGIC, _process, id(loop), os.urandom(16))
        return InprocListener(handle, self.key, loop)

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> InprocConnection:
        loop = asyncio.get_running_loop()
        where = _parse_handle(handle)
        if where is None:
            raise ProtocolError("bad inproc handle")
        if where != (_process, id(loop)):
            raise TransportError("the inproc handle belongs to another process or event "
                                 "loop")
        await asyncio.sleep(0)  # a connection is made from the loop, like any other
        if loop.time() >= deadline:
            raise AcollTimeoutError("connecting to an inproc listener: deadline passed")
        listener = _listeners.get(handle)
        if listener is None or listener.loop is not loop:
            raise TransportError("no inproc listener behind this handle (closed?)")
        if not hmac.compare_digest(self.key, listener.key):
            log.warning("refused an inproc connection: the two ends hold different job keys")
            raise ProtocolError("the inproc listener and this rank hold different job keys")
        mine, theirs = InprocConnection.pair(loop, self.eager)
        listener.offer(hello, theirs)
        return mine


def make_inproc(*, timeout: float, key: bytes, nranks: int = 0) -> InprocTransport | None:
    """The in-process transport for :func:`~.select.select_transports`, or ``None`` when
    ``ACOLL_INPROC_DISABLE`` turns it off. ``timeout`` is unused (nothing waits)."""
    del timeout
    if DISABLE.resolve():
        log.info("in-process transport disabled (ACOLL_INPROC_DISABLE)")
        return None
    return InprocTransport(key=key)
