"""Blocking system work (mapping, reserving pages, loading libraries) off the event loop.

acoll's own worker threads do it, never the loop's default executor: that pool is the
application's (``asyncio.to_thread``), and an application that keeps it busy, or blocks
its workers on acoll calls, would stall or deadlock acoll's formation (found by review:
6 ranks driven from default-executor workers never formed their shared-memory links).

:func:`in_thread` is ``asyncio.to_thread`` for such work, and for work whose result owns
a resource (a file descriptor, a mapping): a caller cancelled while the thread runs
cannot receive the result, so it is handed to ``discard`` when it comes instead of being
left to the collector. :func:`submit` starts work nobody awaits (an unmap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Threads of acoll's pool: the work is short (milliseconds) and never waits for a loop.
WORKERS = 4

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                WORKERS, thread_name_prefix="acoll-offloop")
        return _pool


def _forget_pool() -> None:
    """In a forked child the parent's threads are gone: start a new pool on demand."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


async def in_thread(fn: Callable[[], T], discard: Callable[[T], object] | None = None) -> T:
    """``fn()`` run on acoll's worker threads.

    If the awaiting task is cancelled before ``fn`` returns, ``fn`` still runs to its end
    (a thread cannot be stopped) and its result, if any, is passed to ``discard`` (on the
    worker thread, whether or not the loop still runs); an exception it raises then is
    dropped (the caller is gone).
    """
    loop = asyncio.get_running_loop()
    handoff = _Handoff(fn, discard)
    fut = loop.run_in_executor(_executor(), contextvars.copy_context().run, handoff.run)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_drop_outcome)  # (a late error: nobody is left to read it)
        late = handoff.abandon()
        if late is not None and discard is not None:  # (done as the cancel came)
            discard(late[0])
        raise


def _drop_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Handoff:
    """``fn``'s result goes to the awaiting caller, or, once the caller is gone, to
    ``discard``: whichever side comes second hands it over (under a lock)."""

    def __init__(self, fn: Callable[[], Any], discard: Callable[[Any], object] | None
                 ) -> None:
        self._fn, self._discard = fn, discard
        self._lock = threading.Lock()
        self._abandoned = False
        self._done: tuple[Any] | None = None

    def run(self) -> Any:
        result = self._fn()
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self._done = (result,)
        if abandoned and self._discard is not None:
            self._discard(result)
        return result

    def abandon(self) -> tuple[Any] | None:
        """Mark the caller gone; the result if it was already there (then it is the
        caller's to discard), else None (the worker discards it)."""
        with self._lock:
            self._abandoned = True
            return self._done


def submit(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Start ``fn(*args)`` on acoll's worker threads (no loop needed)."""
    return _executor().submit(fn, *args)




#: Bytes of a mapping dropped per step by :func:`unmap`.
DROP_STEP = 32 << 20


def unmap(mm: mmap.mmap) -> None:
    """Unmap ``mm`` (on a worker thread) without holding the process's memory map lock for
    long: its pages are dropped first in steps of :data:`DROP_STEP` (``MADV_DONTNEED``:
    the data stays in the shared file), then the mapping is closed. One munmap of 512 MiB
    held that lock for about 60 ms, during which the loop's thread waited in any page fault
    or allocation (found by review). A mapping still exported (a view alive) is left to
    the collector, as ``mm.close()`` would."""
    try:
        for offset in range(0, len(mm), DROP_STEP):
            mm.madvise(mmap.MADV_DONTNEED, offset, min(DROP_STEP, len(mm) - offset))
            time.sleep(0)  # (lets the loop's thread take the GIL between steps)
    except (ValueError, OSError, AttributeError):  # (closed already; no madvise here)
        pass
    with contextlib.suppress(BufferError):
        mm.close()
