"""The lane: small collectives between processes of one host, through shared mailboxes.

When every rank of a host-memory communicator is on one host, in its own process, with a
core each, and every rank's shared-memory transport offers mailboxes
(``ACOLL_SHM_LANE_MAX``), collectives whose payload per peer fits a mailbox skip messages
altogether. Each rank copies its contribution into its mailbox towards every peer
(:mod:`acoll._transport.shmlane`), then busy-polls the peers' mailboxes towards it and
computes its result straight from them: one copy in, one pass out, no record, no
matching, no future and no wake-up on the way. An all_reduce combines the contributions
in rank order on every rank, so every rank gets the same bits.

- Who uses it is decided from the formation records alone (:func:`lane_size`), so every
  rank agrees; which calls use it depends only on the call (its kind and size), so every
  rank takes the same path for the same call.
- Waiting: a busy-poll of the communicator's spin budget without yielding, then polls
  between loop iterations (``asyncio.sleep(0)``) for ``_YIELD_POLL_S``, then polls every
  ``_SLEEP_S``: the loop keeps running, and a peer that is late by more than a couple of
  milliseconds costs little CPU. Ops that find every peer ready complete without
  sleeping; a run of them yields to the loop once per ``STEP_NS`` (0.25 ms), as every op
  step does.
- Disagreements are found on every rank: each lane op publishes its descriptor with its
  data, and an op that runs off the lane announces its number and descriptor in the
  mailboxes, so a rank waiting in the lane sees at once that a peer called something else.
- Failures: the communicator's failure (a peer's death seen by its shared-memory
  connection, an abort, a timeout) ends every wait; a wait has the communicator's
  deadline of its own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._coll.base import STEP_NS, Coll, Descriptor
from .._dtypes import ReduceOp, finish_avg, ufunc_of
from .._memory import Buffer
from .._transport.base import Connection, PeerInfo
from .._transport.shmlane import Inbox, Outbox, head, head_length
from ..errors import AcollError, InvalidUsage, ProtocolError, TransportError
from ..errors import TimeoutError as AcollTimeoutError

__all__ = ["Lane", "LanePlan", "lane_size"]

_YIELD_POLL_S = 2e-3
_SLEEP_S = 5e-4


def lane_size(infos: Sequence[PeerInfo], host_memory: bool) -> int:
    """The payload bytes per peer the communicator of ``infos`` runs through the lane;
    0 when it has no lane (see the module docstring). Every rank computes the same."""
    from .._transport import shm

    n = len(infos)
    if not host_memory or n < 2 or n > (os.cpu_count() or 1) or shm.unsupported():
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


def _unwrap(conn: Connection) -> Any:
    while hasattr(conn, "inner"):
        conn = conn.inner
    return conn


class Lane:
    """One communicator's lane: its mailboxes to every peer, set up on first use."""

    def __init__(self, rank: int, size: int, limit: int) -> None:
        self.rank = rank
        self.size = size
        self.limit = limit
        self.peers = [p for p in range(size) if p != rank]
        self.outboxes: list[Outbox] = []
        self.inboxes: list[Inbox | None] = []  # by rank (None: this rank)
        #: when a run of lane ops that never slept next yields to the loop (STEP_NS)
        self.yield_at = 0
        #: op numbers of the lane ops that have not published yet, in the order they
        #: started: they publish in that order, so that two ops waiting for one slot (op
        #: ``s`` and ``s + 2`` of a group) take it in turn
        self.turns: deque[int] = deque()

    @property
    def ready(self) -> bool:
        return bool(self.outboxes)

    async def setup(self, comm: Any) -> None:
        """Connect to every peer and take the mailboxes of each connection.

        Raises:
            TransportError: a connection has no mailbox (the ranks disagree on the lane).
        """
        outs: list[Outbox] = []
        ins: list[Inbox | None] = [None] * self.size
        for peer in self.peers:
            conn = _unwrap(await comm.connection(peer))
            out, inbox = getattr(conn, "outbox", None), getattr(conn, "inbox", None)
            if out is None or inbox is None or out.lane < self.limit:
                raise TransportError(f"rank {self.rank}: the connection to rank {peer} has "
                                     "no shared-memory mailbox for the lane")
            outs.append(out)
            ins[peer] = inbox
        if not self.outboxes:
            self.outboxes, self.inboxes = outs, ins

    def announce(self, seq: int, desc: Descriptor) -> None:
        """Op ``seq`` runs off the lane (called by the executor for every op it runs)."""
        for out in self.outboxes:
            out.announce(seq, desc.packed)


