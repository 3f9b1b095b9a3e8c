"""The root server: collects every rank's address and hands out ring neighbours.

One :class:`RootServer` serves one communicator and then stops. It accepts connections in
any order; each must authenticate (:mod:`acoll._auth`: the root's challenge answered by a
:class:`~.wire.Hello` whose proof binds its rank; connections that fail are closed and
logged, and the job goes on). Unauthenticated connections are bounded in number, time and
frame size. Once all ``nranks`` ranks have said hello, each gets a :class:`~.wire.RingInfo`
naming the next rank's address. Up to ``ACOLL_ROOT_TABLE_MAX`` ranks it also carries every
rank's info record, and the server stops; above that the ranks all-gather their records over
the bootstrap network, and the server stops listening but keeps every connection until
each rank has said it has them (an :class:`~.wire.Error` of kind ``closed``; a rank that
then closes its connection is not leaving): a rank that leaves or fails during
the all-gather is the only one that knows, and through the root the others hear at once
instead of waiting out their deadlines on a rank that will never send.

Failures are sent to every rank that is, or later becomes, connected, as an
:class:`~.wire.Error` frame, so every rank raises the same error instead of hanging:

- two hellos claiming one rank, a rank out of range, or ranks disagreeing on ``nranks``
  -> ``usage`` (ranks raise :class:`~acoll.InvalidUsage`);
- not all ranks arrived within ``timeout`` seconds of the first hello, or a rank that
  arrived gave up waiting for them (its own deadline passed: it says so before closing)
  -> ``timeout``;
- a rank that arrived left before the others did (cancelled, its process ended: its
  connection closed) -> ``remote``, naming it;
- during the all-gather that follows above ``ACOLL_ROOT_TABLE_MAX`` ranks: a rank that
  left -> ``remote`` naming it, a rank that failed -> its own error, passed on.

A rank connecting after the failure gets it too, saying that the id is spent.

The server runs as an asyncio task: in the caller's loop, or (for synchronous callers of
``get_unique_id``) in one background thread's loop shared by every root of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from .. import _auth, _forkguard
from .. import _topology as topo
from .._config import Setting, get_logger
from .._deadline import deadline_after, wait_for, wait_until
from ..errors import AcollError
from ..errors import TimeoutError as AcollTimeoutError
from .stream import (
    FramedConnection,
    close_if_cancelled,
    close_server,
    evict,
    leave_gate,
    serve_stream,
)
from .wire import Error, Hello, RingInfo

__all__ = ["RootServer", "listen_socket", "start_root"]

log = get_logger("BOOTSTRAP")

ROOT_TABLE_MAX = Setting(
    "ROOT_TABLE_MAX", int, 4096,
    "Up to this many ranks the root sends every rank all ranks' information (one message "
    "each, no all-gather); above it ranks all-gather over the bootstrap network.",
    "BOOTSTRAP", lo=1)

#: How long the root tries to deliver its last frames before closing a connection.
_REPLY_TIMEOUT = 10.0
#: Root bootstrap connections authenticate under this context.
ROOT_CONTEXT = b"root"


def listen_socket(sockaddr: tuple[Any, ...], family: socket.AddressFamily,
                  reuse: bool = False) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (port 0 lets the kernel choose).

    ``reuse`` sets ``SO_REUSEADDR`` for fixed ports (``ACOLL_COMM_ID``), as NCCL does.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    _forkguard.hold(sock)
    return sock


class RootServer:
    """Serves one communicator's bootstrap, then stops. See the module docstring."""

    def __init__(self, sock: socket.socket, key: bytes, timeout: float) -> None:
        try:  # (here, so that a bad setting reaches the caller, not the server's task)
            self.table_max = ROOT_TABLE_MAX.resolve()
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.key = key
        self.timeout = timeout
        self.where = "{}:{}".format(*sock.getsockname()[:2])
        self.hellos: dict[int, Hello] = {}
        self.conns: dict[int, FramedConnection] = {}
        self.nranks: int | None = None
        self.failure: Error | None = None
        self._done = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._gate = _auth.PreAuthGate()
        self._refusals = _auth.RefusalLog(log)
        self._preauth_timeout = _auth.PREAUTH_TIMEOUT.resolve()
        # After a failure the root answers late ranks for ``timeout`` seconds, unless this
        # is set (abandon: stop lingering now, or at once if not started).
        self._unlinger = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._handed_out = False  # the ring went out; ranks all-gather (see _hand_out_ring)
        self._gathered: set[int] = set()  # ranks that said the all-gather ended for them

    async def serve(self) -> None:
        """Run until the ring is handed out or the job failed; never raises."""
        try:
            server = await serve_stream(self._on_connect, self.sock)
        except OSError as exc:
            log.warning("root %s could not start: %s", self.where, exc)
            self.sock.close()
            return
        log.info("root listening on %s", self.where)
        self._server = server
        try:
            await self._done.wait()
            if self.failure is not None and not self._handed_out:
                # Keep answering late ranks with the error for the rest of the timeout
                # (not once every rank had come: none is late then).
                with contextlib.suppress(asyncio.TimeoutError):
                    await wait_for(self._unlinger.wait(), self.timeout)
        finally:
            # Also reached when the loop shuts down and cancels this task: release every
            # socket before returning so nothing outlives the loop. Not ``async with
            # server``: from Python 3.12.1 its exit waits, without bound, for every
            # connection it accepted to be closed, and ours are closed only below.
            self._stopped = True
            close_server(server)
            for task in list(self._handlers):
                task.cancel()
            if self._handlers:
                await asyncio.gather(*self._handlers, return_exceptions=True)
            for conn in self.conns.values():
                conn.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.sleep(0)  # (close_server closes it a step later: see ring)
                await wait_for(server.wait_closed(), 1.0)
            log.info("root %s stopped", self.where)

    def stop(self) -> None:
        """Stop serving now (call from the loop the server runs in)."""
        self._done.set()

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopped:  # (accepted as the server closed)
            writer.transport.abort()
            return
        token: list[int] = []
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer, token))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        task.add_done_callback(functools.partial(close_if_cancelled, writer))
        # Counted from the moment the connection exists, not when its task first runs.
        token.append(self._gate.admit(functools.partial(evict, writer, task)))
        task.add_done_callback(functools.partial(leave_gate, self._gate, token[0]))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      token: list[int]) -> None:
        conn = FramedConnection(reader, writer)
        msg = await conn.accept_or_refuse(self.key, ROOT_CONTEXT, self._preauth_timeout,
                                          self._refusals, f"root {self.where}")
        if msg is None:
            return
        self._gate.leave(token[0])  # (authenticated: its task may live on, see _until_left)
        if not isinstance(msg, Hello):
            log.warning("root %s: refused connection from %s: not a rank's hello", self.where,
                        conn.peer)
            conn.close()
            return
        if self._handed_out and self.failure is None:  # (accepted as the listener closed)
            # Not a failure of the formation, which has every rank it needs.
            await self._send_and_close(conn, Error("usage", f"rank {msg.rank} came after "
                                                   f"all {self.nranks} ranks of this id had "
                                                   "arrived (started twice?)", msg.rank))
            return
        if self.failure is not None:
            late = Error(self.failure.kind, f"{self.failure.message} (this id's formation "
                         "has failed: form again with a new id from get_unique_id(), or, "
                         "under ACOLL_COMM_ID, once every rank's init_rank has ended)",
                         self.failure.rank)
            await self._send_and_close(conn, late)
            return
        problem = self._check(msg)
        self.conns.setdefault(msg.rank, conn)
        if problem is not None:
            self._fail(Error("usage", problem, msg.rank), extra=conn)
            return
        if not self.hellos:
            watchdog = asyncio.get_running_loop().create_task(self._watchdog())
            self._handlers.add(watchdog)
            watchdog.add_done_callback(self._handlers.discard)
        self.hellos[msg.rank] = msg
        log.debug("root %s: rank %d/%d arrived", self.where, msg.rank, msg.nranks)
        if self.nranks is not None and len(self.hellos) == self.nranks:
            self._hand_out_ring()
            if self._done.is_set():
                return
        await self._until_left(conn, msg)

    async def _until_left(self, conn: FramedConnection, hello: Hello) -> None:
        """Watch an arrived rank until the formation no longer needs the root. Before the
        ring goes out a rank sends nothing after its hello, so its connection ends only
        when it gives up (its init_rank timed out or was cancelled, its process ended):
        then the formation fails at once for everyone, instead of at each rank's
        deadline, and the rank's claim cannot confuse a later attempt with the same id
        (found by review, session 56: a retry read "ranks disagree on nranks: rank 0
        passed 3, rank 0 passed 2"). During the all-gather (above ROOT_TABLE_MAX ranks)
        a rank sends that the all-gather ended for it, or why it failed; the root keeps
        its connection until every rank said so, so that a failure elsewhere reaches the
        ranks that finished early too (their next step would fail on the failed rank's
        closed sockets, naming that one instead: found by review, session 58)."""
        while True:
            extra: object = None
            try:
                extra = await conn.recv()
            except (AcollError, OSError):
                pass
            if self.conns.get(hello.rank) is not conn:
                return
            gathered = hello.rank in self._gathered
            if (self._handed_out and isinstance(extra, Error) and extra.kind == "closed"
                    and not gathered):
                self._gathered.add(hello.rank)
                if len(self._gathered) == self.nranks:
                    log.info("root %s: every rank has every rank's info", self.where)
                    self._finish()
                    return
                continue
            if gathered and not isinstance(extra, Error):
                # It went on, then closed or aborted its communicator: the others learn of
                # that from their own connections to it (were it "leaving", a rank that
                # closed at once could fail a peer whose frame the root has yet to read).
                del self.conns[hello.rank]
                conn.close()
                return
            self._left(hello.rank, extra)
            return

    def abandon(self, rank: int, exc: BaseException) -> None:
        """The rank hosting this root (``ACOLL_COMM_ID``) gave up its ``init_rank`` with
        ``exc``: the formation fails for the ranks that came as if that rank's connection
        had ended (:meth:`_until_left`; found by review, session 57: they read "connection
        closed by the peer"), then the root stops at once, not lingering, so that the
        fixed port is free for a retry (also when it lingers already: found by review,
        session 58)."""
        self._unlinger.set()
        if self._handed_out:  # (it failed in the all-gather: pass its error on)
            from .ring import error_to_wire

            self._left(rank, error_to_wire(exc, rank) if isinstance(exc, AcollError)
                       else None)
        else:
            self._left(rank, Error("timeout", "", rank) if isinstance(
                exc, AcollTimeoutError) else None)
        self._done.set()

    def _left(self, rank: int, extra: object) -> None:
        """Rank ``rank`` left before the formation ended (``extra``: what it sent first)."""
        if self._done.is_set():
            return
        if self._handed_out:
            if isinstance(extra, Error) and extra.kind != "closed" and extra.message:
                self._fail(extra)  # (its own failure, naming its cause)
                return
            self._fail(Error("remote", f"rank {rank} left (its init_rank was cancelled or "
                             "failed, or its process ended) during the all-gather of the "
                             "ranks' info records that follows the root's ring", rank))
            return
        n = self.nranks or 0
        missing = sorted(set(range(n)) - set(self.hellos))
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        if isinstance(extra, Error) and extra.kind == "timeout":
            # (its deadline passed waiting for the missing ranks: they are the cause)
            self._fail(Error("timeout", f"ranks [{shown}] of {n} never reached the root at "
                             f"{self.where} within rank {rank}'s timeout",
                             missing[0] if len(missing) == 1 else -1))
            return
        what = ("left (its init_rank was cancelled or failed, or its process ended)"
                if extra is None else f"sent the root an unexpected {type(extra).__name__}")
        self._fail(Error("remote", f"rank {rank} {what} before ranks [{shown}] of {n} "
                         f"reached the root at {self.where}", rank))

    def _check(self, msg: Hello) -> str | None:
        if msg.nranks < 1:
            return f"rank {msg.rank} passed nranks={msg.nranks}; it must be >= 1"
        if self.nranks is None:
            self.nranks = msg.nranks
        elif msg.nranks != self.nranks:
            first = next(iter(self.hellos.values()))
            return (f"ranks disagree on nranks: rank {first.rank} passed {self.nranks}, "
                    f"rank {msg.rank} passed {msg.nranks}")
        if not 0 <= msg.rank < self.nranks:
            return f"rank {msg.rank} is out of range for nranks={self.nranks}"
        if msg.rank in self.hellos:
            other = self.hellos[msg.rank]
            return (f"rank {msg.rank} was claimed twice (pid {other.pid} at {other.addr[0]} "
                    f"and pid {msg.pid} at {msg.addr[0]})")
        return None

    def _hand_out_ring(self) -> None:
        assert self.nranks is not None
        n = self.nranks
        table = tuple(self.hellos[r].info for r in range(n)) if n <= self.table_max else ()
        for rank, conn in self.conns.items():
            nxt = self.hellos[(rank + 1) % n]
            peers = [(frm, self.hellos[frm].addr) for _, frm in topo.dissemination(rank, n)]
            with contextlib.suppress(AcollError):
                conn.send(RingInfo(n, nxt.addr, tuple(peers), table))
        log.info("root %s: all %d ranks arrived, ring handed out", self.where, n)
        self._handed_out = True
        if table:
            self._finish()
        else:  # the ranks all-gather their records: stay until each has them (_until_left)
            if self._server is not None:  # (no hello can be valid now: free the port at
                close_server(self._server)  # once, found by review, session 58)

    def _finish(self, extra: FramedConnection | None = None) -> None:
        for conn in {*self.conns.values(), *([extra] if extra else [])}:
            task = asyncio.get_running_loop().create_task(self._drain_and_close(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        self.conns = {}
        self._done.set()

    def _fail(self, error: Error, extra: FramedConnection | None = None) -> None:
        if self.failure is not None:
            return
        self.failure = error
        log.warning("root %s: job failed: %s", self.where, error.message)
        for conn in {*self.conns.values(), *([extra] if extra else [])}:
            with contextlib.suppress(AcollError):
                conn.send(error)
        self._finish(extra)

    async def _send_and_close(self, conn: FramedConnection, msg: Error) -> None:
        with contextlib.suppress(AcollError):
            conn.send(msg)
        await self._drain_and_close(conn)

    @staticmethod
    async def _drain_and_close(conn: FramedConnection) -> None:
        try:
            await wait_until(conn.drain(), deadline_after(_REPLY_TIMEOUT), "root reply")
        except (AcollError, AcollTimeoutError, OSError):
            pass
        finally:
            conn.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await wait_for(conn.writer.wait_closed(), 1.0)

    async def _watchdog(self) -> None:
        await asyncio.sleep(self.timeout)
        if self._handed_out:
            # Each all-gather step has the ranks' own deadlines, which they report here.
            # This bounds only the root's stay (a rank's host vanished without a word):
            # it then stops relaying without failing anyone (the ranks' timeouts may be
            # longer than its own; found by review, session 58), and the ranks go on.
            n = self.nranks or 1
            await asyncio.sleep(self.timeout * (n - 1).bit_length() + _REPLY_TIMEOUT)
            if not self._done.is_set():
                log.info("root %s: stops relaying failures; ranks %s had not finished the "
                         "all-gather", self.where, sorted(set(range(n)) - self._gathered))
                self._finish()
            return
        if not self._done.is_set():
            n = self.nranks or 0
            missing = sorted(set(range(n)) - set(self.hellos))
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            self._fail(Error("timeout", f"ranks [{shown}] of {n} never reached the root at "
                             f"{self.where} within {self.timeout:g} s",
                             missing[0] if len(missing) == 1 else -1))


class _RootThread:
    """One daemon thread with its own loop, serving the roots of synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="acoll-root",
                                       daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, None]) -> Future[None]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_root_thread: _RootThread | None = None
_root_thread_lock = threading.Lock()
_root_tasks: set[asyncio.Task[None]] = set()


def start_root(server: RootServer) -> None:
    """Run ``server`` in the running loop if there is one, else in the root thread."""
    global _root_thread
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        with _root_thread_lock:
            if _root_thread is None:
                _root_thread = _RootThread()
            thread = _root_thread
        thread.submit(server.serve())
        return
    task = loop.create_task(server.serve(), name=f"acoll-root-{server.where}")
    _root_tasks.add(task)
    task.add_done_callback(_root_tasks.discard)
    # A task cancelled before it first ran (loop shutting down) never reaches serve()'s
    # cleanup: close the listening socket here too (closing twice is harmless).
    task.add_done_callback(lambda _t: server.sock.close())
