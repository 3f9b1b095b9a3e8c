"""Deadlines: every network wait in acoll goes through :func:`wait_until`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from .errors import TimeoutError as AcollTimeoutError

T = TypeVar("T")


def deadline_after(seconds: float) -> float:
    """The loop time ``seconds`` from now."""
    return asyncio.get_running_loop().time() + seconds


def outcome_dropped_if_cancelled(fut: asyncio.Future[T]) -> asyncio.Future[T]:
    """``fut``, whose outcome counts as retrieved once it is done. On Python 3.11 a
    ``wait_for`` whose caller is cancelled cancels the future it waits for and never reads
    it: a gather then ends holding a CancelledError nobody retrieves, which the loop's
    exception handler reports when the gather is collected. (Whoever awaits ``fut``
    still gets its outcome.)"""
    fut.add_done_callback(_retrieve)
    return fut


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def wait_for(aw: Awaitable[T], seconds: float | None) -> T:
    """``asyncio.wait_for`` without its Python 3.11 flaw: there it returns the result,
    swallowing a cancellation of the caller, when the awaited task finished in the same
    loop iteration as the cancel (CPython gh-86296), so that init_rank() or split() could
    outlive an ``asyncio.timeout`` around them. Raises the builtin TimeoutError."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover (3.10)


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def wait_until(aw: Awaitable[T], deadline: float, what: str) -> T:
    """Await ``aw`` but give up at ``deadline``.

    Raises:
        acoll.TimeoutError: the deadline passed; ``what`` says what was being waited for.
    """
    if asyncio.isfuture(aw):  # (a gather, say: see outcome_dropped_if_cancelled)
        outcome_dropped_if_cancelled(aw)
    try:
        return await wait_for(aw, remaining(deadline))
    except asyncio.TimeoutError as exc:
        # asyncio.TimeoutError is the builtin TimeoutError on 3.11+; ours subclasses it,
        # so check we do not re-wrap our own deadline errors raised further down.
        if isinstance(exc, AcollTimeoutError):
            raise
        raise AcollTimeoutError(f"timed out waiting for {what}") from None
