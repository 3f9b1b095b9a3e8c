"""Groups: ``async with acoll.group():`` and ``comm.group()`` (``ncclGroupStart/End``).

NCCL's group is per thread and spans every communicator: calls made between
``ncclGroupStart`` and ``ncclGroupEnd`` are only recorded, and run together at the end.
That is what lets one thread drive several ranks (one per GPU, the seed article's
program): a lone blocking call on the first rank would wait forever for the second.

Here the thread is the asyncio *context*: the open group lives in a context variable, so
calls made by the task that opened it, and by tasks it starts inside the block (they
inherit its context), join it. Every communicator a call joins gets its own queue of the
group's ops, and every queue runs, concurrently, when the outermost block exits; the exit
raises the first error. Calls inside the block return at once; their buffers hold results
after the exit.

- A communicator a group holds (it has calls in it until they run): a call made on it from
  another context (another task, or after the block) takes its number at once (after
  theirs), runs with the group's calls, and returns when it ran; one made inside another
  group raises :class:`~acoll.InvalidUsage`.
- ``comm.group()`` is the same group with ``comm`` joined at the start. Blocks nested in
  one task join the outermost one; a task started inside a block that opens a group of
  its own gets a group of its own. A group object is entered once at a time (it may be
  entered again after it exited).
- If the block raises, the group's ops never run: every communicator with ops in it
  fails (its peers were promised them), as a cancelled call does; so does every
  communicator whose ops had not started when the exit was cancelled.
- Calls that cannot wait for the exit (``close``, ``split``, ``register``,
  ``deregister``: they run at once, or wait for the group's calls) are refused inside a
  group.

A *prepared* call (``acoll._p2p.fast``) made inside a group launches at the call, like
NCCL's kernels, when its communicator has no other op in the group: its completion is
then :meth:`Group.defer`-red to the exit, where it is awaited inline (no task per call:
the point of one thread driving all its GPUs).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from ..errors import InvalidUsage

if TYPE_CHECKING:
    from .executor import Executor, GroupOp

__all__ = ["Group", "current"]

#: The open group and the number of its entry (a task started in an earlier entry of
#: the same object carries the old number: it is not in the new one).
_OPEN: ContextVar[tuple[Group, int] | None] = ContextVar("acoll_group", default=None)

Thunk = Callable[[], Coroutine[Any, Any, None]]


def current() -> Group | None:
    """The group open in this context, if any (a group that ended no longer counts)."""
    held = _OPEN.get()
    if held is None:
        return None
    group, entry = held
    return group if group.open and group._entry == entry else None


class Group:
    """One ``async with`` block (see the module docstring). An object may be entered again
    after it exited, never while it is open."""

    __slots__ = ("_active", "_entry", "_first", "_outer", "_task", "_token", "deferred",
                 "executors", "open")

    def __init__(self, first: Executor | None = None) -> None:
        self._first = first
        self._active = False
        self._outer: Group | None = None
        self._task: asyncio.Task[Any] | None = None
        self._token: Token[tuple[Group, int] | None] | None = None
        self._entry = 0
        self.open = False
        #: communicators with queued ops, in the order they joined
        self.executors: list[Executor] = []
        #: prepared calls launched in the block: (executor, sequence number, completion)
        self.deferred: list[tuple[Executor, int, Thunk]] = []

    def join(self, ex: Executor) -> None:
        """Queue ``ex``'s calls in this group from now on (``ex`` has no group yet)."""
        ex.open_group(self)
        self.executors.append(ex)

    def defer(self, ex: Executor, seq: int, done: Thunk) -> None:
        """Await ``done()`` (a prepared call's completion) when the group exits."""
        self.deferred.append((ex, seq, done))

    async def __aenter__(self) -> None:
        if self._active:
            raise InvalidUsage("this group block is already open (a group object is "
                               "entered once at a time)")
        first = self._first
        if first is not None:
            first.host.check_usable()
        task = asyncio.current_task()
        outer = current()
        self._active = True
        if outer is not None and outer._task is task:
            # Nested in this task: the outermost block runs everything. (A group opened
            # by a task started inside another task's block is a group of its own.)
            self._outer = outer
            if first is not None and not first.in_group:
                outer.join(first)
            return
        self._task = task
        self.open = True
        self._entry += 1
        self._token = _OPEN.set((self, self._entry))
        if first is not None and not first.in_group:
            self.join(first)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        try:
            await self._exit(exc)
        finally:
            self._active = False  # (not before the exit ended: entering again waits)

    async def _exit(self, exc: BaseException | None) -> None:
        if self._outer is not None:
            self._outer = None
            return
        self.open = False
        self._task = None
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
        # Every queue is taken now, before the first await: a cancellation at any point
        # below leaves no communicator holding a group.
        queues = [(ex, ops) for ex in executors if (ops := ex.take_group())]
        if not queues:
            await _inline(deferred)
            return
        if len(queues) == 1 and not deferred:
            ex, ops = queues[0]
            await ex.run_ops(ops)
            return
        runs = [_Started(ex, ops[0][0], functools.partial(ex.run_ops, ops), ops)
                for ex, ops in queues]
        runs += [_Started(ex, seq, done, None) for ex, seq, done in deferred]
        try:
            results = await asyncio.gather(*(r.run() for r in runs), return_exceptions=True)
        except asyncio.CancelledError:
            # Runs cancelled before they started never failed their communicator (their
            # ops were promised to the peers): fail it here and let prepared calls end.
            late = [r for r in runs if not r.started]
            for r in late:
                if r.ops is not None:
                    r.ex.drop_ops(r.ops)
                else:
                    r.ex.cancelled("group", r.seq)
            await _drain([(r.ex, r.seq, r.fn) for r in late if r.ops is None])
            raise
        for res in results:
            if isinstance(res, BaseException):
                raise res


class _Started:
    """One run of a group's exit, noting whether it started (a task cancelled before its
    first step never runs a line of it)."""

    __slots__ = ("ex", "fn", "ops", "seq", "started")

    def __init__(self, ex: Executor, seq: int, fn: Thunk, ops: list[GroupOp] | None
                 ) -> None:
        self.ex, self.seq, self.fn, self.ops = ex, seq, fn, ops  # ops None: a prepared call
        self.started = False

    async def run(self) -> None:
        self.started = True
        await self.fn()


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
    """Let the completions of failed communicators end (their waits end at once); a
    cancellation meanwhile is raised after all ended."""
    cancelled = False
    for _, _, done in deferred:
        try:
            await done()
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # each communicator holds its error
            pass
    if cancelled:
        raise asyncio.CancelledError
