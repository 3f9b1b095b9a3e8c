"""What every algorithm runs on: the op context, descriptors, and split arithmetic."""

from __future__ import annotations

import asyncio
import enum
import functools
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from .._dtypes import DTYPE_BY_CODE, DTYPE_NAMES, ReduceOp
from .._memory import BYTE, Buffer, DType, MemorySpace
from .._transport.base import Connection, ConnectionLost, MessageSizeError
from ..errors import AcollError, InvalidUsage, RemoteError

__all__ = ["ANY_SEQ", "STEP_NS", "Coll", "Descriptor", "OpContext", "OpHost", "chunk_ranges",
           "split_even"]

#: The bound on one step of an op's coroutine: after this much time (ns) since it last
#: slept it yields to the loop at the next checkpoint (each wait, between the pieces of a
#: reduction or copy, between posts of many chunks). With the one unit of work that may
#: follow the last check (a reduction piece of at most 512 KiB, or a poll or flush of at
#: most 0.2 ms and one more socket call), a step stays around 1 ms of CPU on host buffers.
STEP_NS = 250_000


class Coll(enum.IntEnum):
    """Operation kinds, as carried in descriptors."""

    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    REDUCE_SCATTER = 5
    ALL_TO_ALL = 6
    BARRIER = 7
    SEND_RECV = 8
    CLOSE = 9  # the barrier inside close()
    SPLIT = 10  # the barrier that puts split() in the call order
    REGISTER = 11  # ... register()
    DEREGISTER = 12  # ... deregister()


#: The send/recv stamp of calls made inside a group: matches any stamp (not order-checked).
ANY_SEQ = 0xFFFFFFFF

#: Names of the algorithm codes carried in descriptors (0: the collective has one).
ALGO_NAMES = {0: "default", 1: "ring", 2: "rd", 3: "tree", 4: "chain", 5: "direct", 6: "hd"}


_DESC = struct.Struct("<BBBBIQ")


