"""This rank's connections to its peers, each over the transport chosen for that pair.

Selection follows NCCL's ``selectTransport``: for each peer, the first transport of this
rank's ordered list (in-process, then the network; shared memory and GPU transports slot
in between) that both ranks serve and whose ``can_connect`` accepts the pair. Both ranks
compute the same answer from the two :class:`~acoll._transport.base.PeerInfo` records, so
the lower rank dials over it and the higher one accepts only a connection that arrives on
that transport's listener. Connections are made on first use.

A device communicator's connections over a transport that moves host memory only (for
that device: :meth:`~acoll._transport.base.Transport.memory_for`) are staged through host
buffers (:mod:`acoll._transport.staged`).

A connection that breaks is reported through ``on_lost(peer, error)``; a message that
arrives before its receive is posted through ``on_arrival(peer, tag, meta)``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgpack

from .._bootstrap.ring import error_from_wire
from .._bootstrap.wire import Error as WireError
from .._config import get_logger
from .._deadline import deadline_after, outcome_dropped_if_cancelled, wait_for
from .._memory import Staging
from .._transport.base import (
    Connection,
    ConnectionLost,
    Listener,
    PeerInfo,
    QueuedListener,
    Transport,
)
from .._transport.staged import staged
from .._transport.tcp import RawLink, TcpTransport
from .._transport.window import windowed
from ..errors import AcollError, ClosedError, InvalidUsage, RemoteError
from ..errors import TimeoutError as AcollTimeoutError

#: Seconds a rank whose dial was refused waits for a failure notice before it reports
#: the refusal: a peer that stopped listening failed (or closed), and its notice, which
#: names the cause every rank should report, is usually a few milliseconds behind.
REFUSED_GRACE_S = 0.5

__all__ = ["PeerLinks", "choose_transport", "error_for_lost"]

log = get_logger("INIT")


def choose_transport(transports: Sequence[Transport], mine: PeerInfo, theirs: PeerInfo
                     ) -> Transport:
    """The first of ``transports`` that both ranks serve and that can join them.

    Raises:
        InvalidUsage: no transport is common to both (e.g. ranks forced to different
            networks with ``ACOLL_NET``).
    """
    for transport in transports:
        if (transport.name in mine.handles and transport.name in theirs.handles
                and transport.can_connect(mine, theirs)):
            return transport
    raise InvalidUsage(f"rank {mine.rank} serves {sorted(mine.handles)} and rank "
                       f"{theirs.rank} serves {sorted(theirs.handles)}: no transport joins "
                       "them (do ACOLL_NET or the *_DISABLE settings differ?)")


def error_for_lost(peer: int, lost: ConnectionLost) -> AcollError | None:
    """What a connection to ``peer`` ending with ``lost`` means for the communicator:
    the error the peer announced in its close notice, a crash, or ``None`` for an orderly
    close without a notice (the peer closed the communicator)."""
    if lost.orderly and not lost.notice:
        return None
    if lost.notice:
        try:
            body = msgpack.unpackb(lost.notice)
            return error_from_wire(WireError(str(body["kind"]), str(body["message"]),
                                             int(body["rank"])), via=peer)
        except Exception:
            return RemoteError(f"rank {peer} failed (unreadable notice)", peer)
    return RemoteError(f"rank {peer} is gone: {lost} (process died, aborted, or the "
                       "network failed)", peer)


class PeerLinks:
    """Connections to every peer, made on demand (see the module docstring).

    ``endpoints`` are this rank's transports in preference order, each with its listener;
    ``infos`` every rank's record, in rank order; ``staging`` the memory space's staging
    primitives (``None``: host memory).
    """

    def __init__(self, rank: int, infos: Sequence[PeerInfo],
                 endpoints: Sequence[tuple[Transport, Listener]], timeout: float,
                 on_lost: Callable[[int, ConnectionLost], None],
                 on_arrival: Callable[[int, int, bytes], None],
                 on_error: Callable[[AcollError], None],
                 staging: Staging | None = None) -> None:
        self.rank = rank
        self._staging = staging
        self.size = len(infos)
        self.timeout = timeout
        self._endpoints = list(endpoints)
        self._on_lost = on_lost
        self._on_arrival = on_arrival
        self._on_error = on_error
        me = infos[rank]
        transports = [t for t, _ in endpoints]
        self.choice: list[Transport | None] = [
            None if p == rank else choose_transport(transports, me, infos[p])
            for p in range(self.size)]
        self._handles = [info.handles for info in infos]
        self.conns: dict[int, Connection] = {}
        self._connecting: dict[int, asyncio.Future[Connection]] = {}
        # raw links (the native ring's): dialed by the sender, one per direction
        self._raw_in: dict[int, asyncio.Future[RawLink]] = {}
        self._raw: list[RawLink] = []
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._stop_seen = asyncio.Event()
        # Why this rank failed (fail_all's notice), and the connections made after that,
        # which carry it too (a dial begun before the failure that ended after it).
        self._notice = b""
        self._late: list[Connection] = []
        self._stop_error: AcollError | None = None  # (what stop() fails waits with)
        for transport, listener in self._endpoints:
            self._spawn(self._accept_loop(transport, listener))
        counts: dict[str, int] = {}
        for t in self.choice:
            if t is not None:
                counts[t.name] = counts.get(t.name, 0) + 1
        log.info("rank %d: transports per peer: %s", rank,
                 ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none")
        for peer, chosen in enumerate(self.choice):  # every pair, at ACOLL_DEBUG=TRACE
            if chosen is not None:
                log.debug("rank %d -> rank %d: %s", rank, peer, chosen.name)

    def transport_for(self, peer: int) -> Transport | None:
        return self.choice[peer]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("rank %d: connection task failed: %r", self.rank, exc)
            if isinstance(exc, AcollError):
                self._on_error(exc)
            elif isinstance(exc, Exception):
                # (not acoll's own: a defect, or a system call refusing a value; the
                # connection it was making will never come, so fail now, not at the
                # deadline)
                self._on_error(RemoteError(f"rank {self.rank} failed making a connection: "
                                           f"{exc!r}", self.rank))

    # ------------------------------------------------------------------ making connections
    def _hello(self, peer: int) -> bytes:
        # The transport proved that the connector holds the job's key and bound these
        # bytes into that proof; here they only say which rank connects to which.
        return msgpack.packb({"rank": self.rank, "to": peer})

    async def _accept_loop(self, transport: Transport, listener: Listener) -> None:
        while True:
            try:
                hello, conn = await listener.accept()
            except ClosedError:
                return
            try:
                info = msgpack.unpackb(hello)
                peer, to = info["rank"], info["to"]
                raw = bool(info.get("raw", False))
            except Exception:
                peer, to, raw = -1, -1, False
            if raw or isinstance(conn, RawLink):
                self._raw_arrived(transport, peer, to, raw, conn)
                continue
            if to != self.rank or not isinstance(peer, int) or not (
                    0 <= peer < self.size) or peer == self.rank or peer in self.conns or (
                    self.choice[peer] is not transport):
                log.warning("rank %d: refused a %s connection (hello from rank %s)",
                            self.rank, transport.name, peer)
                conn.abort()
                continue
            self._register(peer, conn)

    def _register(self, peer: int, conn: Connection) -> None:
        if self._stopped:
            if self._notice:  # (the peer may be waiting on it: it learns why, not "gone")
                conn.close(self._notice, drop_queued=True)
                self._late.append(conn)
            else:
                conn.abort()
            return
        transport = self.choice[peer]
        assert transport is not None
        conn = staged(windowed(conn), self._staging, transport.memory_for(self._staging))
        self.conns[peer] = conn
        conn.set_failure_callback(lambda lost: self._on_lost(peer, lost))
        conn.set_arrival_callback(lambda tag, meta: self._on_arrival(peer, tag, meta))
        fut = self._connecting.pop(peer, None)
        if fut is not None and not fut.done():
            fut.set_result(conn)

    async def get(self, peer: int) -> Connection:
        """The connection to ``peer``; the lower rank dials, the higher one waits for it."""
        conn = self.conns.get(peer)
        if conn is not None:
            return conn
        fut = self._connecting.get(peer)
        if fut is None:
            fut = self._loop.create_future()
            self._connecting[peer] = fut
            if self.rank < peer:
                self._spawn(self._dial(peer, fut))
        return await fut

    async def _dial(self, peer: int, fut: asyncio.Future[Connection]) -> None:
        transport = self.choice[peer]
        assert transport is not None
        try:
            conn = await transport.connect(self._handles[peer][transport.name],
                                           self._hello(peer), deadline_after(self.timeout))
        except AcollError as exc:
            err = exc if isinstance(exc, AcollTimeoutError) else RemoteError(
                f"rank {self.rank} cannot connect to rank {peer} over {transport.name}: "
                f"{exc}", peer)
            if err is not exc and not self._stopped:
                # (a stop() meanwhile fails ``fut`` with the communicator's error instead)
                with contextlib.suppress(asyncio.TimeoutError):  # (3.10: not the builtin)
                    await wait_for(self._stop_seen.wait(),
                                   min(REFUSED_GRACE_S, self.timeout / 4))
            if not fut.done():
                fut.set_exception(err)
            self._on_error(err)
            return
        self._register(peer, conn)

    # ------------------------------------------------------------------ raw links
    def stopped(self) -> bool:
        return self._stopped

    async def raw_to(self, peer: int) -> RawLink:
        """Dial a raw link to ``peer`` (this rank sends on it; see :class:`RawLink`)."""
        transport = self.choice[peer]
        if self._stopped:
            raise ClosedError("the communicator is closed")
        assert isinstance(transport, TcpTransport)
        hello = msgpack.packb({"rank": self.rank, "to": peer, "raw": True})
        try:
            link = await transport.connect_raw(self._handles[peer][transport.name], hello,
                                               deadline_after(self.timeout))
        except AcollError as exc:
            if isinstance(exc, AcollTimeoutError):
                raise
            raise RemoteError(f"rank {self.rank} cannot open a native ring link to rank "
                              f"{peer}: {exc}", peer) from exc
        self._raw.append(link)
        if self.stopped():  # (stopped while it was being made: abort_all already ran)
            link.abort()
            raise ClosedError("the communicator is closed")
        return link

    async def raw_from(self, peer: int) -> RawLink:
        """The raw link ``peer`` dials to this rank (waits for it; raises the
        communicator's error at once once it stopped, as a wait begun before does)."""
        fut = self._raw_in.get(peer)
        if fut is None:
            if self._stop_error is not None:  # (a future made now would never be settled)
                raise self._stop_error
            fut = self._raw_in[peer] = self._loop.create_future()
        return await asyncio.shield(fut)

    def _raw_arrived(self, transport: Transport, peer: int, to: int, raw: bool,
                     conn: Connection) -> None:
        fut = self._raw_in.get(peer) if isinstance(peer, int) else None
        if (not raw or not isinstance(conn, RawLink) or to != self.rank
                or not isinstance(peer, int) or not 0 <= peer < self.size
                or peer == self.rank or self.choice[peer] is not transport
                or self._stopped or (fut is not None and fut.done())):
            log.warning("rank %d: refused a raw %s link (hello from rank %s)", self.rank,
                        transport.name, peer)
            conn.abort()
            return
        if fut is None:
            fut = self._raw_in[peer] = self._loop.create_future()
        self._raw.append(conn)
        fut.set_result(conn)

    # ------------------------------------------------------------------ ending
    def stop(self, error: AcollError | None) -> None:
        """Stop accepting; fail waiters for connections not made yet with ``error``."""
        self._stopped = True
        self._stop_seen.set()
        err = self._stop_error = error or ClosedError("the communicator is closed")
        for fut in self._connecting.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._connecting.clear()
        for raw in self._raw_in.values():
            if not raw.done():
                raw.set_exception(err)
                raw.exception()
        for _, listener in self._endpoints:
            if self._notice and isinstance(listener, QueuedListener):
                listener.close(self._notice)  # (fail_all's: see QueuedListener)
            else:  # (a plugin's listener may take no notice)
                listener.close()

    def fail_all(self, notice: bytes) -> None:
        """Tell every connected peer why we failed (dropping queued sends), then stop."""
        self._notice = notice
        for conn in list(self.conns.values()):
            conn.close(notice, drop_queued=True)

    def abort_all(self) -> None:
        for conn in [*self.conns.values(), *self._late]:
            conn.abort()
        for link in self._raw:
            link.abort()

    async def close_all(self, linger: float) -> None:
        """Orderly close of every connection, waiting at most ``linger`` seconds."""
        for conn in self.conns.values():
            conn.close()
        waits = [conn.wait_closed() for conn in self.conns.values()]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(outcome_dropped_if_cancelled(asyncio.gather(*waits)),
                                       linger)
        self.abort_all()

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def wait_tasks(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def close_transports(self) -> None:
        for transport, _ in self._endpoints:
            transport.close()
