"""The lane: collectives between processes of one host, through shared mailboxes.

When every rank of a host-memory communicator is on one host, in its own process, with a
core each, and every rank's shared-memory transport offers mailboxes
(``ACOLL_SHM_LANE_MAX``), collectives whose payload per peer fits a mailbox skip messages
altogether. Each rank copies its contribution into its mailbox towards every peer
(:mod:`acoll._transport.shmlane`), then busy-polls the peers' mailboxes towards it and
computes its result straight from them: one copy in, one pass out, no record, no
matching, no future and no wake-up on the way. An all_reduce combines the contributions
in rank order on every rank, so every rank gets the same bits.

Larger collectives (all but reduce) run as one op in steps of at most ``Lane.step`` per
peer (the slot, at most ``STEP_MAX``; :class:`StepPlan`, the algorithms are :class:`Steps`
subclasses): all_reduce two-shot (a reduce-scatter step then an all-gather step per
chunk), or, with 2 ranks and boards, one-shot steps of ``Lane.step`` up to 512 KiB (1 MiB
on hosts with 16 MiB of cache or more; every rank boards its piece and combines its
peer's: :func:`one_shot_steps_max`, :func:`one_shot_step`); the others one kind of step
per piece. Steps that send every peer the same bytes go through each rank's *board*
(:class:`~acoll._transport.shmlane.Board`, mapped by every peer) when every rank could map
every board (:meth:`Lane.setup`), else through the mailboxes.

- Who uses it is decided from the formation records alone (:func:`lane_size`: each
  rank's shared-memory handle says how large a lane it offers, 0 when it has no core per
  rank), so every rank agrees; which calls use it depends only on the call (its kind and
  size), so every rank takes the same path for the same call.
- A lane op made while the executor is idle runs at once, holding the executor's lock
  (taken without suspending), so that later calls, groups and ``close()`` wait for it as
  for any op; otherwise the executor runs it in its turn.
- Waiting (for peers, for a slot, for an earlier lane op): a busy-poll of the
  communicator's spin budget without yielding (peers only), then polls between loop
  iterations (``asyncio.sleep(0)``) for ``_YIELD_POLL_S``, then polls every ``_SLEEP_S``:
  the loop keeps running, and a peer that is late by more than a couple of milliseconds
  costs little CPU. What a wait waits for is looked at before the communicator's state,
  so an op its peers completed completes here too. Ops that find every peer ready complete without
  sleeping; a run of them yields to the loop at the start of an op once ``STEP_NS``
  (0.25 ms) passed, at an even op number (the same op on every rank; at any op after
  twice that): see :meth:`Lane.yields_before`.
- Disagreements are found on every rank: each lane op publishes its descriptor with its
  data, and an op that runs off the lane announces its number and descriptor in the
  mailboxes, so a rank waiting in the lane sees at once that a peer called something else
  (or the same call off the lane). Op numbers in shared memory are not wrapped.
- Memory: the lane owns its views of the segments; they are released when the
  communicator closes or aborts and no lane op is running any more, so a view is never
  used after it was released.
- Failures: the communicator's failure (a peer's death seen by its shared-memory
  connection, an abort, a timeout) ends every wait; a wait has the communicator's
  deadline of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import mmap
import os
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .._coll.base import STEP_NS, Coll, Descriptor
from .._config import get_logger, parse_size
from .._dtypes import ReduceOp, combiner, finish_avg, scale_into
from .._memory import Buffer, shared
from .._memory.host import data_address, paced
from .._memory.shared import SharedBlock, open_shared
from .._offloop import in_thread, submit, unmap
from .._transport.base import Connection, PeerInfo
from .._transport.shmlane import (
    Board,
    Head,
    Inbox,
    Outbox,
    board_span,
    head,
    head_desc,
    head_length,
    stamp,
)
from ..errors import AcollError, InvalidUsage, ProtocolError, RemoteError, TransportError
from ..errors import TimeoutError as AcollTimeoutError
from .peers import error_for_lost

__all__ = ["PAIR_STEP", "PAIR_STEP_LARGE", "STEP_MAX", "AllReducePlan", "Lane", "LanePlan",
           "StepPlan", "Steps",
           "ZERO_COPY_MIN", "ZeroCopyAllGather", "ZeroCopyAllReduce", "ZeroCopyBroadcast",
           "ZeroCopyReduceScatter",
           "all_reduce_one_shot_steps", "largest_cache", "one_shot_step", "one_shot_steps_max",
           "pair_step",
           "all_gather_steps",
           "all_reduce_steps",
           "all_to_all_steps", "broadcast_steps", "lane_size", "one_shot_max",
           "reduce_scatter_steps"]

_YIELD_POLL_S = 2e-3
#: the most a step of a step plan moves per peer: on the 2-core VM, two-shot steps of
#: 2 MiB parts took 384 to 517 us per 4 MiB all_reduce against 298 to 318 with 1 MiB
STEP_MAX = 1 << 20
_SLEEP_S = 5e-4
log = get_logger("COLL")


def lane_size(infos: Sequence[PeerInfo], host_memory: bool) -> int:
    """The payload bytes per peer the communicator of ``infos`` runs through the lane;
    0 when it has no lane (see the module docstring). Every rank computes the same."""
    from .._transport import shm

    n = len(infos)
    if not host_memory or n < 2 or shm.unsupported():
        return 0
    first = infos[0]
    if len({info.proc for info in infos}) != n:
        return 0
    lanes = []
    for info in infos:
        handle = info.handles.get("shm", b"")
        netns = shm.handle_netns(handle)
        if not info.same_host(first) or netns is None or netns != shm.handle_netns(
                first.handles.get("shm", b"")):
            return 0
        lanes.append(shm.handle_lane(handle))
    return min(lanes)


_BOARD_NAME = "acoll-board"
_BOARD_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                if hasattr(fcntl, "F_SEAL_SHRINK") else 0)


def _new_board(span: int) -> tuple[int, mmap.mmap]:
    """This rank's board: a memfd of ``span`` bytes, its pages reserved, sealed against
    resizing (a peer cannot shrink it under a reader: no SIGBUS), mapped."""
    fd = os.memfd_create(_BOARD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, span)
        os.posix_fallocate(fd, 0, span)
        if _BOARD_SEALS:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _BOARD_SEALS)
        return fd, mmap.mmap(fd, span)
    except BaseException:
        os.close(fd)
        raise


def open_board(pid: int, fd: int, span: int) -> mmap.mmap:
    """Map another process's board (its memfd ``fd``, through ``/proc``) after checking
    that it is one: a memfd of that name, ``span`` bytes, sealed against resizing.

    Raises:
        OSError: it cannot be opened. ValueError: it is not a board.
    """
    path = f"/proc/{int(pid)}/fd/{int(fd)}"
    if not os.readlink(path).startswith(f"/memfd:{_BOARD_NAME}"):
        raise ValueError(f"{path} is not a board")
    bfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        size = os.fstat(bfd).st_size
        if size != span:
            raise ValueError(f"the board holds {size} bytes, not {span}")
        if _BOARD_SEALS and fcntl.fcntl(bfd, fcntl.F_GET_SEALS) & _BOARD_SEALS != _BOARD_SEALS:
            raise ValueError("the board is not sealed against resizing")
        return mmap.mmap(bfd, span)
    finally:
        os.close(bfd)


def _open_boards(records: Sequence[dict[str, Any]], rank: int, span: int
                 ) -> tuple[dict[int, mmap.mmap], str]:
    """Map every other rank's board (``records``: their all-gathered records): the maps,
    and why not all of them could be mapped ("" when they could). Raises nothing."""
    maps: dict[int, mmap.mmap] = {}
    for k, rec in enumerate(records):
        if k == rank:
            continue
        try:
            maps[k] = open_board(rec["pid"], rec["fd"], span)
            if maps[k][:16] != rec["token"]:
                return maps, f"rank {rank} mapped a stranger's board for rank {k}"
        except Exception as exc:  # (every rank must reach the second all-gather)
            return maps, f"rank {rank} cannot map rank {k}'s board: {exc}"
    return maps, ""


def _close_board(made: tuple[int, mmap.mmap]) -> None:
    os.close(made[0])
    _close_maps([made[1]])


def _close_maps(maps: Any) -> None:
    for mm in list(maps):
        with contextlib.suppress(BufferError):
            mm.close()


class _HostReg(NamedTuple):
    """A registered host allocation: its token, this rank's mapping of it (kept alive while
    registered), this rank's mappings of the peers' allocations, and every rank's array
    bytes by rank (uint8 views)."""

    token: bytes
    keep: Any
    maps: list[mmap.mmap]
    views: list[Any]


def _close_reg(reg: _HostReg) -> None:
    """Drop a registration's views and unmap the peers' allocations, on acoll's worker
    threads: unmapping hundreds of MiB takes tens of milliseconds (found by review:
    deregister() held the loop 15 to 96 ms, close() 58 to 125 ms, with 512 MiB registered
    on 2 and 3 ranks), and munmap lets go of the GIL."""
    reg.views.clear()
    for mm in list(reg.maps):
        try:
            submit(unmap, mm)
        except RuntimeError:  # (the pool is shut down: the interpreter is ending)
            _close_maps([mm])


def _unwrap(conn: Connection) -> Any:
    while hasattr(conn, "inner"):
        conn = conn.inner
    return conn


class Lane:
    """One communicator's lane: its mailboxes to every peer (see the module docstring)."""

    def __init__(self, rank: int, size: int, limit: int) -> None:
        self.rank = rank
        self.size = size
        self.limit = limit
        #: payload bytes per peer of one step of a step plan: the slot, at most
        #: ``STEP_MAX`` (a larger slot serves calls made in one step; 2-rank one-shot
        #: all_reduce steps of 1 MiB against a whole 2 MiB slot, paired in the same
        #: processes (``bench/lane_piece_ab.py``): 4 to 16 MiB 0.96 to 1.28x as fast in
        #: three runs on the 2-core VM (AMD, 512 KiB of L2 a core; 64 MiB 0.97 to 1.06x),
        #: 1.00 to 1.05x on the 16-core host; those steps move at most ``PAIR_STEP``
        #: since session 47: :func:`one_shot_step`)
        self.step = min(limit, STEP_MAX)
        #: the most a 2-rank one-shot all_reduce step moves (:func:`one_shot_step`): this
        #: host's choice, then the smallest of every rank's (:meth:`_setup_boards`)
        self.pair_step = pair_step(largest_cache())
        self.peers = [p for p in range(size) if p != rank]
        self.outboxes: list[Outbox] = []
        self.inboxes: list[Inbox | None] = []  # by rank (None: this rank)
        self._conns: list[Any] = []
        #: when a run of lane ops that never slept next yields to the loop (STEP_NS)
        self.yield_at = 0
        #: op numbers of the lane ops that have not published yet, in the order they
        #: started: they publish in that order, so that two ops waiting for one slot (op
        #: ``s`` and ``s + 2`` of a group) take it in turn
        self.turns: deque[int] = deque()
        self.inflight = 0  # lane ops running now
        self.release_pending = False
        self.released = False
        self._scratch = np.empty(0, np.uint8)
        self._spare: list[Any] = []  # arrays given back (see borrow)
        #: every rank's board by rank (this rank's own included), when every rank mapped
        #: every board (:meth:`setup`); else None and steps go through the mailboxes
        self.boards: list[Board] | None = None
        self._board_maps: list[mmap.mmap] = []
        #: registered host allocations by registration index (None: deregistered); the
        #: same on every rank, since registering is collective (:meth:`register`)
        self.regs: list[_HostReg | None] = []
        self._reg_of: dict[bytes, int] = {}  # this rank's allocation token -> index
        self._reg_version = 0  # changes at every (de)registration
        #: the last array located: (weak reference, nbytes, registrations' version,
        #: where) (a live array's memory stays where it is, in or out of an allocation)
        self._located: tuple[Any, int, int, tuple[int, int]] | None = None
        #: the abandoned phase value of the zero-copy op whose peers may be reading this
        #: rank's buffers now (0: none; see :class:`_ZeroCopy` and :meth:`abandon`)
        self.abandon_at = 0

    def yields_before(self, seq: int) -> bool:
        """Whether lane op ``seq`` (of a run of ops that never slept) yields to the loop
        before it starts: once ``STEP_NS`` passed since the last yield, at an even op
        number, so that the ranks of such a run yield at the same op and none waits for
        a peer's yield (2 ranks on the 2-core VM: a peer's yield cost the other about
        18 us per 1 MiB zero-copy call); at any op once ``2 * STEP_NS`` passed."""
        over = time.perf_counter_ns() - self.yield_at
        return over >= 0 and (not seq & 1 or over >= STEP_NS)

    def scratch(self, nbytes: int) -> Any:
        """A byte array of at least ``nbytes`` for a combination's copy of this rank's
        operand that is done with before the op yields; shared by the lane's ops (two
        never use it at once). A copy that must outlive a wait takes :meth:`borrow`."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch

    def borrow(self, nbytes: int) -> Any:
        """A byte array of at least ``nbytes`` of the caller's own until it gives it back
        (:meth:`give_back`): for a copy of this rank's operand that a step folds in after
        waiting for its peers, while a later op of a group may already run and combine
        (session 48's review: with the shared scratch, that op overwrote the copy). Kept
        for reuse, so a run of ops allocates nothing."""
        spare = self._spare
        for i, buf in enumerate(spare):
            if buf.nbytes >= nbytes:
                return spare.pop(i)
        return np.empty(nbytes, np.uint8)

    def give_back(self, buf: Any) -> None:
        """Return an array of :meth:`borrow` (none is given back on an error: dropped)."""
        if len(self._spare) < 4:
            self._spare.append(buf)

    async def setup(self, comm: Any) -> None:
        """Connect to every peer and take the mailboxes of each connection.

        Raises:
            TransportError: a connection has no mailbox (the ranks disagree on the lane).
        """
        for peer in self.peers:
            conn = _unwrap(await comm.connection(peer))
            boxes = conn.mailboxes() if hasattr(conn, "mailboxes") else None
            if boxes is None and getattr(conn, "failed", None) is not None:
                # The peer failed (or closed) already, perhaps on a disagreement found by
                # a rank that formed first: its error, not a missing mailbox.
                comm.check_usable()
                raise error_for_lost(peer, conn.failed) or RemoteError(
                    f"rank {peer} closed the communicator", peer)
            if boxes is None or boxes[0].lane < self.limit:
                raise TransportError(f"rank {self.rank}: the connection to rank {peer} has "
                                     "no shared-memory mailbox for the lane")
            self._conns.append(conn)
            self.outboxes.append(boxes[0])
            if not self.inboxes:
                self.inboxes = [None] * self.size
            self.inboxes[peer] = boxes[1]
        await self._setup_boards(comm._boot)

    async def _setup_boards(self, boot: Any) -> None:
        """Make this rank's board and map every peer's (over ``/proc/PID/fd``, checked by a
        random token), agreeing over the bootstrap: every rank uses boards, or none does
        (a rank that cannot open a peer's descriptor, e.g. in another PID namespace, says
        why and every rank logs it). Nothing between the two all-gathers raises, so the
        ranks stay in step."""
        n, span = self.size, board_span(self.size, self.limit)
        token = os.urandom(16)
        fd, why = -1, ""
        maps: dict[int, mmap.mmap] = {}
        try:
            try:
                # (reserving the pages takes a millisecond or more: not on the loop)
                fd, maps[self.rank] = await in_thread(lambda: _new_board(span), _close_board)
                maps[self.rank][:16] = token
            except Exception as exc:  # (every rank must reach the all-gathers)
                why = f"rank {self.rank} cannot make its board: {exc}"
            records = [msgpack.unpackb(r) for r in await boot.allgather(msgpack.packb(
                {"pid": os.getpid(), "fd": fd, "token": token, "why": why,
                 "pair": self.pair_step}))]
            why = next((r["why"] for r in records if r["why"]), "")
            # (the one-shot steps run on boards only; every rank must cut them alike, and
            # each read its own cache sizes: the smallest step wins)
            self.pair_step = min(int(r["pair"]) for r in records)
            if not why:
                opened, why = await in_thread(
                    lambda: _open_boards(records, self.rank, span),
                    lambda made: _close_maps(made[0].values()))
                maps.update(opened)
            verdicts = [msgpack.unpackb(v) for v in await boot.allgather(msgpack.packb(why))]
            why = next((v for v in verdicts if v), "")
        except BaseException:
            _close_maps(maps.values())
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # (every rank mapped it, or gave up)
        if why:
            log.info("lane: steps go through the mailboxes, not boards: %s", why)
            _close_maps(maps.values())
            return
        self._board_maps = [maps[k] for k in range(n)]
        self.boards = [Board(memoryview(maps[k]), n, self.limit, k, self.rank)
                       for k in range(n)]

    async def register(self, found: tuple[SharedBlock, int] | None, boot: Any) -> int:
        """Register this rank's allocation (``found``: from :func:`shared.find`, None when
        the buffer is not in one) with every peer (collective): each maps every other
        rank's allocation. Returns the registration's index, the same on every rank, or
        -1 when some rank's buffer is not in an allocation or cannot be mapped (every rank
        then logs why). Nothing between the two all-gathers raises, so the ranks stay in
        step."""
        if self.boards is None:
            log.info("register: host buffers stay unregistered: the lane has no boards "
                     "(ranks cannot map each other's memory)")
            return -1
        block = found[0] if found is not None else None
        keep = block.mapping() if block is not None else None
        rec: dict[str, Any] = {"why": ""}
        if block is None or keep is None:
            rec["why"] = (f"rank {self.rank}'s buffer is not in memory from "
                          "acoll.empty_shared")
        else:
            rec.update(pid=os.getpid(), fd=block.fd, span=block.span, token=block.token)
        maps: dict[int, mmap.mmap] = {}
        views: list[Any] = [None] * self.size
        try:
            records = [msgpack.unpackb(r) for r in await boot.allgather(
                msgpack.packb(rec), "register()")]
            why = next((r["why"] for r in records if r["why"]), "")
            for k, other in enumerate(records):
                if why or k == self.rank:
                    continue
                try:
                    maps[k], views[k] = open_shared(other["pid"], other["fd"], other["span"],
                                                    other["token"])
                except Exception as exc:  # (every rank must reach the all-gather)
                    why = f"rank {self.rank} cannot map rank {k}'s registered buffer: {exc}"
            verdicts = [msgpack.unpackb(v) for v in await boot.allgather(msgpack.packb(why))]
            why = next((v for v in verdicts if v), "")
        except BaseException:
            _close_maps(maps.values())
            raise
        if why:
            log.info("register: host buffers stay unregistered: %s", why)
            _close_maps(maps.values())
            return -1
        assert block is not None
        assert keep is not None
        views[self.rank] = np.frombuffer(keep, np.uint8, block.nbytes, shared.HEADER)
        index = len(self.regs)
        self.regs.append(_HostReg(block.token, keep, list(maps.values()), views))
        self._reg_of.setdefault(block.token, index)
        self._reg_version += 1
        return index

    def deregister(self, index: int) -> None:
        """Drop registration ``index`` (every rank does, in the same order; no op runs)."""
        reg = self.regs[index]
        if reg is None:
            return
        self.regs[index] = None
        self._reg_version += 1
        if self._reg_of.get(reg.token) == index:
            del self._reg_of[reg.token]
            again = next((k for k, r in enumerate(self.regs)
                          if r is not None and r.token == reg.token), None)
            if again is not None:
                self._reg_of[reg.token] = again
        _close_reg(reg)

    def abandon(self) -> None:
        """Mark the zero-copy op in flight, if any, as abandoned by this rank (now: its
        caller may touch its buffers from here on). Called when the communicator fails or
        is aborted, whichever task runs the op."""
        if self.abandon_at and self.boards is not None:
            self.boards[self.rank].set_phase(self.abandon_at)

    @property
    def registered(self) -> bool:
        """Whether any host allocation is registered (the same on every rank)."""
        return bool(self._reg_of) or any(r is not None for r in self.regs)

    def locate(self, arr: Any) -> tuple[int, int]:
        """(registration index + 1, byte offset) of ``arr`` (a contiguous NumPy array), or
        (0, 0) when it does not lie in a registered allocation of this rank."""
        if not self._reg_of:
            return 0, 0
        nbytes, last = arr.nbytes, self._located
        if (last is not None and last[0]() is arr and last[1] == nbytes
                and last[2] == self._reg_version):
            return last[3]
        found = shared.find(data_address(arr), nbytes)
        index = None if found is None else self._reg_of.get(found[0].token)
        where = (0, 0) if found is None or index is None else (index + 1, found[1])
        if arr.base is not None:  # (see data_address: owners stay free to resize)
            self._located = (weakref.ref(arr), nbytes, self._reg_version, where)
        return where

    def announce(self, seq: int, desc: Descriptor) -> None:
        """Op ``seq`` runs off the lane (called by the executor for every such op)."""
        for out in self.outboxes:
            out.announce(seq, desc.packed)

    def release(self) -> None:
        """Release the mailbox views once no lane op runs (now, or when the last ends).
        The communicator drops its plans first."""
        if self.inflight:
            self.release_pending = True
            return
        if self.released:
            return
        self.released = True
        for box in [*self.outboxes, *(i for i in self.inboxes if i is not None),
                    *(self.boards or ())]:
            box.release()
        _close_maps(self._board_maps)
        # (a map still exported, e.g. by a plan that a kept traceback holds, is unmapped
        # once that is collected: nothing here keeps it)
        self._board_maps = []
        self.boards = None
        for reg in self.regs:
            if reg is not None:
                _close_reg(reg)
        self.regs = []
        self._reg_of = {}
        for conn in self._conns:
            conn.unmap_if_released()


class _LaneCall:
    """What every lane call does (see the module docstring): subclasses say what goes
    into each outbox (``_fill``) and how the result is made (``_finish``)."""

    comm: Any
    lane: Lane
    desc: Descriptor
    #: (outbox, its peer, the head published there, its two slots' payload views or None,
    #: what goes there or None for the ``mine`` of the call)
    heads: list[tuple[Outbox, int, Head, Any, Any]]
    reads: list[tuple[int, Inbox, Head]]  # (peer, its inbox, the head expected there)

    def _finish(self, slot: int, mine: Any, res: Any) -> None:
        """Make this rank's result from the inboxes' slot ``slot``."""

    async def run(self, seq: int, ctx: Any = None, mine: Any = None, res: Any = None,
                  turned: bool = False) -> None:
        """Run the call as op number ``seq`` (not wrapped): publish, wait for every peer,
        check, combine, give the peers' slots back. ``ctx``: the executor's op context
        (it then learns whom the op waits for); ``mine``/``res``: the arrays of a reused
        plan; ``turned``: the caller holds the op's turn already (first in
        ``lane.turns``), which this run gives back."""
        lane = self.lane
        lane.inflight += 1
        turns = lane.turns
        try:
            # (failed or closed since the caller checked: the views may be released)
            self.comm.check_usable()
        except BaseException:
            lane.inflight -= 1
            if turned:
                turns.remove(seq)
            raise
        if not turned:
            turns.append(seq)  # (before any await: ops publish in the order they start)
        try:
            try:
                if not turned and (turns[0] != seq or lane.yields_before(seq)):
                    # Another lane op (of a group, or of another task) publishes first;
                    # and ops that all find their peers ready never sleep: bound the
                    # loop's step.
                    await self._turn(seq)
                slot = seq & 1
                for out, peer, top, dst, src in self.heads:
                    if not out.free(seq):
                        await self._wait_free(out, peer, seq)
                    if dst is not None:
                        dst[slot][:] = mine if src is None else src
                    out.publish(seq, top)
            finally:
                turns.remove(seq)
            for _, inbox, _ in self.reads:
                if not inbox.arrived(seq):
                    await self._wait(seq, ctx)
                    break
            for peer, inbox, expect in self.reads:
                got = inbox.head(seq)
                if got != expect:
                    raise self._disagree(peer, got, expect)
            self._finish(slot, mine, res)
            for _, inbox, _ in self.reads:
                inbox.ack(seq)
        finally:
            lane.inflight -= 1
            if not lane.inflight and lane.release_pending:
                lane.release()

    def _disagree(self, peer: int, got: Head, expect: Head) -> AcollError:
        if got[:2] != expect[:2]:
            return InvalidUsage(self.desc.describe_difference(
                Descriptor.unpack(head_desc(got)), self.lane.rank, peer))
        return ProtocolError(f"lane: rank {peer} published {head_length(got)} bytes for "
                             f"{self.desc.coll.name.lower()}, {head_length(expect)} were "
                             "expected")

    async def _poll(self, seq: int, done: Callable[[], bool], spin: int,
                    timed_out: Callable[[], AcollError], pending: Callable[[], None]) -> None:
        """Until ``done()``: spin ``spin`` ns, then poll between loop iterations (see the
        module doc). ``pending()`` checks for disagreements between polls."""
        if spin:
            end = time.perf_counter_ns() + spin
            while time.perf_counter_ns() < end:
                if done():
                    return
        comm = self.comm
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + comm.timeout
        while True:
            pending()
            now = loop.time()
            if now >= deadline:
                raise timed_out()
            if now - start < _YIELD_POLL_S:
                # (a peer that shares this core runs now: without it a poll burns the
                # rest of this process's time slice while the peer it waits for waits)
                os.sched_yield()
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(_SLEEP_S)
            self.lane.yield_at = time.perf_counter_ns() + STEP_NS
            if done():  # (first: an op that completed everywhere completes here too)
                return
            comm.check_usable()

    async def _wait(self, seq: int, ctx: Any, step: int = 0, boxes: Any = None) -> None:
        """Until every peer published step ``step`` of op ``seq`` in its mailbox towards
        this rank, or (``boxes``: the lane's boards) on its board."""
        inboxes: Any = self.lane.inboxes if boxes is None else boxes
        slot, value = (seq + step) & 1, stamp(seq, step)
        pending = [peer for peer, _, _ in self.reads
                   if not inboxes[peer].arrived_at(slot, value)]

        def done() -> bool:
            pending[:] = [p for p in pending
                          if not inboxes[p].arrived_at(slot, value)]
            if ctx is not None and pending:
                ctx.waiting_on = pending[0]
                ctx.heard.update(p for p in self.lane.peers if p not in pending)
            return not pending

        if done():
            return
        def disagreements() -> None:
            self._check_announced(seq, pending)
            self._check_crossed(seq, step, pending, boxes is not None)
            if not step:
                self._check_recorded(seq, pending)

        await self._poll(seq, done, self.comm.spin_ns[pending[0]],
                         lambda: self._timed_out(seq, pending, step), disagreements)

    def _check_crossed(self, seq: int, step: int, pending: list[int], on_boards: bool
                       ) -> None:
        """A peer that published this step where this rank does not look for it (its
        board, or its mailbox) runs another call: name the difference."""
        boards = self.lane.boards
        if boards is None:
            return
        slot, value = (seq + step) & 1, stamp(seq, step)
        for p in pending:
            other = self.lane.inboxes[p] if on_boards else boards[p]
            if other is None or not other.arrived_at(slot, value):
                continue
            got = head_desc(other.head_at(slot))
            if got != self.desc.packed:
                raise InvalidUsage(self.desc.describe_difference(
                    Descriptor.unpack(got), self.lane.rank, p))
            raise ProtocolError(f"lane: rank {p} published step {step + 1} of "
                                f"{self.desc.coll.name.lower()} #{seq} where rank "
                                f"{self.lane.rank} does not read it")

    async def _wait_board(self, seq: int, step: int) -> None:
        """Until every peer read what this rank last wrote on its board in the slot step
        ``step`` of op ``seq`` needs."""
        board = self.lane.boards[self.lane.rank]  # type: ignore[index]
        slot = (seq + step) & 1
        peers = self.lane.peers
        await self._poll(seq, lambda: board.free_at(slot), 0,
                         lambda: self._timed_out(seq, board.unread(slot) or list(peers), step,
                                                 reading=True), lambda: None)

    async def _wait_free(self, out: Outbox, peer: int, seq: int, step: int = 0) -> None:
        """Until ``peer`` read what this rank last wrote in the slot step ``step`` of op
        ``seq`` needs."""
        slot = (seq + step) & 1
        await self._poll(seq, lambda: out.free_at(slot), 0,
                         lambda: self._timed_out(seq, [peer], step, reading=True),
                         lambda: None)

    async def take_turn(self, seq: int) -> None:
        """Take op ``seq``'s turn and wait until the lane ops started before it published,
        for a caller with work of the op's own to do first (AVG's scaling of this rank's
        input); it then runs the call with ``turned=True``, or gives the turn back
        (``lane.turns.remove(seq)``) if that work fails. On error here the turn is given
        back already."""
        lane = self.lane
        turns = lane.turns
        turns.append(seq)
        try:
            self.comm.check_usable()
            if turns[0] != seq or lane.yields_before(seq):  # (as run() would)
                await self._turn(seq)
        except BaseException:
            turns.remove(seq)
            raise

    async def _turn(self, seq: int) -> None:
        """Yield to the loop, then until the lane ops started before this one published."""
        lane = self.lane
        await asyncio.sleep(0)
        lane.yield_at = time.perf_counter_ns() + STEP_NS
        if lane.turns[0] == seq:
            return
        self.comm.check_usable()
        await self._poll(seq, lambda: lane.turns[0] == seq, 0, lambda: AcollTimeoutError(
            f"{self.desc.coll.name.lower()} #{seq} waited {self.comm.timeout:g} s for "
            f"earlier lane ops on rank {lane.rank}"), lambda: None)

    def _check_recorded(self, seq: int, pending: list[int]) -> None:
        """A peer that said on its call line what it calls op ``seq`` with runs a call
        that may go zero-copy (:class:`_ZeroCopy`): name the difference when it is another
        call, or when this rank's call may not go zero-copy (it said nothing on its own
        line). (A rank whose own buffers are not registered falls back without reading
        its peers' lines: this is where it finds a peer that calls something else.)"""
        boards = self.lane.boards
        if boards is None or not self.lane.registered:
            return
        posted = boards[self.lane.rank].called(seq) is not None
        for p in pending:
            rec = boards[p].called(seq)
            if rec is None:
                continue
            got = head_desc((rec[0], rec[1], 0))
            if got != self.desc.packed:
                raise InvalidUsage(self.desc.describe_difference(
                    Descriptor.unpack(got), self.lane.rank, p))
            if posted:
                continue  # (both may go zero-copy: the peer falls back on this rank's line)
            raise ProtocolError(f"lane: rank {p} runs {self.desc.coll.name.lower()} #{seq} "
                                f"as a call on registered buffers, rank {self.lane.rank} "
                                "does not (do the ranks' registrations differ?)")

    def _check_announced(self, seq: int, pending: list[int]) -> None:
        for p in pending:
            got = self.lane.inboxes[p].announced(seq)  # type: ignore[union-attr]
            if got is None:
                continue
            if got != self.desc.packed:
                raise InvalidUsage(self.desc.describe_difference(
                    Descriptor.unpack(got), self.lane.rank, p))
            raise InvalidUsage(
                f"rank {p} runs {self.desc.coll.name.lower()} #{seq} off the shared-memory "
                f"lane while rank {self.lane.rank} runs it through the lane (do the ranks' "
                "ACOLL_SHM_LANE_MAX settings differ?)")

    def _timed_out(self, seq: int, pending: list[int], step: int = 0,
                   reading: bool = False) -> AcollError:
        """The error of a wait that ran out of time: for peers to publish ``step`` (0: to
        reach the call), or (``reading``) for a peer to read what this rank wrote before."""
        name = self.desc.coll.name.lower()
        many = len(pending) > 1
        who = f"rank{'s' if many else ''} {', '.join(map(str, pending))}"
        if reading:
            why = (f"for {who} to read what it wrote before step {step + 1} of this call "
                   "(the peer stopped in this call or an earlier one)")
        elif step:
            why = (f"at step {step + 1} of this call for {who}, which did not finish "
                   "the step before")
        else:
            why = f"for {who}, which did not reach this call"
        return AcollTimeoutError(
            f"{name} #{seq} did not complete within {self.comm.timeout:g} s on rank "
            f"{self.lane.rank}; it was waiting {why}", None if many else pending[0])


class LanePlan(_LaneCall):
    """One call's moves through the lane, for its buffers (built per call).

    ``send``/``recv`` are host buffers (``recv`` may be ``send``; either is ``None`` for a
    barrier, ``recv`` for a reduce's non-root ranks)."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, send: Buffer | None,
                 recv: Buffer | None, op: ReduceOp = ReduceOp.SUM, root: int = 0) -> None:
        self.comm, self.lane, self.desc = comm, lane, desc
        coll, rank, n = desc.coll, lane.rank, lane.size
        mine = send.view() if send is not None else None
        nbytes = mine.nbytes if mine is not None else 0
        chunk = nbytes // n if coll in (Coll.REDUCE_SCATTER, Coll.ALL_TO_ALL) else 0

        def to(peer: int) -> memoryview | None:
            """What this rank puts in its mailbox towards ``peer``."""
            if mine is None:
                return None
            if coll in (Coll.ALL_REDUCE, Coll.ALL_GATHER) or (
                    coll == Coll.BROADCAST and rank == root) or (
                    coll == Coll.REDUCE and peer == root):
                return mine
            if chunk:
                return mine[peer * chunk:(peer + 1) * chunk]
            return None

        def length_from(peer: int) -> int:
            """The payload ``peer`` puts in its mailbox towards this rank."""
            if coll in (Coll.ALL_REDUCE, Coll.ALL_GATHER):
                return nbytes
            if coll == Coll.BROADCAST:
                return nbytes if peer == root else 0
            if coll == Coll.REDUCE:
                return nbytes if rank == root else 0
            return chunk

        packed = desc.packed
        self.heads = []
        for i, peer in enumerate(lane.peers):
            out = lane.outboxes[i]
            src = to(peer)
            size = 0 if src is None else src.nbytes
            dst = [out.payload(slot, size) for slot in (0, 1)] if size else None
            self.heads.append((out, peer, head(packed, size), dst, src))
        self.reads = []
        self._sizes: dict[int, int] = {}
        for peer in lane.peers:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            size = length_from(peer)
            self._sizes[peer] = size
            self.reads.append((peer, inbox, head(packed, size)))
        self._result = self._make_result(send, recv, op, root)

    def _finish(self, slot: int, mine: Any, res: Any) -> None:
        self._result(slot)

    def _make_result(self, send: Buffer | None, recv: Buffer | None, op: ReduceOp,
                     root: int) -> Callable[[int], None]:
        """The step that makes this rank's result from the mailboxes of slot ``slot``."""
        coll, lane = self.desc.coll, self.lane
        rank, n = lane.rank, lane.size

        def incoming(peer: int) -> list[memoryview]:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            return [inbox.payload(slot, self._sizes[peer]) for slot in (0, 1)]

        if coll == Coll.BARRIER or (coll == Coll.BROADCAST and rank == root) or (
                coll == Coll.REDUCE and rank != root):
            return _nothing
        assert send is not None
        assert recv is not None
        if coll == Coll.BROADCAST:
            dst, src = recv.view(), incoming(root)

            def broadcast(slot: int) -> None:
                dst[:] = src[slot]

            return broadcast
        if coll in (Coll.ALL_GATHER, Coll.ALL_TO_ALL):
            out = recv.view()
            piece = out.nbytes // n
            moves = [(out[k * piece:(k + 1) * piece], incoming(k)) for k in lane.peers]
            at = send.ptr + (rank * piece if coll == Coll.ALL_TO_ALL else 0)
            if at != recv.ptr + rank * piece:  # (in place: this rank's block is there)
                own = send.view()
                own = own[rank * piece:(rank + 1) * piece] if coll == Coll.ALL_TO_ALL else own
                moves.append((out[rank * piece:(rank + 1) * piece], [own, own]))

            def gather(slot: int) -> None:
                for dst, src in moves:
                    dst[:] = src[slot]

            return gather
        # ALL_REDUCE, REDUCE (root), REDUCE_SCATTER: combine in rank order on every rank
        res = recv.array
        mine = send.array
        if coll == Coll.REDUCE_SCATTER:
            mine = mine[rank * res.size:(rank + 1) * res.size]
        parts = [None if k == rank else [np.frombuffer(v, res.dtype) for v in incoming(k)]
                 for k in range(n)]
        saved = np.empty_like(mine) if rank >= 2 and np.may_share_memory(res, mine) else None
        return functools.partial(_combine, parts, rank, op, mine, res, saved)


class AllReducePlan(_LaneCall):
    """An all_reduce of ``count`` x ``dtype`` under ``op`` through the lane, for any
    arrays: the communicator keeps these per (dtype, count, op) and passes each call's
    arrays to :meth:`run` (flat, contiguous; ``res`` may be ``mine``)."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, dtype: Any, count: int,
                 op: ReduceOp) -> None:
        self.comm, self.lane, self.desc, self.op = comm, lane, desc, op
        nbytes = count * dtype.itemsize
        top = head(desc.packed, nbytes)
        self.heads = [(out, peer, top,
                       [np.frombuffer(out.payload(slot, nbytes), dtype) for slot in (0, 1)],
                       None) for out, peer in zip(lane.outboxes, lane.peers, strict=True)]
        self.reads = []
        for peer in lane.peers:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            self.reads.append((peer, inbox, top))
        self._nbytes, self._dtype = nbytes, dtype
        self._parts = [None if k == lane.rank else
                       [np.frombuffer(lane.inboxes[k].payload(slot, nbytes),  # type: ignore[union-attr]
                                      dtype) for slot in (0, 1)]
                       for k in range(lane.size)]
        self._ufunc = combiner(ReduceOp.SUM if op == ReduceOp.AVG else op, dtype)
        self._avg = op == ReduceOp.AVG
        self._peer = lane.peers[0]  # (2 ranks: the other one)

    def _finish(self, slot: int, mine: Any, res: Any) -> None:
        if self.lane.size == 2:  # the common case, without the general loop
            other = self._parts[self._peer][slot]  # type: ignore[index]
            if self._peer:
                self._ufunc(mine, other, out=res)
            else:
                self._ufunc(other, mine, out=res)
            if self._avg:
                finish_avg(res, 2)
            return
        _combine(self._parts, self.lane.rank, self.op, mine, res,
                 self._saved() if mine is res or np.may_share_memory(mine, res) else None,
                 slot)

    def _saved(self) -> Any:
        """Where ranks >= 2 keep their operand in place (the lane's scratch)."""
        if self.lane.rank < 2:
            return None
        return self.lane.scratch(self._nbytes)[:self._nbytes].view(self._dtype)


def one_shot_max(lane: Lane) -> int:
    """The largest all_reduce (bytes) the lane runs in one shot (:class:`AllReducePlan`:
    every rank reads every peer's whole contribution); larger ones run in two-shot steps
    (:func:`all_reduce_steps`). A function of the lane alone, so every rank picks alike."""
    if lane.size == 2:
        return lane.limit
    return min(lane.limit, _ONE_SHOT_BYTES // (lane.size - 1))


def one_shot_step(lane: Lane) -> int:
    """Bytes per step of a 2-rank one-shot all_reduce in steps
    (:func:`all_reduce_one_shot_steps`): the lane's step, at most ``lane.pair_step``
    (:func:`pair_step`, agreed by every rank as the boards are set up). A function of the
    lane alone, so every rank picks alike."""
    return min(lane.step, lane.pair_step)


def pair_step(cache: int) -> int:
    """The most a 2-rank one-shot all_reduce step moves on a host whose largest CPU cache
    has ``cache`` bytes (0: unknown): :data:`PAIR_STEP`, or :data:`PAIR_STEP_LARGE` from
    :data:`_LARGE_CACHE` of cache up."""
    return PAIR_STEP_LARGE if cache >= _LARGE_CACHE else PAIR_STEP


#: where Linux describes CPU 0's caches (the same file for every process of a host)
_CPU0_CACHES = "/sys/devices/system/cpu/cpu0/cache"


def largest_cache(root: str = _CPU0_CACHES) -> int:
    """Bytes of CPU 0's largest data or unified cache as sysfs describes it (0: not
    described, as in some containers and VMs, or not readable now). Read once per process
    and root where it succeeds."""
    known = _caches.get(root) or _read_largest_cache(root)
    if known:
        _caches[root] = known
    return known


_caches: dict[str, int] = {}  # root -> a read that found a size (a failed one is retried)


def _read_largest_cache(root: str) -> int:
    best = 0
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return 0
    for name in names:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(root, name, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(root, name, "size")) as f:
                best = max(best, parse_size(f.read()))
        except (OSError, ValueError):
            continue
    return best


def one_shot_steps_max(lane: Lane) -> int:
    """The largest all_reduce (bytes) the lane runs in one-shot steps
    (:func:`all_reduce_one_shot_steps`) when it is too large for one step; larger ones,
    and every one of more than 2 ranks or without boards, go two-shot. A function of the
    lane alone (its boards are used by every rank or by none)."""
    if lane.size != 2 or lane.boards is None:
        return 0
    return _PAIR_ONE_SHOT_SLOTS * lane.limit


#: bytes a 2-rank one-shot all_reduce step moves at most (:func:`one_shot_step`). Steps
#: alternate the two slots, so the slots a run of steps touches is four steps' worth (two
#: ranks, two slots each) beside the arrays: on the 2-core VM (AMD, 8 MiB of L3) 512 KiB
#: steps were 1.19 to 1.35x as fast as 1 MiB ones at 4 to 16 MiB when its two vCPUs shared
#: the L3 and 0.95 to 1.00x when they did not (five runs); on the 16-core host 0.99 to
#: 1.05x (``bench/lane_piece_ab.py``, ``bench/results/session47_lane_cap_ab.txt``).
#: Where the largest cache holds ``_LARGE_CACHE`` or more, steps move
#: ``PAIR_STEP_LARGE``: on a 2-core VM with 32 MiB of L3 (session 52), 1 MiB steps were
#: 1.02 to 1.23x as fast as 512 KiB ones at 4 to 16 MiB in three runs, in either of the
#: VM's modes (``bench/results/session52_2core_pair_step.txt``)
PAIR_STEP = 512 << 10
PAIR_STEP_LARGE = 1 << 20
_LARGE_CACHE = 16 << 20
#: 2 ranks: one-shot steps up to this many slots; paired against two-shot steps on the
#: 2-core VM they were 1.03 to 1.09x faster at every size from 4 to 128 MiB
#: (``bench/lane_pair_ab.py``), so every size takes them
_PAIR_ONE_SHOT_SLOTS = 1 << 40
#: what the one-shot all_reduce reads from its peers at most (bytes, all peers together)
_ONE_SHOT_BYTES = 256 << 10
#: a step plan with at most this many steps makes them once, when it is made
_MADE_STEPS = 64


class _Step(NamedTuple):
    """One step of a :class:`StepPlan`, in elements of the call's flat arrays."""

    #: per outbox (``lane.peers`` order): (from ``res``, not ``mine``; start; end)
    sends: list[tuple[bool, int, int]]
    #: per peer (``lane.peers`` order): (elements it sends; where they go in ``res``, -1:
    #: they are combined, or there are none)
    recvs: list[tuple[int, int]]
    #: a combining step: (start of this rank's operand in ``mine``, start in ``res``, count)
    combine: tuple[int, int, int] | None = None
    #: this rank's own piece: (start in ``mine``, start in ``res``, count), copied unless
    #: the call is in place
    own: tuple[int, int, int] | None = None
    #: every peer gets the same bytes: the lane's boards carry them where it has some
    board: bool = False


class Steps(ABC):
    """A collective's steps through the lane, made one at a time when the op runs (a large
    op through a small slot has many): ``steps[k]`` for ``k < len(steps)``. Subclasses
    are the collectives' algorithms; every rank makes the same number of steps from the
    call alone."""

    #: (start in ``mine``, start in ``res``, count) of this rank's own block, or None
    local: tuple[int, int, int] | None = None
    #: steps whose AVG scales its input as they copy it (``factor`` of
    #: :meth:`StepPlan.run`) by default, rather than all of it first: all_reduce's
    #: two-shot steps (and reduce_scatter's, :class:`_ReduceScatterSteps`), where
    #: folded was 1.10 to 1.30x as fast with 4 and 8 ranks at 4 to 64 MiB on the 16-core
    #: host; not the 2-rank one-shot steps, whose own operand is then read back from the
    #: board: 0.85 to 0.91x there at 4 to 64 MiB, 0.92 to 1.39x on the 2-core VM
    #: (``bench/avg_fold_ab.py``, ``bench/results/session52_gpu/``)
    folds_scaling = False

    def __init__(self, lane: Lane, total: int, per: int, span: int) -> None:
        self.rank, self.size, self.peers = lane.rank, lane.size, lane.peers
        self.total, self.per, self.span = total, per, span
        self._len = -(-total // span)  # (pieces of ``span``; ceil)

    def __len__(self) -> int:
        return self._len

    def piece(self, k: int) -> tuple[int, int]:
        lo = k * self.span
        return lo, min(lo + self.span, self.total)

    @abstractmethod
    def __getitem__(self, k: int) -> _Step:
        """Step ``k`` of this rank."""


class _AllReduceSteps(Steps):
    """Two-shot all_reduce: per chunk of up to ``size * per`` elements, a reduce-scatter
    step (rank ``k`` combines part ``k`` of the chunk) then an all-gather step."""

    folds_scaling = True

    def __init__(self, lane: Lane, count: int, per: int) -> None:
        super().__init__(lane, count, per, per * lane.size)
        self._len *= 2  # (two steps per chunk)

    def __getitem__(self, k: int) -> _Step:
        parts = _split(*self.piece(k >> 1), self.size)
        a, b = parts[self.rank]
        if not k & 1:
            return _Step([(False, *parts[p]) for p in self.peers],
                         [(b - a, -1)] * len(self.peers), (a, a, b - a))
        return _Step([(True, a, b)] * len(self.peers),
                     [(parts[p][1] - parts[p][0], parts[p][0]) for p in self.peers],
                     board=True)


class _AllReduceOneShotSteps(Steps):
    """One-shot all_reduce in steps: per piece of up to ``per`` elements, every rank puts
    its whole piece on its board and combines every peer's, in rank order (no all-gather
    step; for 2 ranks it reads as many bytes across cores as the two-shot steps, in half
    the steps)."""

    def __init__(self, lane: Lane, count: int, per: int) -> None:
        super().__init__(lane, count, per, per)

    def __getitem__(self, k: int) -> _Step:
        lo, hi = self.piece(k)
        n = len(self.peers)
        return _Step([(False, lo, hi)] * n, [(hi - lo, -1)] * n, (lo, lo, hi - lo),
                     board=True)


class _ReduceScatterSteps(Steps):
    """reduce_scatter of blocks of ``total`` elements, a piece of each block per step."""

    #: (as two-shot all_reduce steps: the pieces go through the mailboxes, this rank's
    #: own into a scratch piece; session 52: see ``bench/results/session52_2core_rs_avg.txt``)
    folds_scaling = True

    def __init__(self, lane: Lane, block: int, per: int) -> None:
        super().__init__(lane, block, per, per)

    def __getitem__(self, k: int) -> _Step:
        lo, hi = self.piece(k)
        b = self.total
        return _Step([(False, p * b + lo, p * b + hi) for p in self.peers],
                     [(hi - lo, -1)] * len(self.peers), (self.rank * b + lo, lo, hi - lo))


class _AllGatherSteps(Steps):
    """all_gather of blocks of ``total`` bytes (``mine`` is this rank's block)."""

    def __init__(self, lane: Lane, block: int, per: int) -> None:
        super().__init__(lane, block, per, per)
        self.local = (0, self.rank * block, block)

    def __getitem__(self, k: int) -> _Step:
        lo, hi = self.piece(k)
        b = self.total
        return _Step([(False, lo, hi)] * len(self.peers),
                     [(hi - lo, p * b + lo) for p in self.peers],
                     own=(lo, self.rank * b + lo, hi - lo), board=True)


class _BroadcastSteps(Steps):
    """broadcast of ``total`` bytes from ``root`` (``mine`` and ``res``: one buffer)."""

    def __init__(self, lane: Lane, nbytes: int, per: int, root: int) -> None:
        super().__init__(lane, nbytes, per, per)
        self.root = root

    def __getitem__(self, k: int) -> _Step:
        lo, hi = self.piece(k)
        n = len(self.peers)
        if self.rank == self.root:
            return _Step([(False, lo, hi)] * n, [(0, -1)] * n, board=True)
        return _Step([(False, 0, 0)] * n,
                     [(hi - lo, lo) if p == self.root else (0, -1) for p in self.peers],
                     board=True)


class _AllToAllSteps(Steps):
    """all_to_all of blocks of ``total`` bytes."""

    def __init__(self, lane: Lane, block: int, per: int) -> None:
        super().__init__(lane, block, per, per)
        self.local = (self.rank * block, self.rank * block, block)

    def __getitem__(self, k: int) -> _Step:
        lo, hi = self.piece(k)
        b, r = self.total, self.rank
        return _Step([(False, p * b + lo, p * b + hi) for p in self.peers],
                     [(hi - lo, p * b + lo) for p in self.peers],
                     own=(r * b + lo, r * b + lo, hi - lo))


def _split(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in ``n`` parts, the first ``(hi - lo) % n`` one longer."""
    base, rem = divmod(hi - lo, n)
    bounds, at = [], lo
    for k in range(n):
        end = at + base + (k < rem)
        bounds.append((at, end))
        at = end
    return bounds


def all_reduce_steps(lane: Lane, count: int, per: int) -> Steps:
    """Two-shot all_reduce of ``count`` elements, ``per`` at most per peer per step."""
    return _AllReduceSteps(lane, count, per)


def all_reduce_one_shot_steps(lane: Lane, count: int, per: int) -> Steps:
    """One-shot all_reduce of ``count`` elements in pieces of ``per`` (every rank reads
    every peer's whole piece: only where the lane has boards)."""
    return _AllReduceOneShotSteps(lane, count, per)


def reduce_scatter_steps(lane: Lane, block: int, per: int) -> Steps:
    """reduce_scatter of blocks of ``block`` elements, ``per`` at most per step."""
    return _ReduceScatterSteps(lane, block, per)


def all_gather_steps(lane: Lane, block: int, per: int) -> Steps:
    """all_gather of blocks of ``block`` bytes (``mine`` is this rank's block)."""
    return _AllGatherSteps(lane, block, per)


def broadcast_steps(lane: Lane, nbytes: int, per: int, root: int) -> Steps:
    """broadcast of ``nbytes`` from ``root`` (``mine`` and ``res``: the one buffer)."""
    return _BroadcastSteps(lane, nbytes, per, root)


def all_to_all_steps(lane: Lane, block: int, per: int) -> Steps:
    """all_to_all of blocks of ``block`` bytes (this rank's own block is copied piece by
    piece with the steps, unless in place)."""
    return _AllToAllSteps(lane, block, per)


class StepPlan(_LaneCall):
    """A collective too large for one mailbox slot, in steps of at most a slot per peer
    (:class:`Steps` says which; cached like :class:`AllReducePlan` for all_reduce).
    In each step a rank writes into its slot towards every peer, waits until every peer
    wrote, then either copies what its peers sent into ``res`` or combines it, in rank
    order, with its own operand; a step also copies this rank's own piece where the
    collective has one and the call is not in place.

    Step ``k`` of op ``s`` uses slot ``(s + k) % 2`` (stamped :func:`stamp`), so a step
    writes while the peers may still read the one before. The op keeps the lane's turn
    until it published its last step: a later lane op (of a group) cannot take a slot one
    of its steps needs."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, dtype: Any, steps: Steps,
                 op: ReduceOp = ReduceOp.SUM) -> None:
        self.comm, self.lane, self.desc, self.op = comm, lane, desc, op
        self.steps = steps
        #: the steps made once, when there are at most _MADE_STEPS (every step is used)
        self._made = [steps[k] for k in range(len(steps))] if len(steps) <= _MADE_STEPS else None
        item = dtype.itemsize
        per = max(steps.per, 1)  # (elements per peer per step; at most a slot)
        self._item, self._dtype = item, dtype
        top = head(desc.packed, 0)
        self._words = top[:2]
        self.heads = []
        self._outs = [(out, peer, [np.frombuffer(out.payload(slot, per * item), dtype)
                                   for slot in (0, 1)])
                      for out, peer in zip(lane.outboxes, lane.peers, strict=True)]
        self.reads = []
        self._ins: list[list[Any] | None] = [None] * lane.size
        for peer in lane.peers:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            self.reads.append((peer, inbox, top))
            self._ins[peer] = [np.frombuffer(inbox.payload(slot, per * item), dtype)
                               for slot in (0, 1)]
        #: every rank's board payloads (own included), by rank then slot
        self._boards = None if lane.boards is None else [
            [np.frombuffer(board.payload(slot, per * item), dtype) for slot in (0, 1)]
            for board in lane.boards]
        self._ufunc = combiner(ReduceOp.SUM if op == ReduceOp.AVG else op, dtype)

    async def run(self, seq: int, ctx: Any = None, mine: Any = None, res: Any = None,
                  turned: bool = False, factor: Any = None) -> None:
        """Run the steps from ``mine`` into ``res`` (flat arrays of the plan's dtype; may be
        one array) as op ``seq``; ``turned``: the caller holds the op's turn already (it
        is first in ``lane.turns``), which this run gives back. ``factor`` (a scalar of
        the dtype; all_reduce's and reduce_scatter's steps): the run reads ``mine`` as
        ``mine * factor``
        (AVG's scaling, NCCL's PreMulSum), scaling each piece where it would have copied
        it (into a mailbox or board, or as this rank's operand of a combination): the
        same values as scaling all of ``mine`` first, without the pass over it."""
        lane = self.lane
        lane.inflight += 1
        try:
            self.comm.check_usable()  # (failed or closed since the caller checked)
        except BaseException:
            lane.inflight -= 1
            if turned:
                lane.turns.remove(seq)
            raise
        turns = lane.turns
        if not turned:
            turns.append(seq)  # (before any await, as in _LaneCall.run)
        held = True
        try:
            try:
                if not turned and (turns[0] != seq or lane.yields_before(seq)):
                    await self._turn(seq)
                item, ins, steps, made = self._item, self._ins, self.steps, self._made
                rank, inboxes, boards = lane.rank, lane.inboxes, lane.boards
                word_a, word_b = self._words
                inplace = mine is res or np.may_share_memory(mine, res)
                local = steps.local
                copy_own = local is not None and not np.may_share_memory(
                    mine[local[0]:local[0] + local[2]], res[local[1]:local[1] + local[2]])
                last = len(steps) - 1
                for k in range(last + 1):
                    if k and time.perf_counter_ns() >= lane.yield_at:
                        await asyncio.sleep(0)
                        lane.yield_at = time.perf_counter_ns() + STEP_NS
                        self.comm.check_usable()
                    step = made[k] if made is not None else steps[k]
                    slot, value = (seq + k) & 1, stamp(seq, k)
                    on_boards = step.board and boards is not None
                    if on_boards:  # (written once, for every peer)
                        assert boards is not None
                        board = boards[rank]
                        if not board.free_at(slot):
                            await self._wait_board(seq, k)
                        from_res, a, b = step.sends[0]
                        if b > a:
                            on = self._boards[rank][slot][:b - a]  # type: ignore[index]
                            if factor is not None and not from_res:
                                scale_into(on, mine[a:b], factor)
                            else:
                                on[...] = (res if from_res else mine)[a:b]
                        board.publish_at(slot, value, (word_a, word_b, (b - a) * item))
                        boxes: Any = boards
                        views_in: Any = self._boards
                    else:
                        for (out, peer, views), (from_res, a, b) in zip(
                                self._outs, step.sends, strict=True):
                            if not out.free_at(slot):
                                await self._wait_free(out, peer, seq, k)
                            if b > a:
                                if factor is not None and not from_res:
                                    scale_into(views[slot][:b - a], mine[a:b], factor)
                                else:
                                    views[slot][:b - a] = (res if from_res else mine)[a:b]
                            out.publish_at(slot, value, (word_a, word_b, (b - a) * item))
                        boxes, views_in = inboxes, ins
                    if k == last:
                        turns.remove(seq)
                        held = False
                    if copy_own and step.own is not None:
                        a, at, m = step.own
                        if factor is not None:
                            scale_into(res[at:at + m], mine[a:a + m], factor)
                        else:
                            res[at:at + m] = mine[a:a + m]
                    if step.combine is not None:
                        # (this rank's own board copy is read only while the op holds the
                        # turn: past it a later op may write that slot once the peer read it)
                        take = self._folder(slot, value, step, mine, res, inplace, boxes,
                                            views_in, factor, on_boards and held)
                    else:
                        take = self._copier(slot, value, step, res, boxes, views_in)
                    if not take():
                        await self._receive(seq, ctx, k, take, boxes, on_boards, value)
            finally:
                if held:
                    turns.remove(seq)
        finally:
            lane.inflight -= 1
            if not lane.inflight and lane.release_pending:
                lane.release()

    def _take(self, box: Any, peer: int, slot: int, m: int) -> None:
        """Check the head ``peer`` published in ``slot`` (of a step it published): this
        call, ``m`` elements."""
        want = (*self._words, m * self._item)
        got = box.head_at(slot)
        if got != want:
            raise self._disagree(peer, got, want)

    def _copier(self, slot: int, value: int, step: _Step, res: Any, boxes: Any,
                views_in: Any) -> Any:
        """A copying step's receive, peer by peer as each one's piece arrives: the
        function returned copies (and gives back) every piece arrived since its last call
        and says whether none is left; its ``pending`` lists the peers it waits for."""
        pending = list(zip(self.lane.peers, step.recvs, strict=True))

        def take() -> bool:
            left = []
            for item in pending:
                peer, (m, at) = item
                box = boxes[peer]
                if not box.arrived_at(slot, value):
                    left.append(item)
                    continue
                self._take(box, peer, slot, m)
                if m and at >= 0:
                    res[at:at + m] = views_in[peer][slot][:m]
                box.ack_at(slot, value)
            pending[:] = left
            return not left

        take.pending = pending  # type: ignore[attr-defined]
        return take

    def _folder(self, slot: int, value: int, step: _Step, mine: Any, res: Any,
                inplace: bool, boxes: Any, views_in: Any, factor: Any = None,
                on_boards: bool = False) -> Any:
        """A combining step's receive: this rank's operand and its peers' (from
        ``views_in``: the mailboxes' or the boards' payload views) folded into ``res`` in
        rank order, each peer's as soon as it arrived and every one before it was folded
        (the same bits as folding them all at the end). Returned as for :meth:`_copier`.
        ``factor``: this rank's operand is ``mine * factor`` (see :meth:`run`); where
        the step put exactly that piece on this rank's board (``on_boards``: and the op
        still holds the lane's turn, so no later op writes that slot), it is read there."""
        assert step.combine is not None
        a, at, m = step.combine
        lane = self.lane
        rank, n = lane.rank, lane.size
        own, out = mine[a:a + m], res[at:at + m]
        held: Any = None
        if factor is not None and m:
            if on_boards and step.sends[0] == (False, a, a + m):  # (one-shot steps)
                own = views_in[rank][slot][:m]
            else:  # (a copy of its own, scaled: as below, the fold may wait)
                held = lane.borrow(m * self._item)
                own = held[:m * self._item].view(self._dtype)
                scale_into(own, mine[a:a + m], factor)
        elif m and rank >= 2 and inplace:  # (the first combinations would overwrite it)
            # (a copy of its own: the fold may wait for peers, and a later op of a group
            # may run meanwhile)
            held = lane.borrow(m * self._item)
            own = held[:m * self._item].view(self._dtype)
            np.copyto(own, mine[a:a + m])
        ufunc, avg = self._ufunc, self.op == ReduceOp.AVG
        #: the ranks not folded yet, in rank order (this one's own operand included)
        order = list(range(n))
        pending = [(p, (m, -1)) for p in lane.peers]

        def ready(k: int) -> bool:
            if k == rank:
                return True
            box = boxes[k]
            if not box.arrived_at(slot, value):
                return False
            self._take(box, k, slot, m)
            return True

        def operand(k: int) -> Any:
            return own if k == rank else views_in[k][slot][:m]

        def done(k: int) -> None:
            if k != rank:
                boxes[k].ack_at(slot, value)
                pending[:] = [item for item in pending if item[0] != k]

        def take() -> bool:
            if len(order) == n:  # (nothing folded yet: the first two together)
                if not (ready(0) and ready(1)):
                    return False
                if m:
                    ufunc(operand(0), operand(1), out=out)
                del order[:2]
                done(0)
                done(1)
            while order:
                k = order[0]
                if not ready(k):
                    return False
                if m:
                    ufunc(out, operand(k), out=out)
                del order[0]
                done(k)
            if avg and m:
                finish_avg(out, n)
            if held is not None:
                lane.give_back(held)
            return True

        take.pending = pending  # type: ignore[attr-defined]
        return take

    async def _receive(self, seq: int, ctx: Any, step: int, take: Any, boxes: Any,
                       on_boards: bool, value: int) -> None:
        """Until ``take()`` (of :meth:`_copier` or :meth:`_folder`) took every peer's
        piece of step ``step`` of op ``seq`` (stamped ``value``): spin, then poll
        (:meth:`_poll`), checking the peers whose piece has not arrived for disagreements
        and naming them on a timeout (not those arrived but waiting to be folded)."""
        pending, slot = take.pending, (seq + step) & 1

        def missing() -> list[int]:
            return [p for p, _ in pending if not boxes[p].arrived_at(slot, value)]

        def done() -> bool:
            if take():
                return True
            if ctx is not None:
                waiting = missing()
                if waiting:
                    ctx.waiting_on = waiting[0]
                    ctx.heard.update(p for p in self.lane.peers if p not in waiting)
            return False

        def disagreements() -> None:
            left = missing()
            self._check_announced(seq, left)
            self._check_crossed(seq, step, left, on_boards)
            if not step:
                self._check_recorded(seq, left)

        if done():
            return
        await self._poll(seq, done, self.comm.spin_ns[pending[0][0]],
                         lambda: self._timed_out(seq, missing() or [p for p, _ in pending],
                                                 step), disagreements)


def _combine(parts: list[list[Any] | None], rank: int, op: ReduceOp, mine: Any, res: Any,
             saved: Any, slot: int) -> None:
    """``res`` = the rank-ordered combination of every rank's part of slot ``slot``
    (``mine`` for this rank's); ``saved``: where to keep ``mine`` first, when ``res``
    overlaps it and the first combinations would overwrite it before its turn."""
    if saved is not None:
        np.copyto(saved, mine)
        mine = saved
    ufunc = combiner(ReduceOp.SUM if op == ReduceOp.AVG else op, res.dtype)
    operands = [mine if p is None else p[slot] for p in parts]
    ufunc(operands[0], operands[1], out=res)
    for part in operands[2:]:
        ufunc(res, part, out=res)
    if op == ReduceOp.AVG:
        finish_avg(res, len(parts))


def _nothing(slot: int) -> None:
    pass


#: the phase word's low bits in a zero-copy op: 1 (and 2, all_reduce's second) after its
#: phases, this one for a rank that left the op by an exception (see :class:`_ZeroCopy`)
_ABANDONED = 3
#: all_reduces, broadcasts, all_gathers (their receive buffer) and reduce_scatters (their
#: send buffer) from this size (bytes) may go zero-copy (smaller ones go through the
#: mailboxes as they are: waiting for every peer's record and phases costs more than the
#: copies saved)
ZERO_COPY_MIN = 512 << 10


class _ZeroCopy(_LaneCall):
    """A collective that reads the peers' buffers in place when every rank's buffers lie
    in registered allocations (:meth:`Lane.register`; ``fallback``, the plan the call
    would have run, runs otherwise, holding the same turn).

    Each rank says on its board's call line which registered allocation and offset its
    send and receive buffers are at (:meth:`Board.post_call`), and waits for every peer's
    record: every rank reads the same records, so every rank reaches the same verdict
    (zero-copy when every rank's buffers are registered). Zero-copy, the subclass's
    phases run (:meth:`_zero_copy`), each ended by :meth:`_phase`: this rank publishes
    how far it got on its phase word and waits until every peer got as far. After the
    last wait nobody reads this rank's buffers any more, and the op returns. The op keeps
    the lane's turn to the end: a later lane op cannot overwrite the call line it needs.

    A rank that leaves the op by an exception once it posted its record (a timeout, a
    cancellation, a peer's failure), or whose communicator fails or is aborted while the
    op runs (a call cancelled while another task runs it, in a group), sets its phase to
    the *abandoned* value (``_ABANDONED``, :meth:`Lane.abandon`) before its caller can
    touch its buffers again: a peer may still be reading them. Every wait for phases
    checks for that value after it is satisfied (the abandoned value passes any wait of
    the op), so a peer that read buffers which may have changed under it raises instead
    of returning a result."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, dtype: Any,
                 send_count: int, recv_count: int,
                 fallback: Callable[[], _LaneCall | StepPlan]) -> None:
        self.comm, self.lane, self.desc = comm, lane, desc
        self.heads, self.reads = [], []
        #: makes the plan that runs when some rank's buffers are not registered (made
        #: only then: a step plan's views and steps cost more than a zero-copy call)
        self.fallback = fallback
        self._dtype = np.dtype(dtype)
        self._send_bytes = send_count * self._dtype.itemsize
        self._recv_bytes = recv_count * self._dtype.itemsize
        self._words = head(desc.packed, 0)[:2]

    @property
    def _name(self) -> str:
        return self.desc.coll.name.lower()

    async def run(self, seq: int, ctx: Any = None, mine: Any = None, res: Any = None,
                  turned: bool = False) -> None:
        """Run as op ``seq`` from ``mine`` into ``res`` (flat arrays of the call's dtype;
        may be one); ``turned`` as for :meth:`_LaneCall.run`."""
        lane = self.lane
        lane.inflight += 1
        turns = lane.turns
        try:
            self.comm.check_usable()  # (failed or closed since the caller checked)
        except BaseException:
            lane.inflight -= 1
            if turned:
                turns.remove(seq)
            raise
        if not turned:
            turns.append(seq)  # (before any await, as in _LaneCall.run)
        held = True
        try:
            if not turned and (turns[0] != seq or lane.yields_before(seq)):
                await self._turn(seq)
            boards = lane.boards
            assert boards is not None
            sent = lane.locate(mine)
            same = mine is res or (data_address(mine) == data_address(res)
                                   and mine.nbytes == res.nbytes)
            got = sent if same else lane.locate(res)
            board = boards[lane.rank]
            lane.abandon_at = ((seq + 1) << 2) + _ABANDONED
            board.post_call(seq, (*self._words, *sent, *got))
            try:
                # (this rank's buffers not registered: the verdict of every rank, which
                # each reads on this call line; it needs none of theirs to fall back)
                records = (await self._records(seq, ctx) if sent[0] and got[0]
                           else None)
                if records is not None:
                    sends = [mine if k == lane.rank else a for k, (a, _) in enumerate(records)]
                    recvs = [res if k == lane.rank else b for k, (_, b) in enumerate(records)]
                    await self._zero_copy(seq, ctx, sends, recvs)
            except BaseException as exc:
                lane.abandon()  # (see the class doc)
                if not isinstance(exc, (AcollError, asyncio.CancelledError)):
                    # (e.g. MemoryError: the peers must not wait for this rank's next op)
                    self.comm.fail(ProtocolError(
                        f"lane: {self._name} #{seq} failed on rank {lane.rank}: {exc!r}"))
                raise
            finally:
                lane.abandon_at = 0
            if records is None:
                # The fallback gives the turn back once it published its last step; the
                # lane's later ops still wait for a guard until it completed: a later
                # zero-copy op would replace this call's record on the call line, which a
                # peer may not have read yet (one whose buffers are registered reads it
                # before it publishes its first step, which this rank's fallback waits for).
                held = False
                guard = ~seq  # (no op's number)
                turns.insert(1, guard)
                try:
                    await self.fallback().run(seq, ctx, mine, res, turned=True)
                finally:
                    turns.remove(guard)
        finally:
            if held:
                turns.remove(seq)
            lane.inflight -= 1
            if not lane.inflight and lane.release_pending:
                lane.release()

    @abstractmethod
    async def _zero_copy(self, seq: int, ctx: Any, sends: list[Any], recvs: list[Any]
                         ) -> None:
        """The phases, from every rank's send buffer into this rank's receive buffer
        (``sends[k]``/``recvs[k]``: rank ``k``'s; this rank's are the caller's arrays)."""

    async def _records(self, seq: int, ctx: Any) -> list[tuple[Any, Any]] | None:
        """Wait for every peer's call record of op ``seq``; every rank's (send, receive)
        arrays when every rank's buffers are registered, else None (the same verdict on
        every rank)."""
        lane = self.lane
        boards = lane.boards
        assert boards is not None
        pending = [p for p in lane.peers if boards[p].called(seq) is None]
        if pending:
            def done() -> bool:
                pending[:] = [p for p in pending if boards[p].called(seq) is None]
                if ctx is not None and pending:
                    ctx.waiting_on = pending[0]
                    ctx.heard.update(p for p in lane.peers if p not in pending)
                return not pending

            def elsewhere() -> None:
                self._check_announced(seq, pending)
                self._check_published(seq, pending)

            await self._poll(seq, done, self.comm.spin_ns[pending[0]],
                             lambda: self._timed_out(seq, pending), elsewhere)
        records = []
        for k in range(lane.size):
            rec = boards[k].called(seq)
            assert rec is not None
            if k != lane.rank and (rec[0], rec[1]) != self._words:
                raise InvalidUsage(self.desc.describe_difference(
                    Descriptor.unpack(head_desc((rec[0], rec[1], 0))), lane.rank, k))
            records.append(rec)
        if any(not rec[2] or not rec[4] for rec in records):
            return None  # (the verdict of every rank: they all read the same records)
        return [(self._array(k, rec[2], rec[3], self._send_bytes),
                 self._array(k, rec[4], rec[5], self._recv_bytes))
                for k, rec in enumerate(records)]

    def _array(self, rank: int, reg: int, offset: int, nbytes: int) -> Any:
        regs = self.lane.regs
        if not 0 < reg <= len(regs):  # (indexes are never reused: see Lane.register)
            raise ProtocolError(f"lane: rank {rank} named registration {reg - 1}, which "
                                f"rank {self.lane.rank} never made")
        entry = regs[reg - 1]
        if entry is None:
            raise InvalidUsage(f"{self._name}: rank {rank} calls it on registered buffers "
                               f"(registration {reg - 1}) that rank {self.lane.rank} "
                               "deregistered (deregister() on every rank alike, in the "
                               "same order)")
        view = entry.views[rank]
        if offset < 0 or offset + nbytes > view.nbytes:
            raise ProtocolError(f"lane: rank {rank} named {nbytes} bytes at offset "
                                f"{offset} of a registered buffer of {view.nbytes}")
        return view[offset:offset + nbytes].view(self._dtype)

    def _check_published(self, seq: int, pending: list[int]) -> None:
        """A pending peer that published op ``seq`` in its mailbox or on its board without
        saying on its call line what it calls op ``seq`` with runs another call (or this
        one off the registered path): name the difference.

        ``pending`` may be stale: a peer may have posted its record, seen every rank's
        (this one's included) and published the fallback's first step since it was
        computed. So the call line is read after the publication (the owner writes the
        record first; stores are seen in order), and a peer that posted is no offender."""
        lane = self.lane
        boards = lane.boards
        assert boards is not None
        slot, value = seq & 1, stamp(seq, 0)
        for p in pending:
            for where in (lane.inboxes[p], boards[p]):
                if where is None or not where.arrived_at(slot, value):
                    continue
                if boards[p].called(seq) is not None:
                    break  # (it posted first: its fallback runs; done() sees it next)
                got = head_desc(where.head_at(slot))
                if got != self.desc.packed:
                    raise InvalidUsage(self.desc.describe_difference(
                        Descriptor.unpack(got), lane.rank, p))
                raise ProtocolError(f"lane: rank {p} runs {self._name} #{seq} without its "
                                    f"registered buffers, rank {lane.rank} with them (do the "
                                    "ranks' registrations differ?)")

    async def _phase(self, seq: int, ctx: Any, step: int) -> None:
        """Publish that this rank finished phase ``step`` (1 or 2) of op ``seq``, then
        wait until every peer did; raise if a peer abandoned the op (class doc)."""
        lane = self.lane
        lane.boards[lane.rank].set_phase(((seq + 1) << 2) + step)  # type: ignore[index]
        pending = lane.peers
        while pending:
            ready = await self._reached(seq, ctx, step, pending)
            pending = [p for p in pending if p not in ready]
        self._check_abandoned(seq, step, lane.peers)

    async def _reached(self, seq: int, ctx: Any, step: int, peers: list[int]) -> list[int]:
        """Those of ``peers`` (in their order) that finished phase ``step`` of op ``seq``,
        once there is one (this rank published its own phase before); raise if one of
        them abandoned the op (class doc)."""
        boards = self.lane.boards
        assert boards is not None
        value = ((seq + 1) << 2) + step
        ready = [p for p in peers if boards[p].phase() >= value]
        if not ready:
            def done() -> bool:
                ready[:] = [p for p in peers if boards[p].phase() >= value]
                if ctx is not None and not ready:
                    ctx.waiting_on = peers[0]
                return bool(ready)

            await self._poll(seq, done, self.comm.spin_ns[peers[0]],
                             lambda: self._timed_out(seq, list(peers), step), lambda: None)
        self._check_abandoned(seq, step, ready)
        return ready

    def _check_abandoned(self, seq: int, step: int, peers: list[int]) -> None:
        """Raise if one of ``peers`` abandoned op ``seq`` (class doc)."""
        boards = self.lane.boards
        assert boards is not None
        abandoned = ((seq + 1) << 2) + _ABANDONED
        gone = [p for p in peers if boards[p].phase() == abandoned]
        if gone:
            self.comm.check_usable()  # (its own failure, when it arrived: the first cause)
            raise RemoteError(f"{self._name} #{seq}: rank {gone[0]} left the call at phase "
                              f"{step} while rank {self.lane.rank} read its registered "
                              "buffers", gone[0])

    async def _pace(self) -> None:
        """Between pieces: stop if the communicator failed (it may have been cancelled
        from another task: the caller's buffers are no longer the op's), and yield to the
        loop once a step's time is spent."""
        lane = self.lane
        self.comm.check_usable()
        if time.perf_counter_ns() >= lane.yield_at:
            await asyncio.sleep(0)
            lane.yield_at = time.perf_counter_ns() + STEP_NS
            self.comm.check_usable()

    async def _copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` in paced pieces (the caller skips it when they are the same
        memory)."""
        if dst.size:
            def work(i: int, j: int) -> None:
                dst[i:j] = src[i:j]

            await paced(self._pace, ("copy", self._dtype.itemsize), dst.size,
                        self._dtype.itemsize, work)

    async def _combine(self, out: Any, operands: list[Any], op: ReduceOp, aliased: int
                       ) -> None:
        """``out`` = ``operands`` combined under ``op`` in rank order, in paced pieces
        (about 0.2 ms each, learnt per dtype, op and rank count: on NumPy's own loops a
        float16 sum is 70x slower than a float32 one). ``out`` may be operand ``aliased``
        (in place; -1: none): the caller knows which from its arrays' addresses (slices'
        addresses cost microseconds each to learn)."""
        n, dtype = len(operands), self._dtype
        ufunc, avg = combiner(ReduceOp.SUM if op == ReduceOp.AVG else op, dtype), op == ReduceOp.AVG
        mine = aliased if aliased >= 2 else -1  # (out= of the first ufunc may be 0 or 1)

        def work(i: int, j: int) -> None:
            o = out[i:j]
            parts = [x[i:j] for x in operands]
            if mine >= 0:  # (combining the first two would overwrite it first)
                saved = self.lane.scratch(o.nbytes)[:o.nbytes].view(dtype)
                np.copyto(saved, parts[mine])
                parts[mine] = saved
            ufunc(parts[0], parts[1], out=o)
            for part in parts[2:]:
                ufunc(o, part, out=o)
            if avg:
                finish_avg(o, n)

        await paced(self._pace, ("zero-copy", dtype, op, n), out.size, dtype.itemsize, work)


class ZeroCopyAllReduce(_ZeroCopy):
    """all_reduce, zero-copy (see :class:`_ZeroCopy`), in two phases:

    1. rank ``r`` combines part ``r`` of the result from every rank's send buffer, in rank
       order (the bits of the lane's other plans), into its own receive buffer;
    2. it copies part ``k`` from rank ``k``'s receive buffer, for every peer ``k``, once
       rank ``k`` finished phase 1; it returns once every rank finished phase 2.

    In place (send is receive), a rank writes only part ``r`` in phase 1, which nobody
    else reads then, and part ``k`` in phase 2, once its only reader (rank ``k``, in
    phase 1) finished phase 1."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, dtype: Any, count: int,
                 op: ReduceOp, fallback: AllReducePlan | StepPlan) -> None:
        super().__init__(comm, lane, desc, dtype, count, count, lambda: fallback)
        self.op = op
        self._parts = _split(0, count, lane.size)
        rank, n = lane.rank, lane.size
        #: the peers whose parts phase 2 copies, in the order it prefers
        self._order = [(rank + i) % n for i in range(1, n)]

    async def _zero_copy(self, seq: int, ctx: Any, sends: list[Any], recvs: list[Any]
                         ) -> None:
        rank, res = self.lane.rank, recvs[self.lane.rank]
        a, b = self._parts[rank]
        in_place = sends[rank] is res or (data_address(sends[rank]) == data_address(res))
        await self._combine(res[a:b], [x[a:b] for x in sends], self.op,
                            rank if in_place else -1)
        # Part k is copied as soon as rank k finished phase 1, not once every rank did,
        # starting with the next rank's, so that the ranks do not all read one peer's
        # memory at once.
        self.lane.boards[rank].set_phase(((seq + 1) << 2) + 1)  # type: ignore[index]
        left = self._order
        while left:
            ready = await self._reached(seq, ctx, 1, left)
            for k in ready:
                c, d = self._parts[k]  # (a peer's buffer is never this rank's memory)
                await self._copy(res[c:d], recvs[k][c:d])
            left = [k for k in left if k not in ready]
        await self._phase(seq, ctx, 2)


class ZeroCopyReduceScatter(_ZeroCopy):
    """reduce_scatter, zero-copy (see :class:`_ZeroCopy`): rank ``r`` combines block
    ``r`` of every rank's send buffer, in rank order, into its receive buffer (which may
    be its own block ``r``: nobody else reads that one), then waits for every rank to
    finish reading."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, dtype: Any, count: int,
                 op: ReduceOp, fallback: Callable[[], _LaneCall | StepPlan]) -> None:
        super().__init__(comm, lane, desc, dtype, count * lane.size, count, fallback)
        self.op, self._count = op, count

    async def _zero_copy(self, seq: int, ctx: Any, sends: list[Any], recvs: list[Any]
                         ) -> None:
        rank, c = self.lane.rank, self._count
        res, mine = recvs[rank], sends[rank]
        in_place = data_address(res) == data_address(mine) + rank * c * self._dtype.itemsize
        await self._combine(res, [x[rank * c:(rank + 1) * c] for x in sends], self.op,
                            rank if in_place else -1)
        await self._phase(seq, ctx, 1)


class ZeroCopyAllGather(_ZeroCopy):
    """all_gather, zero-copy (see :class:`_ZeroCopy`), on bytes: every rank copies every
    rank's send buffer into its block of its own receive buffer, starting with the next
    rank's (so that ranks do not all read one peer at once; in place, its own block is its
    send buffer, which it leaves), then waits for every rank to finish reading."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, nbytes: int,
                 fallback: Callable[[], _LaneCall | StepPlan]) -> None:
        super().__init__(comm, lane, desc, np.uint8, nbytes, nbytes * lane.size, fallback)
        self._block = nbytes

    async def _zero_copy(self, seq: int, ctx: Any, sends: list[Any], recvs: list[Any]
                         ) -> None:
        lane, b = self.lane, self._block
        rank, n = lane.rank, lane.size
        res = recvs[rank]
        for k in [(rank + i) % n for i in range(1, n)]:  # (peers in turn, then mine)
            await self._copy(res[k * b:(k + 1) * b], sends[k])
        if data_address(res) + rank * b != data_address(sends[rank]):  # (else in place)
            await self._copy(res[rank * b:(rank + 1) * b], sends[rank])
        await self._phase(seq, ctx, 1)


class ZeroCopyBroadcast(_ZeroCopy):
    """broadcast, zero-copy (see :class:`_ZeroCopy`), on bytes: every rank but the root
    copies the root's buffer into its own, then every rank waits for the others to
    finish (the root, for every reader)."""

    def __init__(self, comm: Any, lane: Lane, desc: Descriptor, nbytes: int, root: int,
                 fallback: Callable[[], _LaneCall | StepPlan]) -> None:
        super().__init__(comm, lane, desc, np.uint8, nbytes, nbytes, fallback)
        self._root = root

    async def _zero_copy(self, seq: int, ctx: Any, sends: list[Any], recvs: list[Any]
                         ) -> None:
        if self.lane.rank != self._root:
            await self._copy(recvs[self.lane.rank], sends[self._root])
        await self._phase(seq, ctx, 1)