class Descriptor:
    """What one rank believes an operation is: kind, dtype, op, root, count, algorithm.

    Packed into the 16-byte ``meta`` of every message, so a receiver can tell when its
    peer is running a different operation and say exactly which field differs. For
    send/recv, ``root`` holds the sender's (receiver's) collective sequence number when
    the call was issued, so that a send and a recv issued at different places in the two
    ranks' call orders are reported instead of waiting.
    """

    __slots__ = ("algo", "coll", "count", "dtype_code", "op", "packed", "root")

    def __init__(self, coll: Coll, dtype_code: int, op: int, root: int, count: int,
                 algo: int = 0) -> None:
        self.coll, self.dtype_code, self.op, self.root, self.count, self.algo = (
            coll, dtype_code, op, root, count, algo)
        self.packed = _DESC.pack(coll, dtype_code, op, algo, root & 0xFFFFFFFF, count)

    @classmethod
    def unpack(cls, raw: bytes) -> Descriptor:
        coll, dt, op, algo, root, count = _DESC.unpack(raw)
        return cls(Coll(coll) if coll in Coll._value2member_map_ else Coll.BARRIER,
                   dt, op, root, count, algo)

    def matches(self, meta: bytes) -> bool:
        """Whether a peer's ``meta`` describes the same operation (send/recv stamps made
        inside a group match any stamp)."""
        if meta == self.packed:
            return True
        if self.coll != Coll.SEND_RECV:
            return False
        other = Descriptor.unpack(meta)
        return (other.coll == Coll.SEND_RECV and ANY_SEQ in (self.root, other.root)
                and (other.dtype_code, other.count) == (self.dtype_code, self.count))

    def describe_difference(self, other: Descriptor, me: int, peer: int) -> str:
        """A message naming each field where ``other`` (from ``peer``) differs."""
        if Coll.CLOSE in (self.coll, other.coll) and self.coll != other.coll:
            closer, busy, op = ((me, peer, other.coll) if self.coll == Coll.CLOSE
                                else (peer, me, self.coll))
            return (f"rank {closer} closed the communicator while rank {busy} was in "
                    f"{op.name.lower()}")
        exchanges = (Coll.SPLIT, Coll.REGISTER, Coll.DEREGISTER)
        if self.coll != other.coll and (self.coll in exchanges or other.coll in exchanges):
            return (f"rank {me} is in {_call_name(self.coll)} while rank {peer} is in "
                    f"{_call_name(other.coll)}: the ranks issued their calls in different "
                    "orders")
        if Coll.SEND_RECV in (self.coll, other.coll) and self.coll != other.coll:
            p2p, coll = (me, other) if self.coll == Coll.SEND_RECV else (peer, self)
            other_rank = peer if p2p == me else me
            return (f"rank {p2p} is in send/recv while rank {other_rank} is in "
                    f"{coll.coll.name.lower()}: the ranks issued their calls in different "
                    "orders")
        diffs = []
        if self.coll != other.coll:
            diffs.append(f"operation {self.coll.name.lower()} vs {other.coll.name.lower()}")
        if self.count != other.count:
            diffs.append(f"count {self.count} vs {other.count}")
        if self.dtype_code != other.dtype_code:
            mine = DTYPE_NAMES.get(DTYPE_BY_CODE.get(self.dtype_code), "?")  # type: ignore[arg-type]
            theirs = DTYPE_NAMES.get(DTYPE_BY_CODE.get(other.dtype_code), "?")  # type: ignore[arg-type]
            diffs.append(f"dtype {mine} vs {theirs}")
        if self.op != other.op:
            diffs.append(f"op {_op_name(self.op)} vs {_op_name(other.op)}")
        if self.root != other.root:
            what = "issued after collective #" if self.coll == Coll.SEND_RECV else "root "
            diffs.append(f"{what}{self.root} vs {other.root}")
        if self.algo != other.algo and not diffs:
            diffs.append(f"algorithm {ALGO_NAMES.get(self.algo, self.algo)} vs "
                         f"{ALGO_NAMES.get(other.algo, other.algo)} (do ACOLL_ALGO and "
                         "ACOLL_SMALL_MSG differ between the ranks?)")
        what = ", ".join(diffs) or "sequence"
        return (f"{self.coll.name.lower()} mismatch between rank {me} and rank {peer}: "
                f"{what}")


def _call_name(coll: Coll) -> str:
    name = coll.name.lower()
    return f"{name}()" if coll in (Coll.SPLIT, Coll.REGISTER, Coll.DEREGISTER) else name


def _op_name(op: int) -> str:
    try:
        return ReduceOp(op).name
    except ValueError:
        return str(op)


