"""Test helpers: many ranks in one event loop.

``await run_ranks(n, fn)`` forms an ``n``-rank communicator inside the running loop (all
ranks talk over loopback sockets, exactly as separate processes would), runs
``await fn(comm)`` on every rank concurrently, closes the communicators, and returns the
results in rank order. The first failure aborts every rank and is raised.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from .._communicator import Communicator, get_unique_id, init_rank, raise_nofile_limit

__all__ = ["run_ranks"]

T = TypeVar("T")


async def run_ranks(n: int, fn: Callable[[Communicator], Awaitable[T]], *,
                    ifname: str | None = None, together: bool = False,
                    **init_kw: Any) -> list[T]:
    """Run ``await fn(comm)`` on ``n`` ranks in the running loop; results in rank order.

    Args:
        n: number of ranks.
        fn: coroutine function called with each rank's communicator.
        ifname: interface rules; defaults to ``ACOLL_SOCKET_IFNAME`` or else loopback
            (``=lo``), since all ranks live in this process.
        together: form every rank first, then start ``fn`` on all of them at once
            (without it each rank's ``fn`` starts when its own formation ends: a test that
            shortens ``comm.timeout`` in ``fn`` wants ``together=True``, so that no rank's
            short deadline runs while a slow peer is still forming).
        init_kw: passed to :func:`acoll.init_rank` (``timeout=``, ``check=``, ...).

    Raises:
        The first exception any rank raised; the other ranks are cancelled and aborted.
    """
    raise_nofile_limit()
    if ifname is None and not os.environ.get("ACOLL_SOCKET_IFNAME"):
        ifname = "=lo"
    uid = get_unique_id(ifname=ifname)
    comms: list[Communicator | None] = [None] * n
    formed = asyncio.Event()

    async def one(rank: int) -> T:
        comm = await init_rank(n, uid, rank, ifname=ifname, **init_kw)
        comms[rank] = comm
        if together:
            if all(c is not None for c in comms):
                formed.set()
            await formed.wait()
        try:
            result = await fn(comm)
        except BaseException:
            comm.abort()
            raise
        await comm.close()
        return result

    tasks = [asyncio.ensure_future(one(r)) for r in range(n)]
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            await _stop(pending, comms)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
        return [t.result() for t in tasks]
    except asyncio.CancelledError:
        await _stop(tasks, comms)
        raise


async def _stop(tasks: Iterable[asyncio.Future[Any]], comms: list[Communicator | None]) -> None:
    """Cancel ``tasks``, abort every communicator formed, and wait for the tasks to end."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for c in comms:
        if c is not None:
            c.abort()
    await asyncio.gather(*tasks, return_exceptions=True)
