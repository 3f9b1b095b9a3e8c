"""Running operations: sequence numbers, the FIFO of calls, groups, deadlines.

Every rank must issue collectives on a communicator in the same order (as with NCCL
streams). Calls are numbered when made and run one at a time in that order: two tasks may
call collectives on one communicator concurrently, but the order in which they *call*
must match across ranks. Inside a group (``async with acoll.group():`` or ``comm.group()``,
:mod:`.groups`) calls only enqueue (they return at once) and run concurrently when the
block exits, like ``ncclGroupStart/End``.

Each op has a deadline (the communicator's timeout). When it passes, the communicator
fails with :class:`~acoll.TimeoutError` naming the rank(s) the op waited for; a peer that
sent nothing in the op is asked first whether it made the call (:mod:`.probe`), so that
a rank waiting behind a stalled rank's other peers does not blame them. A cancelled op
fails the communicator too: its sequence number was already promised to the peers, and
so does an op that raises an error outside acoll's tree (a device or library error, a
bug): its caller gets that error, every peer a :class:`~acoll.RemoteError` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn, Protocol

from .._coll.base import ANY_SEQ, Coll, Descriptor, OpContext, OpHost
from .._deadline import wait_for
from ..errors import AcollError, InvalidUsage, RemoteError, again
from ..errors import TimeoutError as AcollTimeoutError
from .agreement import start_agreement
from .groups import Group
from .groups import current as current_group
from .ordering import SEQ_MASK, OrderChecker
from .probe import PeerState

__all__ = ["Algorithm", "ExecHost", "Executor", "MakeAlgorithm"]

_ROOTED = (Coll.BROADCAST, Coll.REDUCE)
_NO_DATA = (Coll.BARRIER, Coll.CLOSE, Coll.SEND_RECV, Coll.SPLIT, Coll.REGISTER,
            Coll.DEREGISTER)


class Algorithm(Protocol):
    async def run(self) -> None: ...


MakeAlgorithm = Callable[[OpContext], Algorithm]
#: A queued op: (seq, descriptor, tag base, make, self-checked, full number, completion
#: of a call made from outside the group, else None).
GroupOp = tuple[int, Descriptor, int, MakeAlgorithm, bool, int, "asyncio.Future[None] | None"]


class ExecHost(OpHost, Protocol):
    """What the executor needs beyond what ops need: the deadline and the failure state."""

    timeout: float

    @property
    def error(self) -> AcollError | None: ...

    def check_usable(self) -> None:
        """Raise the communicator's error, or ClosedError once closed."""

    def connected(self, peer: int) -> bool:
        """Whether a connection to ``peer`` is made."""

    def send_desc_check(self, peer: int, seq: int, desc: bytes) -> None:
        """Send ``peer`` this rank's descriptor of collective ``seq`` (``desc``, packed)
        to compare with its own (:func:`.probe.send_desc_check`); nothing without a
        connection."""

    def probe_peer(self, peer: int, seq: int, wait: float, desc: bytes
                   ) -> Awaitable[PeerState | None] | None:
        """Ask ``peer`` about collective ``seq``, described here by ``desc`` (packed)
        (:func:`.probe.ask`); ``None`` when there is no connection to ask over."""


class _Failing(Protocol):
    @property
    def error(self) -> AcollError | None: ...

    def fail(self, error: AcollError) -> None: ...


def fail_and_raise(host: _Failing, exc: AcollError) -> NoReturn:
    """Fail ``host`` with ``exc`` (an op's own error) and raise: ``exc`` itself, keeping
    what it was raised from, when it is the communicator's first error; else that first
    error (the cause every rank reports)."""
    first = host.error
    host.fail(exc)
    if first is None:
        raise exc
    raise again(first)  # (its context suppressed, its cause kept: see errors.again)