class LanePlan:
    """One collective call's moves through the lane, worked out once (see the module
    docstring); :meth:`run` it for each op number. A plan may be kept and run again for
    the same buffers (the communicator does so for repeated all_reduce calls).

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
        self.writes: list[tuple[Outbox, int, memoryview | None, list[memoryview], bytes]] = []
        for i, peer in enumerate(lane.peers):
            out = lane.outboxes[i]
            src = to(peer)
            size = 0 if src is None else src.nbytes
            dst = [out.payload(slot, size) for slot in (0, 1)] if size else []
            self.writes.append((out, peer, src if size else None, dst, head(packed, size)))
        self.reads: list[tuple[int, Inbox, bytes, int]] = []
        for peer in lane.peers:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            size = length_from(peer)
            self.reads.append((peer, inbox, head(packed, size), size))
        self.inboxes = [inbox for _, inbox, _, _ in self.reads]
        self._finish = self._result(send, recv, op, root, chunk)

    def _result(self, send: Buffer | None, recv: Buffer | None, op: ReduceOp, root: int,
                chunk: int) -> Callable[[int], None]:
        """The step that makes this rank's result from the mailboxes of slot ``slot``."""
        coll, lane = self.desc.coll, self.lane
        rank, n = lane.rank, lane.size
        sizes = {peer: size for peer, _, _, size in self.reads}

        def incoming(peer: int) -> list[memoryview]:
            inbox = lane.inboxes[peer]
            assert inbox is not None
            return [inbox.payload(slot, sizes[peer]) for slot in (0, 1)]

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
        dtype = res.dtype
        mine = send.array
        if coll == Coll.REDUCE_SCATTER:
            mine = mine[rank * res.size:(rank + 1) * res.size]
        keep = rank >= 2 and bool(np.may_share_memory(res, mine))
        if keep:  # the first combinations would overwrite this rank's input before its turn
            saved = np.empty_like(mine)
            ours = [saved, saved]
        else:
            ours = [mine, mine]
        parts = [ours if k == rank else [np.frombuffer(v, dtype) for v in incoming(k)]
                 for k in range(n)]
        ufunc = ufunc_of(ReduceOp.SUM if op == ReduceOp.AVG else op)
        avg = op == ReduceOp.AVG
        first, second, rest = parts[0], parts[1], parts[2:]

        def combine(slot: int) -> None:
            if keep:
                np.copyto(saved, mine)
            ufunc(first[slot], second[slot], out=res)
            for part in rest:
                ufunc(res, part[slot], out=res)
            if avg:
                finish_avg(res, n)

        return combine

    async def run(self, seq: int) -> None:
        """Run the call as op number ``seq``: publish, wait for every peer, combine, give
        the peers' slots back."""
        lane = self.lane
        turns = lane.turns
        turns.append(seq)  # (before any await: ops publish in the order they start)
        try:
            if turns[0] != seq or time.perf_counter_ns() >= lane.yield_at:
                # Another lane op (of a group, or of another task) publishes first; and
                # ops that all find their peers ready never sleep: bound the loop's step.
                await self._turn(seq)
            slot = seq & 1
            for out, peer, src, dst, top in self.writes:
                if not out.free(seq):
                    await self._wait_free(out, peer, seq)
                if src is not None:
                    dst[slot][:] = src
                out.publish(seq, top)
        finally:
            turns.remove(seq)
        for inbox in self.inboxes:
            if not inbox.arrived(seq):
                await self._wait(seq)
                break
        for peer, inbox, expect, _size in self.reads:
            got = inbox.head(seq)
            if got != expect:
                raise self._disagree(peer, got, expect)
        self._finish(slot)
        for inbox in self.inboxes:
            inbox.ack(seq)

    def _disagree(self, peer: int, got: bytes, expect: bytes) -> AcollError:
        if got[:16] != expect[:16]:
            return InvalidUsage(self.desc.describe_difference(Descriptor.unpack(got[:16]),
                                                              self.lane.rank, peer))
        return ProtocolError(f"lane: rank {peer} published {head_length(got)} bytes for "
                             f"{self.desc.coll.name.lower()}, {head_length(expect)} were "
                             "expected")

    async def _wait(self, seq: int) -> None:
        """Until every peer published op ``seq`` (see the module doc)."""
        comm = self.comm
        pending = [peer for peer, inbox, _, _ in self.reads if not inbox.arrived(seq)]
        if not pending:
            return
        spin = comm.spin_ns[pending[0]]
        if spin:
            end = time.perf_counter_ns() + spin
            while time.perf_counter_ns() < end:
                pending = [p for p in pending
                           if not self.lane.inboxes[p].arrived(seq)]  # type: ignore[union-attr]
                if not pending:
                    return
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + comm.timeout
        while True:
            self._check_announced(seq, pending)
            now = loop.time()
            if now >= deadline:
                raise self._timed_out(seq, pending)
            await asyncio.sleep(0 if now - start < _YIELD_POLL_S else _SLEEP_S)
            self.lane.yield_at = time.perf_counter_ns() + STEP_NS
            comm.check_usable()
            pending = [p for p in pending
                       if not self.lane.inboxes[p].arrived(seq)]  # type: ignore[union-attr]
            if not pending:
                return

    async def _turn(self, seq: int) -> None:
        """Yield to the loop, then until the lane ops started before this one published."""
        lane, comm = self.lane, self.comm
        loop = asyncio.get_running_loop()
        deadline = loop.time() + comm.timeout
        while True:
            await asyncio.sleep(0)
            lane.yield_at = time.perf_counter_ns() + STEP_NS
            comm.check_usable()
            if lane.turns[0] == seq:
                return
            if loop.time() >= deadline:
                raise AcollTimeoutError(f"{self.desc.coll.name.lower()} #{seq} waited "
                                        f"{comm.timeout:g} s for earlier lane ops on rank "
                                        f"{lane.rank}")

    async def _wait_free(self, out: Outbox, peer: int, seq: int) -> None:
        """Until ``peer`` read what this rank last wrote in the slot op ``seq`` needs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.comm.timeout
        while not out.free(seq):
            if loop.time() >= deadline:
                raise self._timed_out(seq, [peer])
            await asyncio.sleep(0)
            self.comm.check_usable()

    def _check_announced(self, seq: int, pending: list[int]) -> None:
        for p in pending:
            got = self.lane.inboxes[p].announced(seq)  # type: ignore[union-attr]
            if got is not None and got != self.desc.packed:
                raise InvalidUsage(self.desc.describe_difference(
                    Descriptor.unpack(got), self.lane.rank, p))

    def _timed_out(self, seq: int, pending: list[int]) -> AcollError:
        name = self.desc.coll.name.lower()
        many = len(pending) > 1
        return AcollTimeoutError(
            f"{name} #{seq} did not complete within {self.comm.timeout:g} s on rank "
            f"{self.lane.rank}; it was waiting for rank{'s' if many else ''} "
            f"{', '.join(map(str, pending))}, which did not reach this call",
            None if many else pending[0])


def _nothing(slot: int) -> None:
    pass
