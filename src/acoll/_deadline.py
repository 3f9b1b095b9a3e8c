"""Deadlines: every network wait in acoll goes through :func:`wait_until`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from .errors import TimeoutError as AcollTimeoutError

T = TypeVar("T")


def deadline_after(seconds: float) -> float:
    """The loop time ``seconds`` from now."""
    return asyncio.get_running_loop().time() + seconds


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def wait_until(aw: Awaitable[T], deadline: float, what: str) -> T:
    """Await ``aw`` but give up at ``deadline``.

    Raises:
        acoll.TimeoutError: the deadline passed; ``what`` says what was being waited for.
    """
    try:
        return await asyncio.wait_for(aw, remaining(deadline))
    except asyncio.TimeoutError as exc:
        # asyncio.TimeoutError is the builtin TimeoutError on 3.11+; ours subclasses it,
        # so check we do not re-wrap our own deadline errors raised further down.
        if isinstance(exc, AcollTimeoutError):
            raise
        raise AcollTimeoutError(f"timed out waiting for {what}") from None
