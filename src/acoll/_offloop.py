"""Blocking system work (mapping, reserving pages) moved off the event loop's thread.

:func:`in_thread` is ``asyncio.to_thread`` for work whose result owns a resource (a file
descriptor, a mapping): a caller cancelled while the thread runs cannot receive the
result, so it is handed to ``discard`` when it comes instead of being left to the
collector.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[[], T], discard: Callable[[T], object] | None = None) -> T:
    """``fn()`` run on the loop's default executor.

    If the awaiting task is cancelled before ``fn`` returns, ``fn`` still runs to its end
    (a thread cannot be stopped) and its result, if any, is passed to ``discard`` on the
    loop's thread; an exception it raises then is dropped (the caller is gone).
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn)
    fut = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(functools.partial(_late, discard))
        raise


def _late(discard: Callable[[T], object] | None, fut: asyncio.Future[T]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    if discard is not None:
        discard(fut.result())
