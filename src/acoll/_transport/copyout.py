"""Copying messages that arrived early into their receives, a slice per loop step.

A transport whose matcher kept a message in storage (it arrived before its receive was
posted) copies it into the receive buffer when the receive comes. Large messages are
copied ``SLICE`` bytes per loop iteration so that one step never holds the loop for long;
the copies in progress fail with the connection. Shared by the TCP, shared-memory and
RDMA transports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["SLICE", "PacedCopies"]

SLICE = 256 << 10  # bytes copied per loop iteration


class PacedCopies:
    """Copies out of storage for one connection.

    ``on_error(exc)`` is called if a copy raises (a bug: the transport ends the connection);
    ``release(storage)``, if given, gets each storage back once its copy is complete.
    """

    __slots__ = ("_active", "_loop", "_on_error", "_release")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_error: Callable[[Exception], None],
                 release: Callable[[memoryview], None] | None = None) -> None:
        self._loop, self._on_error, self._release = loop, on_error, release
        self._active: set[asyncio.Future[bytes]] = set()

    def start(self, buf: memoryview, storage: memoryview, fut: asyncio.Future[bytes],
              meta: bytes) -> None:
        """Copy ``storage`` into ``buf`` (the first slice now), then ``fut`` gets ``meta``."""
        self._step(buf, storage, fut, meta, 0)

    def _step(self, buf: memoryview, storage: memoryview, fut: asyncio.Future[bytes],
              meta: bytes, pos: int) -> None:
        try:
            if fut.done():  # failed meanwhile (connection lost)
                self._active.discard(fut)
                return
            self._active.add(fut)
            end = min(pos + SLICE, storage.nbytes)
            buf[pos:end] = storage[pos:end]
            if end < storage.nbytes:
                self._loop.call_soon(self._step, buf, storage, fut, meta, end)
                return
            self._active.discard(fut)
            fut.set_result(meta)
            if self._release is not None:
                self._release(storage)
        except Exception as exc:
            self._on_error(exc)

    def fail(self, exc: BaseException) -> None:
        """Fail every copy in progress with ``exc`` (marked retrieved)."""
        for fut in self._active:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()
        self._active.clear()
