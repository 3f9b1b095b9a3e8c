"""Groups: ``async with acoll.group():`` and ``comm.group()`` (``ncclGroupStart/End``).

NCCL's group is per thread and spans every communicator: calls made between
``ncclGroupStart`` and ``ncclGroupEnd`` are only recorded, and run together at the end.
That is what lets one thread drive several ranks (one per GPU, the seed article's
program): a lone blocking call on the first rank would wait forever for the second.

Here the thread is the asyncio *context*: the open group lives in a context variable, so
calls made by the task that opened it, and by tasks it starts inside the block (they
inherit its context), join it; other tasks are not affected. Every communicator a call
joins gets its own queue of the group's ops (:meth:`Executor.run_group`), and every queue
runs, concurrently, when the outermost block exits; the exit raises the first error.
Calls inside the block return at once; their buffers hold results after the exit.

``comm.group()`` is the same group with ``comm`` joined at the start (so that calls other
tasks make on ``comm`` meanwhile queue into it too, as before groups spanned
communicators). Nested blocks join the outermost one. A call of a task that outlives the
block (the group has ended) runs as a plain call.

A *prepared* call (``acoll._p2p.fast``) made inside a group launches at the call, like
NCCL's kernels, only when its communicator has no other op in the group: its
completion is then :meth:`Group.defer`-red to the exit, where it is awaited inline (no
task per call: the point of one thread driving all its GPUs). If the block raises, the
group's ops never run: every communicator with ops in it fails (its peers were promised
them), as a cancelled call does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["Group", "current"]

_OPEN: ContextVar[Group | None] = ContextVar("acoll_group", default=None)

Thunk = Callable[[], Coroutine[Any, Any, None]]


def current() -> Group | None:
    """The group open in this context, if any (a group that ended no longer counts)."""
    group = _OPEN.get()
    return group if group is not None and group.open else None


class Group:
    """One ``async with`` block (see the module docstring)."""

    __slots__ = ("_first", "_outer", "_token", "deferred", "executors", "open")

    def __init__(self, first: Executor | None = None) -> None:
        self._first = first
        self._outer: Group | None = None
        self._token: Token[Group | None] | None = None
        self.open = False
        #: communicators with queued ops, in the order they joined
        self.executors: list[Executor] = []
        #: prepared calls launched in the block: (executor, sequence number, completion)
        self.deferred: list[tuple[Executor, int, Thunk]] = []

    def join(self, ex: Executor) -> None:
        """Queue ``ex``'s calls in this group from now on (``ex`` has no group yet)."""
        ex.open_group()
        self.executors.append(ex)

    def defer(self, ex: Executor, seq: int, done: Thunk) -> None:
        """Await ``done()`` (a prepared call's completion) when the group exits."""
        self.deferred.append((ex, seq, done))

    async def __aenter__(self) -> None:
        outer = current()
        first = self._first
        if first is not None:
            first.host.check_usable()
        if outer is not None:  # nested: the outermost block runs everything
            self._outer = outer
            if first is not None and not first.in_group:
                outer.join(first)
            return
        self.open = True
        self._token = _OPEN.set(self)
        if first is not None and not first.in_group:
            self.join(first)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        if self._outer is not None:
            return
        self.open = False
        if self._token is not None:
            _OPEN.reset(self._token)
            self._token = None
        executors, self.executors = self.executors, []
        deferred, self.deferred = self.deferred, []
        if exc is not None:
            for ex in executors:
                ex.abandon_group()
            for ex, seq, _ in deferred:
                ex.cancelled("group", seq)
            await _drain(deferred)
            return
        if not executors:
            await _inline(deferred)
            return
        if len(executors) == 1 and not deferred:
            await executors[0].run_group()
            return
        results = await asyncio.gather(*(ex.run_group() for ex in executors),
                                       *(done() for _, _, done in deferred),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res


async def _inline(deferred: list[tuple[Executor, int, Thunk]]) -> None:
    """Await the prepared calls one after the other in this task (their launches are all
    queued: awaiting one never holds another back). The first error is raised after all
    ended; a cancellation fails the communicators not yet awaited, lets them end and wins."""
    first: BaseException | None = None
    for i, (_, _, done) in enumerate(deferred):
        try:
            await done()
        except asyncio.CancelledError:
            for later, later_seq, _ in deferred[i + 1:]:
                later.cancelled("group", later_seq)
            await _drain(deferred[i + 1:])
            raise
        except BaseException as err:
            if first is None:
                first = err
    if first is not None:
        raise first


async def _drain(deferred: list[tuple[Executor, int, Thunk]]) -> None:
    """Let the completions of failed communicators end (their waits end at once)."""
    for _, _, done in deferred:
        try:
            await done()
        except BaseException:  # each communicator holds its error
            pass