def split_even(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` items into ``parts`` (start, length) ranges differing by at most 1.

    The first ``count % parts`` ranges are one longer; ranges may be empty.
    """
    base, extra = divmod(count, parts)
    out = []
    start = 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


def chunk_ranges(start: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """Cut ``[start, start + length)`` into consecutive pieces of at most ``chunk`` items.

    Zero length gives no pieces.
    """
    chunk = max(1, chunk)
    return [(s, min(chunk, start + length - s)) for s in range(start, start + length, chunk)]


class OpHost(Protocol):
    """What an operation needs from its communicator (and all it may use of it).

    Attributes:
        rank / size: this rank and the number of ranks.
        check: descriptor checks are on.
        chunk_bytes: pipeline chunk size (the smallest, for rings).
        ring_chunks: most chunks a ring cuts a segment into (0: no limit).
        ring_chunk_max: largest chunk (bytes) ``ring_chunks`` may grow a ring's chunks to.
        hd_chunks: most chunks the halving-doubling all-reduce cuts a block into.
        small: ops up to this many bytes are latency-bound (busy-poll, small algorithms).
        spin_ns: per peer, how long a wait may busy-poll before sleeping (0: never).
        mem: the memory space of the communicator's buffers.
    """

    rank: int
    size: int
    check: bool
    chunk_bytes: int
    ring_chunks: int
    ring_chunk_max: int
    hd_chunks: int
    small: int
    spin_ns: list[int]
    mem: MemorySpace

    async def connection(self, peer: int) -> Connection:
        """The connection to ``peer`` (made on first use)."""

    def fail(self, error: AcollError) -> None:
        """Fail the communicator on every rank with ``error``."""

    def peer_error(self, peer: int, exc: ConnectionLost) -> AcollError:
        """The error to raise for a connection to ``peer`` that ended (fails the comm)."""


class OpContext:
    """One collective's view of the communicator: tags, connections, checks, memory.

    Set-up calls :meth:`connect` for every peer it will talk to; the data loop then uses
    the synchronous :meth:`post_send` / :meth:`post_recv` and awaits :meth:`wait_send` /
    :meth:`wait_recv`, which check the peer's descriptor and name failing peers. Memory
    work goes through :meth:`reduce`, :meth:`avg`, :meth:`copy` and :meth:`scratch` (the
    communicator's :class:`~acoll._memory.MemorySpace`), paced by the step bound.
    """

    __slots__ = ("agree_on", "check", "check_at", "check_gap", "chunk_bytes", "conns",
                 "deadline", "desc", "followed", "grace_used", "hd_chunks", "heard", "host",
                 "in_group", "looked_again", "mem", "n", "probed", "probed_held", "rank",
                 "ring_chunk_max", "ring_chunks", "seq", "spin", "stage", "tag_base",
                 "waiting_on", "yield_at")

    def __init__(self, host: OpHost, seq: int, desc: Descriptor, in_group: bool,
                 tag_base: int) -> None:
        self.host = host
        self.rank = host.rank
        self.n = host.size
        self.mem = host.mem
        self.chunk_bytes = host.chunk_bytes
        self.ring_chunks = host.ring_chunks
        self.ring_chunk_max = host.ring_chunk_max
        self.hd_chunks = host.hd_chunks
        self.seq = seq
        self.desc = desc
        self.check = host.check
        self.in_group = in_group
        self.tag_base = tag_base
        self.conns: dict[int, Connection] = {}
        self.waiting_on: int | None = None  # the peer the op waits for now
        self.agree_on: int | None = None  # the peer its agreement exchange waits for now
        self.heard: set[int] = set()  # peers from which a message of this op arrived
        self.grace_used = False
        #: its deadline passed while it waited for no peer (running): judged a grace later
        self.looked_again = False
        #: what the peers asked when it timed out said (acoll._comm.probe): peer -> the
        #: rank that peer waits for (-1: not known); empty until then
        self.probed: dict[int, int] = {}
        #: the asked peers that had not made the call, held in an earlier one
        self.probed_held: set[int] = set()
        self.followed = False  #: the chain of waits behind a named peer was followed
        self.deadline = float("inf")  # loop time at which the executor fails it
        #: loop time of its next descriptor check (acoll._comm.probe), and the gap after it
        self.check_at = float("inf")
        self.check_gap = 0.0
        #: copies pipelined with the algorithm (a device op run on a host copy: see
        #: acoll._comm.via_host.RingStaging); algorithms that support it call
        #: ``await stage.ready(start, count)`` before first reading those elements of
        #: their input and ``stage.final(start, count)`` once those elements of their
        #: output hold the result (offsets from the buffers' start: input and output
        #: are one host copy there)
        self.stage: Any = None
        # Busy-polling pays only for latency-bound (small) ops.
        dtype = DTYPE_BY_CODE.get(desc.dtype_code)
        nbytes = desc.count * (dtype.itemsize if dtype is not None else 1)
        self.spin: list[int] | None = host.spin_ns if nbytes <= host.small else None
        self.yield_at = time.perf_counter_ns() + STEP_NS

    def due(self) -> bool:
        """True once this step has run for ``STEP_NS``: the caller should ``pause()``."""
        return time.perf_counter_ns() >= self.yield_at

    async def pause(self) -> None:
        """Yield to the event loop for one iteration (other tasks and callbacks run)."""
        await asyncio.sleep(0)
        self.yield_at = time.perf_counter_ns() + STEP_NS

    async def checkpoint(self) -> None:
        """Yield to the loop if this step is due (see :data:`STEP_NS`); else return at once."""
        if time.perf_counter_ns() >= self.yield_at:
            await self.pause()

    async def connect(self, *peers: int) -> None:
        """Make (or reuse) the connections to ``peers``, in order. A connection still
        being made is what the op waits for (a timeout names that peer)."""
        for peer in peers:
            if peer != self.rank and peer not in self.conns:
                self.waiting_on = peer
                self.conns[peer] = await self.host.connection(peer)
                self.waiting_on = None

    async def connect_each(self, peers: Sequence[int], ready: Callable[[int], None]) -> None:
        """Make the connections to ``peers`` at once, calling ``ready(peer)`` as each one
        is there, in whatever order they come (a rank dials the peers above it and waits
        for the others to dial: one peer that has not started the op delays nothing for
        the rest). A timeout meanwhile names the first of ``peers`` still missing."""
        waits: dict[asyncio.Future[Connection], int] = {}
        for peer in peers:
            if peer == self.rank:
                continue
            if peer in self.conns:
                ready(peer)
                continue
            task: asyncio.Future[Connection] = asyncio.ensure_future(
                self.host.connection(peer))
            # (left running if this op ends first: the connection is the communicator's;
            # a failure is the communicator's too, reported through its own path)
            task.add_done_callback(consume)
            waits[task] = peer
        try:
            while waits:
                self.waiting_on = next(iter(waits.values()))
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for fut in [t for t in waits if t in done]:  # (in the order of peers)
                    peer = waits.pop(fut)
                    self.conns[peer] = fut.result()
                    ready(peer)
        finally:
            self.waiting_on = None

    def post_send(self, peer: int, buf: Buffer, step: int) -> asyncio.Future[None]:
        return self.conns[peer].isend(buf, self.tag_base | step, self.desc.packed)

    def post_recv(self, peer: int, buf: Buffer, step: int) -> asyncio.Future[bytes]:
        fut = self.conns[peer].irecv(buf, self.tag_base | step)
        # Checked as soon as it completes, not only when (if ever) the algorithm awaits it:
        # a mismatch on any posted receive fails the op on every rank at once.
        fut.add_done_callback(functools.partial(self._recv_done, peer))
        return fut

    def _recv_done(self, peer: int, fut: asyncio.Future[bytes]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self.heard.add(peer)
        if isinstance(exc, MessageSizeError):
            self.host.fail(self._size_error(peer, exc))
        elif exc is None and self.check and not self.desc.matches(fut.result()):
            other = Descriptor.unpack(fut.result())
            self.host.fail(InvalidUsage(self.desc.describe_difference(other, self.rank,
                                                                      peer)))

    def _size_error(self, peer: int, exc: MessageSizeError) -> InvalidUsage:
        other = Descriptor.unpack(exc.meta)
        if other.packed != self.desc.packed:
            return InvalidUsage(self.desc.describe_difference(other, self.rank, peer))
        return InvalidUsage(f"{self.desc.coll.name.lower()}: rank {peer} sent {exc.got} "
                            f"bytes where rank {self.rank} expected {exc.expected}")

    def progress(self, fut: asyncio.Future[Any], peer: int) -> None:
        """Try to complete ``fut`` (a receive from ``peer``) before the caller sleeps."""
        if fut.done():
            return
        conn = self.conns[peer]
        conn.poll()  # the data may be there already: skip the poller
        spin = self.spin[peer] if self.spin else 0
        if spin and not fut.done():
            # Peer in another process on an idle core: its answer usually comes within
            # tens of microseconds, less than an idle CPU takes to wake from the poller.
            end = time.perf_counter_ns() + spin
            while not fut.done() and time.perf_counter_ns() < end:
                conn.poll()

    async def wait_recv(self, fut: asyncio.Future[bytes], peer: int) -> None:
        """Wait for a receive; check the sender's descriptor.

        The step bound is checked first: when due, yield before looking for the data (the
        loop's reader may complete it meanwhile). A receive then completed without
        sleeping lets the caller go straight on to reduce and send the result, which the
        peer waits for: a yield there would delay the whole pipeline.
        """
        if time.perf_counter_ns() >= self.yield_at:
            await self.pause()
        self.progress(fut, peer)
        self.waiting_on = peer
        slept = not fut.done()
        try:
            meta = await fut
        except MessageSizeError as exc:
            raise self._size_error(peer, exc) from None
        except ConnectionLost as exc:
            raise self.host.peer_error(peer, exc) from None
        self.waiting_on = None
        if self.check and not self.desc.matches(meta):
            other = Descriptor.unpack(meta)
            raise InvalidUsage(self.desc.describe_difference(other, self.rank, peer))
        if slept:
            self.yield_at = time.perf_counter_ns() + STEP_NS

    async def wait_send(self, fut: Awaitable[None], peer: int) -> None:
        """Wait for a send to complete (with the same step bound as :meth:`wait_recv`)."""
        self.waiting_on = peer
        slept = isinstance(fut, asyncio.Future) and not fut.done()
        try:
            await fut
        except ConnectionLost as exc:
            raise self.host.peer_error(peer, exc) from None
        self.waiting_on = None
        if slept:
            self.yield_at = time.perf_counter_ns() + STEP_NS
        elif time.perf_counter_ns() >= self.yield_at:
            await self.pause()

    async def wait_sends(self, sends: list[tuple[asyncio.Future[None], int]]) -> None:
        for fut, peer in sends:
            await self.wait_send(fut, peer)

    def scratch(self, count: int, dtype: DType, slot: int = 0) -> Buffer:
        """Work memory for ``count`` items; pooled between ops unless inside a group (ops
        of a group run at once, so each gets its own)."""
        if self.in_group:
            return self.mem.empty(count, dtype)
        return self.mem.scratch(count, dtype, slot)

    def empty(self) -> Buffer:
        """A zero-length buffer (for messages that only signal)."""
        return self.mem.scratch(0, BYTE, slot=-1)

    async def reduce(self, out: Buffer, a: Buffer, b: Buffer, op: ReduceOp) -> None:
        """``out = a (op) b``, in paced pieces."""
        await self.mem.reduce(out, a, b, op, self.checkpoint)

    async def avg(self, buf: Buffer) -> None:
        """Finish an AVG: divide the sum in ``buf`` by the number of ranks."""
        await self.mem.finish_avg(buf, self.n, self.checkpoint)

    async def copy(self, dst: Buffer, src: Buffer) -> None:
        """``dst = src``, in paced pieces."""
        await self.mem.copy(dst, src, self.checkpoint)

    def post_recvs(self, peer: int, pieces: list[Buffer], first_step: int
                   ) -> list[asyncio.Future[bytes]]:
        """Post a receive for each of ``pieces``, steps ``first_step, first_step + 1, ...``
        (all at once: use :meth:`post_recvs_paced` for many)."""
        return [self.post_recv(peer, piece, first_step + i) for i, piece in enumerate(pieces)]

    async def post_recvs_paced(self, peer: int, pieces: list[Buffer], steps: list[int]
                               ) -> list[asyncio.Future[bytes]]:
        """Post a receive per piece under the matching step, yielding when the step is due."""
        futs = []
        for piece, step in zip(pieces, steps, strict=True):
            futs.append(self.post_recv(peer, piece, step))
            if self.due():
                await self.pause()
        return futs


AlgoFn = Callable[[OpContext], Awaitable[None]]


def consume(task: asyncio.Future[Any]) -> None:
    """A done callback that marks a future's exception retrieved (an abandoned future
    that failed must not log)."""
    if not task.cancelled():
        task.exception()


def remote(peer: int, message: str) -> RemoteError:
    return RemoteError(message, peer)
