"""The native ring: large host-buffer ring collectives over TCP, run by C code off the loop.

Where the ring's data path is Python, every chunk costs work on the loop thread and GIL
hand-offs between it and the socket threads; with 4 to 8 ranks a host that many processes
share loses to Gloo's C++ ring there. So when

- every rank has the native ring (:mod:`acoll._native` built, ``ACOLL_NATIVE`` not 0) with
  the same version, ``ACOLL_NATIVE_MIN`` and ``ACOLL_SMALL_MSG`` (from the formation
  records: every rank decides alike), every rank serves the same transports, and every
  edge of the ring (rank i to rank i + 1) goes over the socket transport;
- and a call is an all_reduce the tuner (or ``ACOLL_ALGO``) gives to the ring, or a
  reduce_scatter or all_gather moving more than ``ACOLL_SMALL_MSG`` in all, on host
  memory, of any dtype acoll has (8/32/64-bit integers, 16-bit floats, float32, float64;
  SUM, PROD, MAX, MIN, AVG), of at least ``ACOLL_NATIVE_MIN`` bytes, made outside a group,

the whole op is one call into ``ring.c`` on a worker thread, with the GIL released: it
sends, receives and reduces over two *raw links* (authenticated TCP sockets that carry
nothing else: one dialed to the next rank, one accepted from the previous, made at the
first such call) while the loop only waits for its end. Same steps, same order of
reduction as the Python rings (:mod:`acoll._coll.algorithms`: ``RingAllReduce``,
``RingReduceScatter``, ``RingAllGather``), so the same bits; the descriptor is the same
either way. (The C code moves each step's block in pieces of its own choosing, reducing
256 KiB at a time while it is in cache and forwarding what is ready: the pieces are not
on the wire, only the bytes.)

Every call's stream starts with a 32-byte header (magic, version, the op's sequence
number and descriptor) that the receiving rank compares with its own before it
reads any data: ranks that disagree fail with :class:`InvalidUsage` naming the difference.
Failures: the communicator's timeout, probes and failure flooding work as for any op (the
op waits on its previous rank); when the communicator fails, the running call is aborted
(its sockets shut down: the C code returns within a poll slice); a peer whose link ends
is blamed after a short wait for the communicator's own report of why.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._coll.algorithms import ring_chunk_items
from .._coll.base import OpContext
from .._config import Setting, get_logger, parse_size
from .._dtypes import DTYPES, ReduceOp
from .._memory import Buffer, MemoryKind
from .._native import HEADER_SIZE, NR, NativeLib, Stage, State
from .._transport.base import PeerInfo, Transport
from .._transport.tcp import RawLink, TcpTransport
from ..errors import AcollError, ClosedError, InvalidUsage, RemoteError
from ..errors import TimeoutError as AcollTimeoutError
from .peers import PeerLinks

__all__ = ["NATIVE", "NATIVE_INLINE", "NATIVE_MIN", "NativeRing", "NativeRingAllGather",
           "NativeRingAllReduce", "NativeRingReduceScatter", "native_record", "staged_pieces"]

log = get_logger("COLL")

NATIVE = Setting("NATIVE", int, -1,
                 "The native ring for large host all_reduces over TCP (C code on a worker "
                 "thread, GIL released) and its 16-bit float loops for every host "
                 "reduction: -1 where it builds, 0 never, 1 where it builds and a "
                 "warning where it does not.", "COLL", lo=-1, hi=1)
NATIVE_MIN = Setting("NATIVE_MIN", parse_size, 0,
                     "Smallest all_reduce (bytes) the native ring takes (those the ring "
                     "gets start above ACOLL_SMALL_MSG); must be the same on every rank, "
                     "else the native ring stays off.", "COLL")
NATIVE_INLINE = Setting("NATIVE_INLINE", parse_size, 1 << 20,
                        "A native ring call sending at most this many bytes per rank runs "
                        "on its worker thread alone (one poll() for both sockets) instead "
                        "of handing sends to a helper thread; -1: always the helper. A "
                        "local choice (the bytes on the wire are the same).", "COLL")

#: dtype wire codes ring.c reduces (every one acoll has)
_NATIVE_DTYPES = frozenset(range(10))
_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3,
        ReduceOp.AVG: 4}
_HEADER = struct.Struct("<4sHHI4x")  # magic, version, 0, seq; then the descriptor
_MAGIC = b"ACNR"
#: after a raw link ended, how long to wait for the communicator to learn why (a peer's
#: failure notice travels over the ordinary connections) before blaming the link's peer
_BLAME_WAIT = 1.0
_CANCEL_WAIT = 1.0  # s: how long a cancelled op waits for its C call to stop


def native_record(lib: NativeLib | None, small: int, via_host: int | None = None
                  ) -> list[int] | None:
    """This rank's entry in its formation record (``None``: no native ring): the library's
    version, ``ACOLL_NATIVE_MIN`` and ``ACOLL_SMALL_MSG`` (``small``), which decide what
    the native ring takes; for a device communicator also ``via_host``, its
    ``ACOLL_GPU_VIA_HOST_MAX`` setting (which device all_reduces run on a host copy: the
    native ring runs those only where every rank would send them through the host)."""
    if lib is None:
        return None
    if via_host is None:
        return [lib.version, NATIVE_MIN.resolve(), small]
    return [lib.version, NATIVE_MIN.resolve(), small, via_host]


def staged_pieces(count: int, n: int, rank: int, piece: int
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A staged all-reduce's copies on rank ``rank`` of ``n`` (``ring.c``'s contract):
    ``(downloads, uploads)``, element ranges ``(start, stop)`` of ``count`` elements in
    pieces of at most ``piece`` within each of the ring's segments, downloads in the order
    the ring first reads the segments (``rank``, ``rank - 1``, ...), uploads in the order
    they become final (``rank + 1``, ``rank``, ``rank - 1``, ...). ``ring.c`` counts the
    same pieces in the same orders."""
    base, extra = divmod(count, n)

    def pieces(q: int) -> list[tuple[int, int]]:
        start = q * base + min(q, extra)
        stop = start + base + (1 if q < extra else 0)
        return [(a, min(a + piece, stop)) for a in range(start, stop, piece)]

    downloads = [p for j in range(n) for p in pieces((rank - j) % n)]
    uploads = [p for j in range(n) for p in pieces((rank + 1 - j) % n)]
    return downloads, uploads