class Executor:
    """Numbers, queues and runs one communicator's operations (see the module doc)."""

    def __init__(self, host: ExecHost, checker: OrderChecker) -> None:
        self.host = host
        self.checker = checker
        self.seq = 0
        self._loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self._group: list[GroupOp] | None = None
        self._owner: Group | None = None  # the group whose block queues calls
        #: set while no group block is open (its block exited, or failed); the deadline
        #: timers of other contexts' calls waiting for an open block (:meth:`execute`)
        self._block_exited = asyncio.Event()
        self._block_exited.set()
        self._overdue: set[asyncio.TimerHandle] = set()
        #: groups opened so far, and how many of them ended (their ops took the lock, or
        #: they failed): a group holds the communicator while they differ; work waiting
        #: for the group to end (:meth:`exclusive`)
        self._opened = 0
        self._ended = 0
        self._end_waiters: list[asyncio.Future[None]] = []
        self.running: set[OpContext] = set()
        self._probes: set[asyncio.Task[None]] = set()  # peers being asked (see _timed_out)
        self.queued = 0  # calls waiting for the lock (woken ones included)
        # One timer for every running op's deadline (re-armed for the next deadline when
        # it fires) instead of a timer per op: the per-op cost was a measurable part of a
        # small op's time. It holds the executor weakly: a communicator dropped or closed
        # while it is armed is not kept alive until it fires.
        self._watchdog: asyncio.TimerHandle | None = None
        #: called with each collective's number (not wrapped at SEQ_MASK) and descriptor as
        #: it starts, except lane ops: the lane's announcement (:mod:`.lane`)
        self.announce: Callable[[int, Descriptor], None] | None = None
        #: called with a group's ops before any of them runs: raises InvalidUsage for a
        #: group that cannot run as a whole (a send to self without its recv)
        self.check_group: Callable[[list[GroupOp]], None] | None = None

    @property
    def in_group(self) -> bool:
        return self._group is not None

    @property
    def quiet(self) -> bool:
        """No op running or waiting for its turn, no group of this communicator open: a
        call made now is the next to run (an op's turn may have come while it has not
        resumed yet: the lock is free then, but the op still goes first)."""
        return not (self._group is not None or self.running or self.queued
                    or self.lock.locked())

    @property
    def idle(self) -> bool:
        """:attr:`quiet`, and no group open in the caller's context (a call made there
        must join it): a fast path may start a call made now at once."""
        return self.quiet and current_group() is None

    def p2p_stamp(self) -> int:
        """The collective sequence number a send/recv issued now is stamped with.

        Inside a group the order of send/recv relative to the group's collectives does not
        matter (they run together, as in NCCL): such calls carry ``ANY_SEQ`` and are not
        order-checked.
        """
        group = current_group()
        if self._group is None and group is not None:
            group.join(self)
        return ANY_SEQ if self._group is not None else self.seq & SEQ_MASK

    def group_queue(self) -> list[GroupOp] | None:
        """The queue of the group a call made now joins (this context's open group is
        joined first, as by :meth:`p2p_stamp`), or ``None`` when it runs outside any:
        calls queued in the same list run together."""
        group = current_group()
        if self._group is None and group is not None:
            group.join(self)
        return self._group

    def skip(self) -> None:
        """Use up a sequence number without running anything (a zero-element call with
        checks off: every rank skips it alike)."""
        self.seq += 1

    async def execute(self, desc: Descriptor, make: MakeAlgorithm,
                      tag_base: int | None = None, *, self_checked: bool = False) -> None:
        """Number (unless ``tag_base`` is given: point-to-point), then run or enqueue.

        ``self_checked=True``: an op that checks on its own that every rank runs it (a
        lane op, :mod:`.lane`; a P2P op, whose kernels compare the ranks' descriptors):
        no agreement exchange, no announcement. Such an op may run on the idle fast path
        on one rank and here on another: an agreement would wait for a rank that never
        takes part."""
        self.host.check_usable()
        group = current_group()
        done: asyncio.Future[None] | None = None
        if self._owner is not group:  # (the owner is None exactly when no group holds it)
            if self._group is None:
                assert group is not None
                group.join(self)
            elif group is not None:
                raise InvalidUsage(
                    f"rank {self.host.rank}: this communicator has calls in another task's "
                    "group; call it from that task, or after that group ran")
            else:
                # A call from another context while a group holds the communicator: it
                # takes its number now and runs with the group's ops, after them in
                # order, and returns when it ran.
                done = self._loop.create_future()
        full = self.seq
        if tag_base is None:
            seq = self.seq & SEQ_MASK
            tag_base = seq << 32
            self.seq += 1
            self.checker.issue(seq, desc, in_group=self._group is not None)
        if self._group is not None:
            self._group.append((tag_base >> 32, desc, tag_base, make, self_checked, full, done))
            if done is not None:
                # (a deadline only while the block is open: once it exited, the group's
                # ops wait for the lock and run under their own deadlines)
                overdue = None
                if not self._block_exited.is_set():
                    wait = self.host.timeout
                    overdue = self._loop.call_later(wait, self._group_overdue,
                                                    desc.coll.name.lower(), tag_base >> 32,
                                                    wait, done)
                    self._overdue.add(overdue)
                try:
                    await done
                except asyncio.CancelledError:
                    self.cancelled(desc.coll.name.lower(), tag_base >> 32)
                    raise
                finally:
                    if overdue is not None:
                        overdue.cancel()
                        self._overdue.discard(overdue)
            return
        self.queued += 1
        try:
            await self.lock.acquire()
        except asyncio.CancelledError:
            # The op already has its sequence number: peers will wait for it. Fail now.
            self.cancelled(desc.coll.name.lower(), tag_base >> 32)
            raise
        finally:
            self.queued -= 1
        try:
            self.host.check_usable()
            await self._run(OpContext(self.host, tag_base >> 32, desc, False, tag_base), make,
                            self_checked, full)
        finally:
            self.lock.release()

    async def run_now(self, name: str, seq: int, op: Awaitable[None]) -> None:
        """Await ``op``, numbered ``seq`` but run outside the queue (an idle P2P or lane
        call): a cancellation or an error fails the communicator, as in the queue."""
        try:
            await op
        except asyncio.CancelledError:
            self.cancelled(name, seq)
            raise
        except AcollError as exc:
            fail_and_raise(self.host, exc)
        except Exception as exc:
            self.broke(name, seq, exc)
            raise

    def broke(self, name: str, seq: int, exc: Exception) -> None:
        """Op ``seq`` raised an error not of acoll's tree (a device or library error on
        the way, or a bug): its number is spent and its peers cannot finish it, so the
        communicator fails (every peer hears at once, later calls here raise an
        :class:`AcollError` naming it); the caller gets ``exc`` itself."""
        rank = self.host.rank
        self.host.fail(AcollError(f"{name} #{seq} failed on rank {rank}: {exc!r}"))

    def cancelled(self, name: str, seq: int) -> None:
        rank = self.host.rank
        # (a send/recv's number is its tag's, bit 31 set: not a count users know)
        what = ("a send/recv" if name == "send_recv" else
                name if seq >> 31 else f"{name} #{seq}")
        self.host.fail(RemoteError(f"rank {rank} cancelled {what}; the communicator was "
                                   "aborted", rank))

    async def _run(self, ctx: OpContext, make: MakeAlgorithm, self_checked: bool = False,
                   full: int = 0) -> None:
        host = self.host
        if (self.announce is not None and not self_checked
                and ctx.desc.coll != Coll.SEND_RECV):
            self.announce(full, ctx.desc)
        now = self._loop.time()
        ctx.deadline = now + host.timeout
        if ctx.check and host.size > 1 and ctx.desc.coll != Coll.SEND_RECV:
            ctx.check_gap = min(DESC_CHECK_S, host.timeout / 4)
            ctx.check_at = now + ctx.check_gap
        self.running.add(ctx)
        watchdog = self._watchdog
        first = min(ctx.deadline, ctx.check_at)
        if watchdog is None or first < watchdog.when():
            # (an earlier time than the armed one: a check, or a lowered timeout)
            if watchdog is not None:
                watchdog.cancel()
            self._watchdog = self._loop.call_at(first, _watch, weakref.ref(self))
        check: asyncio.Task[None] | None = None
        try:
            if not self_checked and ctx.check and host.size > 1 and (
                    ctx.desc.coll in _ROOTED or (
                    ctx.desc.count == 0 and ctx.desc.coll not in _NO_DATA)):
                check = await start_agreement(ctx)
            await make(ctx).run()
            if check is not None:
                await check
            if host.error is not None:
                # A disagreement found while this op ran (by a message check that ran
                # after the op's own last receive): do not report success.
                raise again(host.error)
        except asyncio.CancelledError:
            self.cancelled(ctx.desc.coll.name.lower(), ctx.seq)
            raise
        except AcollError as exc:
            fail_and_raise(host, exc)
        except Exception as exc:
            self.broke(ctx.desc.coll.name.lower(), ctx.seq, exc)
            raise
        finally:
            self.running.discard(ctx)
            if check is not None and not check.done():
                check.cancel()
                with contextlib.suppress(BaseException):
                    await check
            elif check is not None and not check.cancelled():
                check.exception()  # already raised through fail(); mark it retrieved

    def _watch(self) -> None:
        """Fail the running ops whose deadline passed, and send the descriptor checks
        that are due; re-arm for the next deadline or check."""
        self._watchdog = None
        now = self._loop.time() + 1e-3  # (a timer may fire up to the clock's resolution early)
        for ctx in [c for c in self.running if c.deadline <= now]:
            ctx.deadline = float("inf")  # handled here once (a grace wait has its own timer)
            ctx.check_at = float("inf")
            self._timed_out(ctx.desc.coll.name.lower(), ctx)
        for ctx in [c for c in self.running if c.check_at <= now]:
            self._check_descriptor(ctx)
            ctx.check_gap *= 2
            ctx.check_at = now + ctx.check_gap
            if ctx.check_at >= ctx.deadline:
                ctx.check_at = float("inf")  # (the deadline's probe compares them too)
        later = [t for c in self.running if (t := min(c.deadline, c.check_at)) != float("inf")]
        if later:
            self._watchdog = self._loop.call_at(min(later), _watch, weakref.ref(self))

    def _check_descriptor(self, ctx: OpContext) -> None:
        """``ctx`` is still waiting: send the silent peer it waits for (if any) its
        descriptor, for that peer to compare once it runs the call (ranks whose counts
        differ may have picked algorithms that never send each other a message)."""
        peer = _awaited(ctx)
        if peer is not None and peer != ctx.rank and peer not in ctx.heard:
            self.host.send_desc_check(peer, ctx.seq, ctx.desc.packed)

    def stop_watchdog(self) -> None:
        """Disarm the deadline timer (the communicator is closed or aborted)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for task in list(self._probes):  # (nothing is left to judge)
            task.cancel()

    def probe_state(self, seq: int) -> PeerState:
        """Where this rank stands in collective ``seq`` (the answer to a peer's probe)."""
        for c in self.running:
            if c.seq == seq:
                return PeerState(True, _awaited(c), self.seq)
        # (sequence numbers wrap at SEQ_MASK: one less than half a cycle ahead of our next
        # number is a call still to come)
        ahead = (seq - self.seq) & SEQ_MASK
        called = ahead >= 1 << 30
        # Still in an earlier call (the asked one queued behind it, or not made yet)? The
        # rank that call waits for holds the asked one up as well.
        earlier = [(((seq - c.seq) & SEQ_MASK), c) for c in self.running
                   if 0 < (seq - c.seq) & SEQ_MASK < 1 << 30]
        if earlier:
            oldest = max(earlier, key=lambda e: e[0])[1]
            return PeerState(called, _awaited(oldest), self.seq, earlier=True)
        return PeerState(called, None, self.seq)

    def probe_mismatch(self, seq: int, peer: int, meta: bytes) -> str | None:
        """What differs between op ``seq`` as this rank runs it and ``peer``'s descriptor
        ``meta`` of it (sent with its probe); ``None``: the same, not running here, no
        descriptor (zero bytes), or descriptors unchecked."""
        if not any(meta):
            return None
        for c in self.running:
            if c.seq == seq and c.check and c.desc.coll != Coll.SEND_RECV:
                if c.desc.matches(meta):
                    return None
                return c.desc.describe_difference(Descriptor.unpack(meta), c.rank, peer)
        return None

    def _grace(self) -> float:
        return min(5.0, self.host.timeout / 10 + 0.2)

    def _timed_out(self, name: str, ctx: OpContext) -> None:
        """The op's deadline passed: fail, naming the rank(s) it was waiting for.

        A peer that sent nothing in the op is asked first whether it made the call
        (:mod:`.probe`; not for send/recv, whose peers are not numbered alike): one that
        has not, or does not answer within half the grace below, is named at once. A rank
        waiting only on peers that did send something, or that made the call, is blocked
        behind someone else: it waits a short grace first, so that the rank that found the
        stalled one reports first and its cause is the one every rank sees. An op waiting
        for no peer at that instant (it was between two waits on a loaded loop) is looked
        at again a grace later, once; only then does it fail naming no one.
        """
        host = self.host
        if host.error is not None or ctx not in self.running:
            return
        ops = tuple(self.running)
        waits = {(c, p) for c in ops if (p := _awaited(c)) is not None}
        peers = sorted({p for _, p in waits})
        silent = [p for p in peers if not any(p in c.heard for c in ops)]
        if not peers and not ctx.looked_again:
            # Waiting for no one at this instant: between two waits (a yield to the loop,
            # a reduction), so still running. Look again a grace later, when it most
            # likely waits for the rank that holds it up (or has finished).
            ctx.looked_again = True
            self._loop.call_later(self._grace(), self._timed_out, name, ctx)
            return
        if peers and not ctx.grace_used and not ctx.probed:
            # (the peers that sent something are asked too: where they wait themselves)
            asks: dict[int, Awaitable[PeerState | None]] = {}
            for c, p in sorted(waits, key=lambda w: w[1]):
                if p not in asks and c.desc.coll != Coll.SEND_RECV:
                    ask = host.probe_peer(p, c.seq, self._grace() / 2, c.desc.packed)
                    if ask is not None:
                        asks[p] = ask
            if asks:
                ctx.probed = {p: -1 for p in asks}
                task = self._loop.create_task(self._judge(name, ctx, asks, set(silent)))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)
                return
        if peers and not silent and not ctx.grace_used:
            ctx.grace_used = True
            self._loop.call_later(self._grace(), self._timed_out, name, ctx)
            return
        blamed = list(dict.fromkeys(self._culprit(ctx, p) for p in silent or peers))
        if (len(blamed) == 1 and blamed[0] not in (silent or peers) and not ctx.followed
                and ctx.desc.coll != Coll.SEND_RECV):
            # Named through a peer's answer: that rank may be waiting for another in turn
            ctx.followed = True
            task = self._loop.create_task(self._follow(name, ctx, blamed[0]))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
            return
        if not blamed:
            waited = ""
        elif silent:
            waited = "; it was waiting for " + "; ".join(
                self._silent(ctx, p) for p in silent)
        else:
            behind = [f"rank {p} was waiting for rank {w}" for p in peers
                      if (w := ctx.probed.get(p, -1)) >= 0]
            waited = (f"; it was waiting for rank{'s' if len(peers) > 1 else ''} "
                      f"{', '.join(map(str, peers))}, which had started this call"
                      + (f" ({'; '.join(behind)})" if behind else ""))
        self._fail_timeout(name, ctx, waited, blamed)

    def _culprit(self, ctx: OpContext, peer: int) -> int:
        """The rank to name for ``peer``, which sent nothing in ``ctx``: the rank it said
        it waits for (when asked, and that is neither this rank nor itself), else itself."""
        behind = ctx.probed.get(peer, -1)
        return behind if behind >= 0 and behind not in (self.host.rank, peer) else peer

    def _silent(self, ctx: OpContext, peer: int) -> str:
        """What the report says of ``peer``, which sent nothing in ``ctx``."""
        if peer in ctx.probed_held:  # (asked: it was still in an earlier call)
            return (f"rank {peer}, which has not made this call: it is still in an earlier "
                    f"one, waiting for rank {ctx.probed[peer]}")
        if peer in ctx.probed:  # (asked: it answered that it made the call)
            behind = ctx.probed[peer]
            return (f"rank {peer}, which had made this call but sent nothing in it"
                    + (f" (it was waiting for rank {behind})" if behind >= 0 else ""))
        how = "" if self.host.connected(peer) else " and has not connected to this rank"
        return f"rank {peer}, which sent nothing in this call{how} (stalled, or not in this call)"

    async def _follow(self, name: str, ctx: OpContext, rank: int) -> None:
        """Ask ``rank`` (named by a peer as the rank it waits for), then the rank it names,
        and so on (at most every rank once), about this op. Reported: the first that does
        not answer (or cannot be asked), or has not made the call and waits for no one;
        where one that made the call waits for no one known (between two waits, or done),
        the rank before it in the chain (see :meth:`_timed_out`)."""
        seen = {self.host.rank, *ctx.probed}
        chain: list[str] = []
        before = rank
        while rank not in seen:
            seen.add(rank)
            ask = self.host.probe_peer(rank, ctx.seq, self._grace() / 2, ctx.desc.packed)
            st = None if ask is None else await ask
            if self.host.error is not None or ctx not in self.running:
                return
            if st is not None and st.called and st.waiting_on is None:
                rank = before
                if chain:
                    chain.pop()
                break
            if st is None or st.waiting_on is None or st.waiting_on in seen:
                break
            chain.append(f"rank {rank} waits for rank {st.waiting_on}")
            before, rank = rank, st.waiting_on
        if self.host.error is not None or ctx not in self.running:
            return
        ops = tuple(self.running)
        silent = sorted({p for c in ops if (p := _awaited(c)) is not None
                         and not any(p in o.heard for o in ops)})
        waited = ("; it was waiting for " + "; ".join(self._silent(ctx, p) for p in silent)
                  if silent else "")
        self._fail_timeout(name, ctx, waited + (f"; {', '.join(chain)}" if chain else ""),
                           [rank])

    async def _judge(self, name: str, ctx: OpContext,
                     asks: dict[int, Awaitable[PeerState | None]], silent: set[int]
                     ) -> None:
        """Fail naming the asked ``silent`` peers that have not made the call or did not
        answer, or, when every one made it, wait the grace (see :meth:`_timed_out`). (A peer
        that sent something in the call made it; its answer may be queued behind its data,
        so its silence blames no one.)"""
        states = dict(zip(asks, await asyncio.gather(*asks.values()), strict=True))
        if self.host.error is not None or ctx not in self.running:
            return
        parts, blamed = [], []
        for p, st in states.items():
            if p not in silent:
                ctx.probed[p] = -1 if st is None or st.waiting_on is None else st.waiting_on
            elif st is None:
                blamed.append(p)
                parts.append(f"rank {p}, which sent nothing in this call and did not answer "
                             f"within {self._grace() / 2:g} s whether it made it (stalled, "
                             "or its event loop is blocked)")
            elif not st.called and not (st.earlier and st.waiting_on is not None
                                        and st.waiting_on not in (self.host.rank, p)):
                blamed.append(p)
                parts.append(f"rank {p}, which has not made this call (it has made "
                             f"{st.calls} call{'s' if st.calls != 1 else ''} on this "
                             "communicator)")
            else:  # (made the call, or held in an earlier one: the grace first)
                ctx.probed[p] = -1 if st.waiting_on is None else st.waiting_on
                if not st.called:
                    ctx.probed_held.add(p)
        if blamed:
            self._fail_timeout(name, ctx, "; it was waiting for " + "; ".join(parts), blamed)
            return
        ctx.grace_used = True
        self._loop.call_later(self._grace(), self._timed_out, name, ctx)

    def _fail_timeout(self, name: str, ctx: OpContext, waited: str, blamed: list[int]
                      ) -> None:
        host = self.host
        host.fail(AcollTimeoutError(f"{name} #{ctx.seq} did not complete within "
                                    f"{host.timeout:g} s on rank {host.rank}{waited}",
                                    blamed[0] if len(blamed) == 1 else None))

    def open_group(self, owner: Group) -> None:
        """Queue calls from now on, until :meth:`take_group` and :meth:`run_ops`, or
        :meth:`drop_ops` (called by :class:`~acoll._comm.groups.Group`): ``owner``'s
        calls return at once; other contexts' calls wait for theirs to run."""
        self._group = []
        self._owner = owner
        self._block_exited.clear()
        self._opened += 1

    def _block_ended(self) -> None:
        """The group's block exited (or the group ended): no more deadlines for waiting
        for it."""
        self._block_exited.set()
        for handle in self._overdue:
            handle.cancel()
        self._overdue.clear()

    def end_group(self) -> None:
        """No group holds this communicator any more (its ops hold the lock, or failed)."""
        self._group, self._owner = None, None
        self._block_ended()
        self._groups_ended()

    def _groups_ended(self) -> None:
        """Every group opened so far has ended: wake the work waiting for one."""
        self._ended = self._opened
        waiters, self._end_waiters = self._end_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def drop_ops(self, ops: list[GroupOp]) -> None:
        """Drop a group's ops (its block raised, or its exit was cancelled before they
        ran): the communicator fails (their numbers were promised to the peers), and
        calls of other contexts waiting among them get its error."""
        self.end_group()
        if not ops:
            return
        self.cancelled("group", ops[0][0])
        self._fail_callers(ops)

    def _fail_callers(self, ops: list[GroupOp]) -> None:
        """The communicator's error as the outcome of the calls other contexts made among
        ``ops`` (they wait for it)."""
        failed = self.host.error or RemoteError("the communicator failed", None)
        _settle_callers(ops, [failed] * len(ops))

    def _group_overdue(self, name: str, seq: int, waited: float,
                       done: asyncio.Future[None]) -> None:
        """A call made from outside an open group waited the communicator's timeout for
        the group's block to exit: fail the communicator (the call has its number; peers
        wait for it), which fails that call and the group's. Such a block most likely
        awaits this very call, and would never exit."""
        if done.done() or self.host.error is not None:
            return
        self.host.fail(AcollTimeoutError(
            f"{name} #{seq} on rank {self.host.rank} waited {waited:g} s for "
            "the group block of another task, which holds this communicator, to exit (a "
            "group block that awaits a call made outside it never exits)", self.host.rank))

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the communicator alone for work that takes no sequence number (a lane
        deregistration, and a one-rank communicator's split or registration: with more
        ranks those run as numbered ops, ``Communicator._in_call_order``), after every
        call made before it: a group another context holds
        open (its calls are numbered, not yet run) runs first (session 48's review: taking
        the lock at once ran such work before the group's calls on one rank and after
        them on another). The communicator's failure ends the wait. Waiting for the block
        to exit has the communicator's timeout; its ops then run under their own."""
        self.host.check_usable()
        if self._ended < self._opened:
            # (the group open now, not one opened after this call: it comes after)
            group = self._opened
            if not self._block_exited.is_set():
                wait = self.host.timeout
                try:  # (set by the failure too: :meth:`fail_waiting`)
                    await wait_for(self._block_exited.wait(), wait)
                except asyncio.TimeoutError:
                    raise AcollTimeoutError(
                        f"rank {self.host.rank} waited {wait:g} s for the group block of "
                        "another task, which holds this communicator, to exit",
                        self.host.rank) from None
            if self._ended < group:  # its ops are not on the lock yet
                ended = self._loop.create_future()
                self._end_waiters.append(ended)
                await ended
            self.host.check_usable()
        async with self.lock:
            self.host.check_usable()
            yield

    def fail_waiting(self) -> None:
        """The communicator failed (or was aborted): the calls other contexts made into
        the open group, which wait for its block to exit, raise its error now (the block
        may never exit, or only after a long while), and so does work waiting for the
        group to end (:meth:`exclusive`)."""
        if self._group:
            self._fail_callers(self._group)
        self._block_ended()
        self._groups_ended()

    def abandon_group(self) -> None:
        """The group's block raised: drop its ops (:meth:`drop_ops`)."""
        self.drop_ops(self._group or [])

    def take_group(self) -> list[GroupOp]:
        """The group's ops (its block exited), for :meth:`run_ops`: the list itself, so
        that calls other contexts make until they run join it, in order. An empty
        group ends here."""
        ops = self._group or []
        self._block_ended()
        if not ops:
            self.end_group()
        return ops

    async def run_ops(self, ops: list[GroupOp]) -> None:
        """Run a group's ops together (from :meth:`take_group`)."""
        try:
            await self.lock.acquire()
        except asyncio.CancelledError:
            self.drop_ops(ops)
            raise
        self.end_group()  # (later calls queue on the lock, behind these)
        try:
            self.host.check_usable()
            if self.check_group is not None:
                try:
                    self.check_group(ops)
                except AcollError as exc:  # (none ran: the peers hear why at once)
                    self.host.fail(exc)
                    raise
            results = await asyncio.gather(
                *(self._run(OpContext(self.host, seq, desc, True, tag), make, checked, full)
                  for seq, desc, tag, make, checked, full, _ in ops), return_exceptions=True)
        except BaseException:  # (cancelled, or failed before: the ops failed it)
            if self.host.error is None and ops:
                # Cancelled before any op took its first step (none of them ran a line,
                # so none reported it): their numbers were promised to the peers.
                self.cancelled("group", ops[0][0])
            self._fail_callers(ops)
            raise
        finally:
            self.lock.release()
        _settle_callers(ops, results)
        for res in results:
            if isinstance(res, BaseException):
                raise res


def _settle_callers(ops: list[GroupOp], results: list[BaseException | None]) -> None:
    """Complete the calls other contexts made among a group's ``ops`` with the outcome of
    each (an exception, or ``None`` for success)."""
    for op, res in zip(ops, results, strict=True):
        done = op[6]
        if done is not None and not done.done():
            if isinstance(res, BaseException):
                done.set_exception(res)
            else:
                done.set_result(None)


#: Seconds an op waits for a silent peer before sending it its descriptor to compare
#: (then twice as long before the next, and so on; a quarter of the timeout if less).
DESC_CHECK_S = 1.0


def _awaited(ctx: OpContext) -> int | None:
    """The peer ``ctx`` waits for now: its own wait's, else its agreement's."""
    return ctx.waiting_on if ctx.waiting_on is not None else ctx.agree_on


def _watch(ref: weakref.ref[Executor]) -> None:
    executor = ref()
    if executor is not None:
        executor._watch()
