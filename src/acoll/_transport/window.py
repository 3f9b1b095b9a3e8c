"""Posting windows for connections that cap the operations in flight.

A transport whose connections set :attr:`~.base.Connection.max_inflight` (RDMA: receive
buffers advertised to the peer, send credits) accepts at most that many unfinished posted
operations per direction. :class:`WindowedConnection` lets callers post any number: the
excess waits in a FIFO per direction and is posted, in order, as earlier operations
finish. The caller's futures complete exactly as the posted ones do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from .._memory import Buffer
from .base import Connection, ConnectionLost
from .lifecycle import call_failure_callback

__all__ = ["WindowedConnection", "windowed"]


class _Direction:
    """One direction's window: posts through ``post`` while fewer than ``limit`` run."""

    __slots__ = ("drained", "inflight", "limit", "post", "queue")

    def __init__(self, limit: int, post: Callable[..., asyncio.Future[Any]]) -> None:
        self.limit = limit
        self.post = post
        self.inflight = 0
        self.queue: deque[tuple[asyncio.Future[Any], tuple[Any, ...]]] = deque()
        self.drained: Callable[[], None] | None = None  # called once the queue empties

    def submit(self, outer: asyncio.Future[Any], args: tuple[Any, ...]) -> None:
        if self.inflight < self.limit and not self.queue:
            self._start(outer, args)
        else:
            self.queue.append((outer, args))

    def _start(self, outer: asyncio.Future[Any], args: tuple[Any, ...]) -> None:
        self.inflight += 1
        inner = self.post(*args)
        inner.add_done_callback(lambda f: self._finished(outer, f))

    def _finished(self, outer: asyncio.Future[Any], inner: asyncio.Future[Any]) -> None:
        self.inflight -= 1
        if not outer.done():
            exc = inner.exception()
            if exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(inner.result())
        else:
            inner.exception()  # the outcome went nowhere: mark it retrieved
        while self.queue and self.inflight < self.limit:
            nxt, args = self.queue.popleft()
            if not nxt.done():
                self._start(nxt, args)
        if not self.queue and self.drained is not None:
            drained, self.drained = self.drained, None
            drained()

    def post_all(self) -> None:
        """Post everything queued now, whatever the limit (the connection ended in order:
        each is served from what had arrived, or fails at once)."""
        while self.queue:
            nxt, args = self.queue.popleft()
            if not nxt.done():
                self._start(nxt, args)

    def fail(self, exc: BaseException) -> None:
        while self.queue:
            fut, _ = self.queue.popleft()
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # the owner learns through the failure callback too


class WindowedConnection(Connection):
    """``inner`` with unlimited posting (see the module doc); everything else delegates."""

    def __init__(self, inner: Connection, limit: int) -> None:
        if limit < 1:
            raise ValueError("a posting window needs room for one operation")
        self.inner = inner
        self._loop = asyncio.get_running_loop()
        self._sends = _Direction(limit, inner.isend)
        self._recvs = _Direction(limit, inner.irecv)
        self._callback: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        inner.set_failure_callback(self._lost)

    def isend(self, buf: Buffer, tag: int, meta: bytes) -> asyncio.Future[None]:
        if self._closing:
            return self._refused()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._sends.submit(fut, (buf, tag, meta))
        return fut

    def _refused(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        fut.set_exception(ConnectionLost("connection is closing"))
        fut.exception()
        return fut

    def irecv(self, buf: Buffer, tag: int) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self._recvs.submit(fut, (buf, tag))
        return fut

    def _lost(self, exc: ConnectionLost) -> None:
        self._sends.fail(exc)
        if exc.orderly:
            # Messages that arrived before the peer's close stay receivable (contract).
            self._recvs.post_all()
        else:
            self._recvs.fail(exc)
        if self._callback is not None:
            self._callback(exc)

    def _fail_queued(self, exc: ConnectionLost) -> None:
        self._sends.fail(exc)
        self._recvs.fail(exc)

    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        self._callback = callback
        if self.inner.failed is not None:
            self._loop.call_soon(call_failure_callback, callback, self.inner.failed)

    def set_arrival_callback(self, callback: Callable[[int, bytes], None] | None) -> None:
        self.inner.set_arrival_callback(callback)

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        """As :meth:`Connection.close`; sends still waiting for room are posted (and
        flushed) before the inner connection closes, unless ``drop_queued``."""
        if self._closing:
            return
        self._closing = True
        self._recvs.fail(ConnectionLost("the connection was closed locally"))
        if drop_queued or not self._sends.queue:
            self._sends.fail(ConnectionLost("the connection was closed locally"))
            self.inner.close(notice, drop_queued=drop_queued)
        else:
            self._sends.drained = lambda: self.inner.close(notice)

    def abort(self) -> None:
        self._fail_queued(ConnectionLost("the connection was aborted locally"))
        self.inner.abort()

    async def wait_closed(self) -> None:
        await self.inner.wait_closed()

    @property
    def failed(self) -> ConnectionLost | None:
        return self.inner.failed

    def poll(self) -> None:
        self.inner.poll()


def windowed(conn: Connection) -> Connection:
    """``conn`` itself when it has no cap, else wrapped in a :class:`WindowedConnection`."""
    limit = conn.max_inflight
    return conn if limit is None else WindowedConnection(conn, limit)
