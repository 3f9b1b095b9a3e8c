"""Device buffers over a connection that moves host memory: staging through host buffers.

The communicator wraps a peer's connection in :class:`StagedConnection` when its memory
space is a device (CUDA) and the transport chosen for that peer lacks that kind in
:attr:`~.base.Transport.memory`. The copies themselves belong to the space
(:class:`~acoll._memory.Staging`: enqueue a D2H or H2D copy on its stream, pooled
page-locked host buffers), so a fake device space with synchronous copies drives exactly
this code in CPU tests.

- A send of a device buffer leases a host buffer and enqueues the D2H copy at once (after
  all work already queued on the space's stream, so it reads the final data). One task per
  connection waits for those copies in order, without blocking the loop, and posts each
  host buffer to the inner connection as soon as its copy is done: the copy of message
  ``k + 1`` runs while message ``k`` is on the wire (algorithms pipeline in chunks).
- A receive into a device buffer posts a leased host buffer to the inner connection; when
  it completes, the H2D copy is enqueued on the space's stream and the caller's future
  completes at once: work the caller queues next on the space (a reduction) runs after
  the copy, by stream order. The host buffer goes back to the pool fenced by that copy.
- Host buffers (the communicator's own small messages) and empty ones pass straight
  through.

Every contract of :mod:`.base` holds: failures, orderly close (sends whose copy is still
running are posted before the inner connection closes, unless ``drop_queued``), the
arrival callback, :class:`~.base.MessageSizeError` (from the inner receive, sizes being
equal), no exception into the loop's callbacks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from .._memory import Buffer, Fence, MemoryKind, Staging, host_buffer
from ..errors import AcollError, TransportError
from .base import Connection, ConnectionLost
from .lifecycle import call_failure_callback

__all__ = ["StagedConnection", "staged"]

_EMPTY = host_buffer(b"")


class _Send:
    """A staged send: its host copy, and (once posted) the inner send's done callback.
    One object per message, no closure (the staged path's per-chunk objects are what
    drives Python's garbage collector on a stream of large GPU collectives)."""

    __slots__ = ("block", "fence", "host", "meta", "outer", "staging", "tag")

    def __init__(self, outer: asyncio.Future[None], host: Buffer, block: Buffer, fence: Fence,
                 tag: int, meta: bytes, staging: Staging) -> None:
        self.outer, self.host, self.block, self.fence = outer, host, block, fence
        self.tag, self.meta, self.staging = tag, meta, staging

    def __call__(self, f: asyncio.Future[None]) -> None:
        """The inner send finished: give the host buffer back, settle the outer future."""
        self.staging.release(self.block)
        outer = self.outer
        if outer.done():
            if not f.cancelled():
                f.exception()
        elif f.cancelled():
            outer.cancel()
        elif f.exception() is not None:
            outer.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            outer.set_result(None)


class _Recv:
    """A staged receive: when the inner receive into ``host`` completes, enqueue the copy
    to ``buf`` and settle ``outer`` (a callable object rather than a closure: see
    :class:`_Send`)."""

    __slots__ = ("block", "buf", "conn", "host", "outer")

    def __init__(self, conn: StagedConnection, buf: Buffer, host: Buffer, block: Buffer,
                 outer: asyncio.Future[bytes]) -> None:
        self.conn, self.buf, self.host, self.block, self.outer = conn, buf, host, block, outer

    def __call__(self, f: asyncio.Future[bytes]) -> None:
        conn, outer = self.conn, self.outer
        if conn._recvs.pop(f, None) is None:
            return  # already finished by poll()
        staging = conn.staging
        if f.cancelled():
            staging.release(self.block)
            if not outer.done():
                outer.cancel()
            return
        exc = f.exception()
        if exc is not None:
            staging.release(self.block)
            if not outer.done():
                outer.set_exception(exc)
            return
        try:
            fence = staging.upload(self.buf, self.host)
        except Exception as err:
            staging.release(self.block)
            if not outer.done():
                outer.set_exception(_copy_error("the copy of a receive to the device", err))
            return
        staging.release(self.block, fence)
        if not outer.done():
            outer.set_result(f.result())


class StagedConnection(Connection):
    """``inner`` (a host-memory connection) carrying device buffers (module docstring)."""

    def __init__(self, inner: Connection, staging: Staging) -> None:
        self.inner = inner
        self.staging = staging
        self.max_inflight = inner.max_inflight
        self._loop = asyncio.get_running_loop()
        self._queue: deque[_Send] = deque()  # sends whose D2H copy is not known done
        self._pump: asyncio.Task[None] | None = None
        self._callback: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        self._close_args: tuple[bytes, bool] | None = None
        self._failed: ConnectionLost | None = None
        # Staged receives posted to the inner connection, with what finishes each.
        self._recvs: dict[asyncio.Future[bytes], _Recv] = {}
        self.staged_sends = 0
        self.staged_recvs = 0
        inner.set_failure_callback(self._lost)

    def _direct(self, buf: Buffer) -> Buffer | None:
        """The buffer to hand the inner connection as is (host memory; an empty device
        buffer becomes an empty host one), or ``None``: stage it."""
        if buf.kind is not self.staging.kind:
            return buf
        return _EMPTY if buf.nbytes == 0 else None

    # ------------------------------------------------------------------ sends
    def isend(self, buf: Buffer, tag: int, meta: bytes) -> asyncio.Future[None]:
        if self._closing or self._failed is not None or self.inner.failed is not None:
            return self._refused()
        direct = self._direct(buf)
        if direct is not None:
            return self.inner.isend(direct, tag, meta)
        outer: asyncio.Future[None] = self._loop.create_future()
        try:
            host, block = self.staging.lease(buf.nbytes)
            fence = self.staging.download(host, buf)
        except Exception as exc:
            outer.set_exception(_copy_error("the copy of a send to host memory", exc))
            return outer
        self.staged_sends += 1
        item = _Send(outer, host, block, fence, tag, meta, self.staging)
        if not self._queue and fence.done():
            self._post(item)
        else:
            self._queue.append(item)
            if self._pump is None:
                self._pump = self._loop.create_task(self._run_pump())
        return outer

    def _refused(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        fut.set_exception(self._failed or self.inner.failed
                          or ConnectionLost("connection is closing"))
        fut.exception()
        return fut

    def _post(self, item: _Send) -> None:
        self.inner.isend(item.host, item.tag, item.meta).add_done_callback(item)

    async def _run_pump(self) -> None:
        """Post queued sends in order as their copies finish (one task per connection)."""
        try:
            while self._queue:
                item = self._queue[0]
                if not item.fence.done():
                    try:
                        await item.fence.wait()
                    except Exception as exc:
                        self._fail_queued(_copy_error("a send's copy to host memory", exc))
                        return
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()
                    self._post(item)
        finally:
            self._pump = None
            if not self._queue and self._close_args is not None:
                notice, drop = self._close_args
                self._close_args = None
                self.inner.close(notice, drop_queued=drop)

    def _fail_queued(self, exc: BaseException) -> None:
        while self._queue:
            item = self._queue.popleft()
            # The copy may still be writing the host buffer: reuse it only after it.
            self.staging.release(item.block, item.fence)
            if not item.outer.done():
                item.outer.set_exception(exc)
                item.outer.exception()  # the owner also learns through the failure callback

    # ------------------------------------------------------------------ receives
    def irecv(self, buf: Buffer, tag: int) -> asyncio.Future[bytes]:
        direct = self._direct(buf)
        if direct is not None:
            return self.inner.irecv(direct, tag)
        outer: asyncio.Future[bytes] = self._loop.create_future()
        host, block = self.staging.lease(buf.nbytes)
        self.staged_recvs += 1
        done = _Recv(self, buf, host, block, outer)
        inner = self.inner.irecv(host, tag)
        self._recvs[inner] = done
        inner.add_done_callback(done)
        return outer

    # ------------------------------------------------------------------ the rest delegates
    def _lost(self, exc: ConnectionLost) -> None:
        self._failed = exc
        self._fail_queued(exc)
        if self._callback is not None:
            self._callback(exc)

    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        self._callback = callback
        if self._failed is not None:
            self._loop.call_soon(call_failure_callback, callback, self._failed)
        elif self.inner.failed is not None:
            self._loop.call_soon(self._lost, self.inner.failed)

    def set_arrival_callback(self, callback: Callable[[int, bytes], None] | None) -> None:
        self.inner.set_arrival_callback(callback)

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        """As :meth:`Connection.close`; staged sends still copying are posted (and
        flushed) before the inner connection closes, unless ``drop_queued``."""
        if self._closing:
            return
        self._closing = True
        if drop_queued:
            self._fail_queued(ConnectionLost("the connection was closed locally"))
        if self._queue:
            self._close_args = (notice, drop_queued)
        else:
            self.inner.close(notice, drop_queued=drop_queued)

    def abort(self) -> None:
        self._closing = True
        self._fail_queued(ConnectionLost("the connection was aborted locally"))
        self._close_args = None
        if self._pump is not None:
            self._pump.cancel()
        self.inner.abort()

    async def wait_closed(self) -> None:
        if self._pump is not None:  # (its end, not its outcome; a cancelled caller ends)
            await asyncio.wait([self._pump])
        await self.inner.wait_closed()

    @property
    def failed(self) -> ConnectionLost | None:
        return self.inner.failed

    def poll(self) -> None:
        """Poll the inner connection, then finish staged receives it completed now (not
        one loop iteration later, when their callbacks would run): a waiter that
        busy-polls sees its receive done."""
        self.inner.poll()
        if self._recvs:
            for fut in [f for f in self._recvs if f.done()]:
                finish = self._recvs.get(fut)
                if finish is not None:
                    finish(fut)


def _copy_error(what: str, exc: BaseException) -> AcollError:
    if isinstance(exc, AcollError):
        return exc
    return TransportError(f"{what} failed: {exc!r}")


def staged(conn: Connection, staging: Staging | None, moves: frozenset[MemoryKind]
           ) -> Connection:
    """``conn`` itself when its transport ``moves`` the staging's memory kind (or there is
    no staging: host memory), else wrapped in a :class:`StagedConnection`."""
    if staging is None or staging.kind in moves:
        return conn
    return StagedConnection(conn, staging)