def _header(version: int, seq: int, desc: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, version, 0, seq & 0xFFFFFFFF) + desc


class _Heard(set[int]):
    """An op's ``heard`` set (:class:`~acoll._coll.base.OpContext`) that also holds the
    previous rank once any of its data came in on the native ring (as the C code counts
    it), so that a slow op that times out does not blame a peer that was sending."""

    def __init__(self, heard: set[int], prv: int, state: State) -> None:
        super().__init__(heard)
        self._prv, self._state = prv, state

    def __contains__(self, peer: object) -> bool:
        return super().__contains__(peer) or (
            peer == self._prv and self._state.received > HEADER_SIZE)


class _Worker:
    """One daemon thread that runs blocking calls and reports to the loop."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="acoll-native",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((fn, loop, fut))
        return fut

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, loop, fut = job
            try:
                result, exc = fn(), None
            except BaseException as err:  # (reported to the waiting op)
                result, exc = None, err
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(_settle, fut, result, exc)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class NativeRing:
    """A communicator's native ring: its two raw links, worker thread and running call."""

    def __init__(self, lib: NativeLib, links: PeerLinks, rank: int, size: int,
                 min_bytes: int, small: int, timeout: float) -> None:
        self.lib = lib
        self.timeout = timeout
        self.min_bytes = min_bytes
        self.small = small
        self.inline_max = NATIVE_INLINE.resolve()
        self._links = links
        self.rank, self.size = rank, size
        self.nxt, self.prv = (rank + 1) % size, (rank - 1) % size
        self._send: RawLink | None = None
        self._recv: RawLink | None = None
        self._making: asyncio.Future[tuple[RawLink, RawLink]] | None = None
        self._worker = _Worker()
        self._state: State | None = None  # the running call's
        self._dead = False
        # Ops take turns on the links in the order they were made, which is their
        # sequence order on every rank (the executor makes ops in that order, a group's
        # too): the first waiter's future is set when the one before it is done.
        self._line: list[asyncio.Future[None]] = []

    @staticmethod
    def usable(records: list[Any], transports: Sequence[Transport], infos: Sequence[PeerInfo]
               ) -> int | None:
        """The common ``ACOLL_NATIVE_MIN`` when every rank's record offers the same native
        ring, every rank serves the same transports, and every edge of the ring (i to
        i + 1) goes over TCP; else ``None``. Every rank finds the same: the transport of
        each edge is the first both ends serve that joins them, judged from the records
        (:meth:`~acoll._transport.base.Transport.joins`), as
        :func:`~.peers.choose_transport` picks it on the edge's own ranks.

        Device communicators' records (four fields: :func:`native_record`) must agree on
        ``ACOLL_GPU_VIA_HOST_MAX`` too, and every pair of ranks, not just the ring's
        edges, must be joined over TCP: then every rank's automatic limit of device
        all_reduces through the host (``Communicator._via_limit``) is the same, and so is
        every call's choice of the native ring."""
        size = len(records)
        if size < 2 or any(not isinstance(r, list) or len(r) not in (3, 4)
                           for r in records):
            return None
        if len({tuple(int(v) for v in r) for r in records}) != 1:
            return None
        if len({frozenset(info.handles) for info in infos}) != 1:
            return None
        pairs = ([(i, (i + 1) % size) for i in range(size)] if len(records[0]) == 3 else
                 [(i, j) for i in range(size) for j in range(i + 1, size)])
        for i, j in pairs:
            a, b = infos[i], infos[j]
            edge = next((t for t in transports if t.name in a.handles
                         and t.name in b.handles and t.joins(a, b)), None)
            if not isinstance(edge, TcpTransport):
                return None
        return int(records[0][1])

    def takes(self, buf: Buffer, op: ReduceOp = ReduceOp.SUM, moved: int | None = None
              ) -> bool:
        """Whether a call on ``buf`` under ``op`` runs here (the same on every rank for a
        matching call). ``moved``: the bytes a reduce_scatter or all_gather moves in all
        (the larger of its buffers), which must exceed ``ACOLL_SMALL_MSG``; an all_reduce
        gets here only when the tuner gave it to the ring."""
        return buf.kind == MemoryKind.HOST and self.takes_copy_of(buf, op, moved)

    def takes_copy_of(self, buf: Buffer, op: ReduceOp = ReduceOp.SUM,
                      moved: int | None = None) -> bool:
        """:meth:`takes` for a host copy of ``buf`` (a device all_reduce run through the
        host: ``Communicator._via_native``), whatever memory ``buf`` is in."""
        nbytes = buf.nbytes if moved is None else moved
        return (nbytes >= self.min_bytes
                and (moved is None or moved > self.small)
                and DTYPES.get(buf.dtype) in _NATIVE_DTYPES and op in _OPS)

    async def links(self) -> tuple[RawLink, RawLink]:
        if self._send is not None and self._recv is not None:
            return self._send, self._recv
        if self._making is None:
            self._making = asyncio.ensure_future(self._make())
        making = self._making
        try:
            return await asyncio.shield(making)
        except asyncio.CancelledError:
            if making.cancelled() and self._dead:  # (aborted: not this task's cancel)
                raise ClosedError("the communicator is closed") from None
            raise

    async def _make(self) -> tuple[RawLink, RawLink]:
        made = await asyncio.gather(self._links.raw_to(self.nxt),
                                    self._links.raw_from(self.prv), return_exceptions=True)
        send, recv = made
        if self._dead or not isinstance(send, RawLink) or not isinstance(recv, RawLink):
            for link in made:  # (a link made while the other failed goes too)
                if isinstance(link, RawLink):
                    link.abort()
            for exc in made:
                if isinstance(exc, BaseException):
                    raise exc
            raise ClosedError("the communicator is closed")
        self._send, self._recv = send, recv
        return send, recv

    def join_line(self) -> asyncio.Future[None]:
        """A place in the line for the links: done when it is this op's turn."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._dead:
            fut.set_exception(ClosedError("the communicator is closed"))
            fut.exception()
        elif not self._line:
            fut.set_result(None)
        self._line.append(fut)
        return fut

    def leave_line(self, place: asyncio.Future[None]) -> None:
        """The op that held ``place`` is done (or never ran): the next one's turn."""
        first = bool(self._line) and self._line[0] is place
        with contextlib.suppress(ValueError):
            self._line.remove(place)
        if first and self._line and not self._line[0].done():
            self._line[0].set_result(None)

    def abort(self) -> None:
        """Stop the running call and end the links (the communicator failed or closed)."""
        self._dead = True
        if self._state is not None:
            self._state.abort = 1
        for link in (self._send, self._recv):
            if link is not None:
                link.abort()
        if self._making is not None and not self._making.done():
            self._making.cancel()
        for place in self._line:
            if not place.done():
                place.set_exception(ClosedError("the communicator is closed"))
                place.exception()
        self._worker.stop()

    async def run(self, ctx: OpContext, mode: int, src: Buffer, dst: Buffer,
                  scratch: Buffer | None, count: int, op: ReduceOp, chunk: int,
                  stage: Stage | None = None, started: Callable[[], None] | None = None
                  ) -> tuple[int, int, bytes]:
        """One call into ``ring.c`` on the worker thread (``stage``: a staged all-reduce's
        copy counters; ``started()``: called on the loop once the C call is on its way, as
        where the copies that wait on it are queued). Returns ``(code, side, peer header)``
        of ``NativeLib.run``; a cancel (or ``started`` raising) aborts the C call and
        waits a moment for it to stop before it propagates."""
        send, recv = await self.links()
        if self._dead:
            raise ClosedError("the communicator is closed")
        state = self._state = State()
        header = _header(self.lib.version, ctx.seq, ctx.desc.packed)
        # (a hard stop for the C code in case nothing else ends it: the executor fails
        # the op at its own deadline, which aborts the call; 0: none, for a timeout too
        # large to count in nanoseconds)
        # (from the op's own deadline: the communicator's timeout when the op started,
        # which may differ from the one it was formed with; found by review)
        left = ctx.deadline - asyncio.get_running_loop().time()
        limit = 2 * (left if math.isfinite(left) else self.timeout) + 30
        backstop = (time.monotonic_ns() + int(limit * 1e9)
                    if math.isfinite(limit) and limit < 1e9 else 0)
        ctx.heard = _Heard(ctx.heard, self.prv, state)
        args = (mode, send.fileno(), recv.fileno(), src.ptr, dst.ptr,
                0 if scratch is None else scratch.ptr, count, DTYPES[src.dtype], _OPS[op],
                self.rank, self.size, chunk, backstop, state, header, self.inline_max, stage)
        # (the buffers stay alive while the C code runs, even after a cancel)
        lib, keep = self.lib, (src, dst, scratch, stage)
        send.busy = recv.busy = True
        fut = self._worker.submit(lambda: (lib.run(*args), keep)[0])

        def returned(_: asyncio.Future[Any]) -> None:
            # (only now: a cancelled op's call may still be running until it sees abort)
            if self._state is state:
                self._state = None
            send.idle()
            recv.idle()

        fut.add_done_callback(returned)
        try:
            if started is not None:
                started()
            result: tuple[int, int, bytes] = await asyncio.shield(fut)
        except BaseException:
            # Cancelled (or ``started`` failed): the C code stops at its next check (a
            # piece, or a poll slice of 50 ms); wait for that (at most _CANCEL_WAIT), so
            # that the buffers are not written after the cancellation reached the caller.
            # Further cancels do not shorten the wait (the first one is re-raised).
            state.abort = 1
            await _outwait(fut, _CANCEL_WAIT)
            raise
        return result


