"""Send/recv between a rank and itself, inside a group (NCCL allows it: an all-to-all-v
written as a loop of sends and receives over every rank includes the caller's own).

- The k-th send to self pairs with the k-th recv from self, as with any peer. Both must
  be queued in the same group (``acoll.group()`` / ``comm.group()``, or a call another
  task makes while that group holds the communicator): outside one the send would wait
  for a receive its own rank never reaches, so it is refused at the call with
  :class:`~acoll.InvalidUsage`.
- Checked at the second call of a pair, before anything is queued: both in one group,
  the same dtype and count, buffers that are the same or do not overlap (an overlap is
  refused: a device copy of overlapping memory is undefined).
- When the group runs, the receive copies the send's buffer once the send's op started
  (on a device communicator, after both callers' streams' earlier work), and the send
  completes only after that copy was queued: the send buffer is free once the group
  exited, as for any send.
- A half without its other half in the group (a send to self whose recv was never made,
  or made in a later group) fails the communicator when the group is about to run,
  naming it, before any of its calls started: its peers were promised those calls. A
  failure of the communicator ends every wait here at once (:meth:`SelfPairs.fail`).

No bytes leave the process; nothing here is numbered or sent to peers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .._coll.base import OpContext
from .._deadline import wait_until
from .._dtypes import DTYPE_NAMES
from .._memory import Buffer
from ..errors import InvalidUsage

__all__ = ["SelfPair", "SelfPairs", "SelfRecv", "SelfSend"]


class SelfPair:
    """The ``index``-th send to self and recv from self of one communicator."""

    __slots__ = ("copied", "group", "index", "recv", "send", "sent", "wake")

    def __init__(self, index: int, group: object) -> None:
        self.index = index
        self.group = group  # the group queue both halves must be in (identity)
        self.send: Buffer | None = None
        self.recv: Buffer | None = None
        self.sent = False  # the send's op started (its stream's work is ordered before)
        self.copied = False  # the receive's copy is queued
        self.wake: asyncio.Future[None] | None = None  # whoever waits for the other


class SelfPairs:
    """The pairs of one communicator whose two halves have not both run yet."""

    def __init__(self, rank: int, check_usable: Callable[[], None]) -> None:
        self.rank = rank
        self.check_usable = check_usable  # raises the communicator's error, if any
        self._pairs: dict[int, SelfPair] = {}
        self._sends = 0
        self._recvs = 0

    def post(self, side: str, buf: Buffer, group: object | None) -> SelfPair:
        """Record this rank's next send to self (``side == "send"``) or recv from self,
        queued in ``group`` (the executor's group queue, ``None`` outside a group).

        Raises:
            InvalidUsage: outside a group, or the other half of its pair is in another
                group or does not match (dtype, count, overlap); nothing is recorded.
        """
        rank = self.rank
        if group is None:
            raise InvalidUsage(
                f"send/recv to self on rank {rank} outside a group: the send would wait "
                "for a recv its own rank never reaches; put both in one group block "
                "(async with comm.group(): ...), as NCCL requires, or copy locally")
        index = self._sends if side == "send" else self._recvs
        pair = self._pairs.get(index)
        if pair is not None:
            if pair.group is not group:
                other = "recv" if side == "send" else "send"
                raise InvalidUsage(
                    f"{side} #{index} to/from self on rank {rank} is in another group than "
                    f"its {other}: a send to self and its recv must be in one group block")
            send, recv = (buf, pair.recv) if side == "send" else (pair.send, buf)
            assert send is not None
            assert recv is not None
            _check_match(rank, index, send, recv)
        else:
            pair = SelfPair(index, group)
            self._pairs[index] = pair
        if side == "send":
            pair.send = buf
            self._sends += 1
        else:
            pair.recv = buf
            self._recvs += 1
        return pair

    def check_group(self, group: object) -> None:
        """Raise InvalidUsage for a pair queued in ``group`` without its other half, before
        any of the group's ops runs (found by review, session 57: the group's collectives
        started, and peers of a small one returned while this rank failed)."""
        for pair in self._pairs.values():
            if pair.group is group and (pair.send is None or pair.recv is None):
                raise InvalidUsage(_unmatched(pair, self.rank))

    def done(self, pair: SelfPair) -> None:
        self._pairs.pop(pair.index, None)

    def fail(self) -> None:
        """The communicator failed or was aborted: wake every wait (the waiters then raise
        the communicator's error) and forget the pairs."""
        pairs, self._pairs = self._pairs, {}
        for pair in pairs.values():
            _wake(pair)


def _unmatched(pair: SelfPair, rank: int) -> str:
    what = (f"send to self #{pair.index} on rank {rank} has no recv from self"
            if pair.recv is None else
            f"recv from self #{pair.index} on rank {rank} has no send to self")
    return (f"{what} in its group: a send to self and its recv must be in one group "
            "block (none of the group's calls ran)")


def _check_match(rank: int, index: int, send: Buffer, recv: Buffer) -> None:
    diffs = []
    if send.count != recv.count:
        diffs.append(f"count {send.count} vs {recv.count}")
    if send.dtype != recv.dtype:
        diffs.append(f"dtype {DTYPE_NAMES.get(send.dtype, send.dtype)} vs "
                     f"{DTYPE_NAMES.get(recv.dtype, recv.dtype)}")
    if diffs:
        raise InvalidUsage(f"send/recv to self #{index} on rank {rank}: the send and the "
                           f"recv differ: {', '.join(diffs)} (send vs recv)")
    if send.ptr != recv.ptr and send.space.overlaps(send, recv):
        raise InvalidUsage(f"send/recv to self #{index} on rank {rank}: the send and recv "
                           "buffers overlap (pass the same buffer, or separate ones)")


def _wake(pair: SelfPair) -> None:
    fut, pair.wake = pair.wake, None
    if fut is not None and not fut.done():
        fut.set_result(None)


async def _wait(ctx: OpContext, pairs: SelfPairs, pair: SelfPair,
                ready: Callable[[], bool]) -> None:
    """Wait until ``ready()`` (the other half's progress), within the op's deadline; a
    communicator that fails meanwhile wakes the wait, which then raises its error."""
    while not ready():
        pairs.check_usable()
        pair.wake = asyncio.get_running_loop().create_future()
        await wait_until(pair.wake, ctx.deadline,
                         f"the other half of send/recv to self #{pair.index}")


class _Half:
    """One half of a pair, as an executor algorithm."""

    def __init__(self, ctx: OpContext, pairs: SelfPairs, pair: SelfPair) -> None:
        self.ctx, self.pairs, self.pair = ctx, pairs, pair


class SelfSend(_Half):
    """The send half."""

    async def run(self) -> None:
        pair = self.pair
        if pair.recv is None:
            raise InvalidUsage(_unmatched(pair, self.ctx.rank))
        pair.sent = True
        _wake(pair)
        await _wait(self.ctx, self.pairs, pair, lambda: pair.copied)


class SelfRecv(_Half):
    """The receive half: copies the send's buffer into its own."""

    async def run(self) -> None:
        pair = self.pair
        if pair.send is None:
            raise InvalidUsage(_unmatched(pair, self.ctx.rank))
        await _wait(self.ctx, self.pairs, pair, lambda: pair.sent)
        send, recv = pair.send, pair.recv
        assert recv is not None
        if send.ptr != recv.ptr:
            await self.ctx.copy(recv, send)
        pair.copied = True
        self.pairs.done(pair)
        _wake(pair)