async def _outwait(fut: asyncio.Future[Any], limit: float) -> None:
    """Wait up to ``limit`` seconds for ``fut``, whatever it ends with, through any number
    of cancels of the waiting task (the caller re-raises the one it is handling)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not fut.done() and (left := end - loop.time()) > 0:
        # (asyncio.wait never cancels what it waits for)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({fut}, timeout=left)


class _NativeOp:
    """A ring collective run by the native ring (see the module docstring). The raw
    links carry one op at a time: ops that run together (a group's) take turns in their
    sequence order, the same on every rank."""

    mode = NativeLib.ALL_REDUCE

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp,
                 ring: NativeRing) -> None:
        self.ctx, self.src, self.dst, self.op, self.ring = ctx, src, dst, op, ring
        self.place = ring.join_line()  # (made in sequence order: see NativeRing)
        #: a staged all-reduce's copy counters, and what queues the copies that wait on
        #: the ring once its C call is on its way (:meth:`NativeRing.run`)
        self.stage: Stage | None = None
        self.started: Callable[[], None] | None = None

    def on(self, src: Buffer, dst: Buffer) -> None:
        """Run on ``src``/``dst`` instead (before :meth:`run`): a device all_reduce takes
        its place in the line when its op starts and learns its host copy later."""
        self.src, self.dst = src, dst

    def leave(self) -> None:
        """Give up the op's place in the line (once :meth:`run` ended, or when it never
        will); repeating it does nothing."""
        self.ring.leave_line(self.place)

    def block(self) -> int:
        """Items per step's block, as ``ring.c`` counts them (all_reduce: the whole)."""
        return self.src.count

    def segment(self) -> int:
        """Items of the largest block a step moves (for the Python ring's chunk)."""
        return self.src.count

    def scratch(self) -> Buffer | None:
        return None

    async def run(self) -> None:
        ctx, ring = self.ctx, self.ring
        try:
            await self.place
            await self._run()
        except ClosedError:
            found = host_error(ctx)
            if found is not None:
                raise found from None
            raise
        finally:
            ring.leave_line(self.place)

    async def _run(self) -> None:
        ctx, ring = self.ctx, self.ring
        # (the most one send call takes: the Python ring's chunk)
        chunk = ring_chunk_items(ctx.chunk_bytes, ctx.ring_chunks, ctx.ring_chunk_max,
                                 self.src.itemsize, self.segment())
        ctx.waiting_on = ring.prv  # (a ring waits on its previous rank: probes ask it)
        try:
            code, side, peer = await ring.run(ctx, self.mode, self.src, self.dst,
                                              self.scratch(), self.block(), self.op, chunk,
                                              self.stage, self.started)
        except AcollError as exc:  # (making the links: the communicator's error first)
            found = host_error(ctx)
            if found is not None and found is not exc:
                raise found from None
            raise
        if code == NR.OK:
            ctx.heard.add(ring.prv)
            ctx.waiting_on = None
            return
        raise await self._error(code, side, peer)

    async def _error(self, code: int, side: int, peer: bytes) -> AcollError:
        ctx, ring = self.ctx, self.ring
        host = ctx.host
        if code == NR.MISMATCH:
            err = self._mismatch(peer)
            host.fail(err)
            return host_error(ctx) or err
        if code == NR.ABORTED:
            return host_error(ctx) or ClosedError("the communicator is closed")
        if code == NR.DEADLINE:
            err2: AcollError = AcollTimeoutError(
                f"{ctx.desc.coll.name.lower()}: rank {ctx.rank} waited past its deadline "
                "on the native ring "
                f"(rank {ring.prv} before it, rank {ring.nxt} after it)")
            host.fail(err2)
            return host_error(ctx) or err2
        if code in (NR.BAD_ARGS, NR.NO_MEMORY):
            err3: AcollError = AcollError(f"the native ring refused the call (code {code})")
            host.fail(err3)
            return host_error(ctx) or err3
        # A link ended: the peer died, failed or aborted. Its reason (or the loss of its
        # ordinary connection) usually reaches the communicator within moments.
        peer_rank = ring.prv if side == 1 else ring.nxt
        end = asyncio.get_running_loop().time() + _BLAME_WAIT
        while host_error(ctx) is None and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.01)
        found = host_error(ctx)
        if found is not None:
            return found
        what = "closed" if code == NR.PEER_CLOSED else "failed"
        err4 = RemoteError(f"rank {peer_rank} is gone: its native ring link {what} "
                           f"(process died, aborted, or the network failed)", peer_rank)
        host.fail(err4)
        return host_error(ctx) or err4

    def _mismatch(self, peer: bytes) -> InvalidUsage:
        from .._coll.base import Descriptor

        ctx, prv = self.ctx, self.ring.prv
        magic, version, _, seq = _HEADER.unpack(peer[:_HEADER.size])
        if magic != _MAGIC or version != self.ring.lib.version:
            return InvalidUsage(f"{ctx.desc.coll.name.lower()}: rank {prv} sent a native "
                                "ring stream this rank cannot read (different acoll "
                                "versions?)")
        try:
            other = Descriptor.unpack(peer[_HEADER.size:])
        except Exception:  # (a peer's garbled bytes: say so, never raise something else)
            return InvalidUsage(f"{ctx.desc.coll.name.lower()}: rank {prv} sent a native "
                                "ring header this rank cannot read")
        if other.packed != ctx.desc.packed:
            return InvalidUsage(ctx.desc.describe_difference(other, ctx.rank, prv))
        return InvalidUsage(f"{ctx.desc.coll.name.lower()} mismatch between rank "
                            f"{ctx.rank} and rank {prv}: collective "
                            f"#{ctx.seq & 0xFFFFFFFF} vs #{seq} (the ranks issued their "
                            "calls in different orders)")


class NativeRingAllReduce(_NativeOp):
    """:class:`~acoll._coll.algorithms.RingAllReduce` in C."""

    def segment(self) -> int:
        return -(-self.src.count // self.ctx.n)


class NativeRingReduceScatter(_NativeOp):
    """:class:`~acoll._coll.algorithms.RingReduceScatter` in C (``dst``: one block)."""

    mode = NativeLib.REDUCE_SCATTER

    def block(self) -> int:
        return self.dst.count

    def segment(self) -> int:
        return self.dst.count

    def scratch(self) -> Buffer | None:
        n = self.ctx.n
        return self.ctx.scratch(self.dst.count * (n - 2), self.src.dtype) if n > 2 else None


class NativeRingAllGather(_NativeOp):
    """:class:`~acoll._coll.algorithms.RingAllGather` in C (``src``: one block)."""

    mode = NativeLib.ALL_GATHER

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, ring: NativeRing) -> None:
        super().__init__(ctx, src, dst, ReduceOp.SUM, ring)


def host_error(ctx: OpContext) -> AcollError | None:
    """The communicator's error, if it failed (``None`` while it works)."""
    return getattr(ctx.host, "error", None)
