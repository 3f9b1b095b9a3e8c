"""Device all_reduces run by the host algorithm on a page-locked copy ("via host").

Over a transport that moves host memory only (sockets, shared memory) every byte of a
device buffer crosses host memory anyway; staging each message (copy down, send, copy
up, reduce on the GPU, copy down again...) puts a GPU round trip on every step of the
algorithm's critical path. Instead, up to ``ACOLL_GPU_VIA_HOST_MAX``, the call downloads
its input once into page-locked memory, runs the host algorithm there (NumPy reductions,
the same messages as the staged path: ranks may differ in this choice), and uploads the
result once.

- The direct path (calls made while the communicator's executor is idle: the op starts at
  the call): the copies go on the caller's stream itself, with no events between
  streams, and the download is enqueued before the executor's bookkeeping.
  :class:`DirectCall` (up to 64 KiB): through a page-locked block kept per
  (count, dtype, op) (:class:`DirectPlan`), waits that poll the stream briefly before
  yielding. :class:`DirectLarge` (larger): a pooled block.
- :class:`ViaHost` (the rest: groups, calls queued behind others, a pool that must grow):
  ordered after the caller's stream by events, on a pooled block. A direct call with
  ``stream=`` queues its upload on that stream only when its ring ends, after a call made
  on the same stream meanwhile was ordered (at its call): that call waits for the upload
  too (:meth:`~acoll._memory.DirectStaging.left_behind`).
- Where the communicator has the native ring (``ring.c``, :mod:`.native_ring`: every pair
  of ranks over TCP, the same settings everywhere) and the tuner gives the call to the
  ring, the host algorithm is the native ring: the choice is made from the call and the
  formation records alone, the same on every rank, since the native ring's bytes go over
  links of its own. Such an op takes its place in the native ring's line when it starts
  (in sequence order, as on the host) and runs on its host copy once leased
  (:meth:`NativeRingAllReduce.on`). Direct calls of 512 KiB a rank or more
  (:data:`NATIVE_PIPELINE_MIN`) pipeline their copies with the C ring through copy
  counters (:class:`NativeCopies`, ``ACOLL_GPU_VIA_HOST_COUNTERS``): downloads land piece
  by piece, each bumping a page-locked counter the ring reads before the piece, and each
  piece of the result goes up once the ring's other counter says it is final, the stream
  itself waiting on it; nothing is awaited from the loop in between. Other calls copy
  whole, each way.
- Otherwise, on the ring algorithm, above 1 MiB (:data:`PIPELINE_MIN`), the copies of both larger
  kinds are pipelined with it (:class:`RingStaging`, copies placed by :class:`CallerCopies` or
  :class:`OrderedCopies`; ``ACOLL_GPU_VIA_HOST_PIPELINE=0`` turns it off): the input
  goes down in pieces, in the order the ring first reads them, each awaited just before
  its first use; every piece of the result goes up as soon as it is final. Only the
  first piece's download and the last piece's upload are not hidden behind the network.
  The ring calls the hooks per chunk, so they take element offsets and stay a few
  microseconds: with a buffer slice and a pointer lookup per call they cost more than
  the copy time they hid (``bench/via_host_paths.py``).
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from .._coll.algorithms import RingAllReduce, _chunk_items
from .._coll.base import Descriptor, OpContext, chunk_ranges, split_even
from .._config import Setting, parse_size
from .._dtypes import ReduceOp, scale_into
from .._memory import (
    Buffer,
    CopySignals,
    DirectStaging,
    Fence,
    HostSpace,
    MemorySpace,
    SignalledStaging,
    Staging,
    StreamOrder,
)
from .._native import Stage
from .executor import Algorithm
from .native_ring import NativeRing, NativeRingAllReduce, staged_pieces

__all__ = ["STAGE_COUNTERS", "STAGE_PIECE", "CallerCopies", "DirectCall", "DirectLarge",
           "DirectPlan", "NativeCopies", "OrderedCopies", "RingStaging", "ViaHost",
           "auto_piece", "native_pipelines", "pipelines"]

#: Calls of more bytes than this pipeline their copies with the ring (when
#: ``ACOLL_GPU_VIA_HOST_PIPELINE`` is on). At 1 MiB the first piece is half the input or
#: more, so little is hidden, and one copy each way measured faster (2 and 4 ranks,
#: ``bench/results/session21_h200x2/hooks2/``, ``check2/``); from 4 MiB pipelining won.
PIPELINE_MIN = 1 << 20
#: Download pieces are this many of the algorithm's chunks (fewer copies to enqueue), and
#: an op has at most about ``MAX_PIECES`` of them; uploads join into pieces as large.
PIECE_CHUNKS = 4
MAX_PIECES = 64

def _parse_counters(text: str) -> str:
    """``ACOLL_GPU_VIA_HOST_COUNTERS``: which copies go through copy counters."""
    mode = {"0": "", "off": "", "1": "both", "on": "both"}.get(text.lower(), text.lower())
    if mode not in ("", "both", "down", "up"):
        raise ValueError("expected 0, 1, both, down or up")
    return mode


STAGE_COUNTERS = Setting("GPU_VIA_HOST_COUNTERS", _parse_counters, "both",
                         "Through the host on the native ring, pipeline the copies with it "
                         "through copy counters (cuStreamWriteValue32 / "
                         "cuStreamWaitValue32): 1 or both (the default), down (downloads "
                         "only; the upload whole after the ring), up (uploads only; the "
                         "download whole, awaited first) or 0 (one whole copy each way).",
                         "COLL")
STAGE_PIECE = Setting("GPU_VIA_HOST_PIECE", parse_size, 0,
                      "Through the host on the native ring: the copies' piece (bytes; 0, "
                      "auto: a quarter of the call, from 2 MiB to 4 MiB).", "COLL")


def auto_piece(nbytes: int) -> int:
    """The copy counters' piece for a call of ``nbytes`` when ``ACOLL_GPU_VIA_HOST_PIECE``
    is auto: a quarter of the call, from 2 to 4 MiB (never more than a rank's segment:
    pieces split at segment bounds). Each piece costs the loop's thread two driver calls
    each way (a copy and a counter write or wait, a few microseconds each with two
    processes on the GPU), and the ring starts once the first piece landed. On one H100
    shared by 2 and 4 processes (session 47, ``bench/results/session47_gpu/``) 2 to 8 MiB
    pieces beat the eighth of the call used before (256 KiB to 4 MiB) at 4 and 16 MiB;
    at 64 MiB 2, 4 and 8 MiB pieces were level."""
    return min(4 << 20, max(2 << 20, nbytes // 4))


#: Direct calls on the native ring have their copies pipelined with it (:class:`NativeCopies`,
#: where the staging has copy counters and ``ACOLL_GPU_VIA_HOST_COUNTERS`` asks for them)
#: when each rank's segment (the call's bytes over the ranks) has at least this many bytes;
#: smaller ones copy whole. Session 46 put this at 2 MiB (on one H200, with pieces of an
#: eighth of the call, whole copies were faster up to 1 MiB segments); with the pieces of
#: :func:`auto_piece` (one piece per segment there) the counters won from 512 KiB segments
#: on one H100 shared by 2 and 4 processes (session 47, ``bench/results/session47_gpu/``:
#: 2 ranks 1 and 2 MiB out of place 0.79 and 0.85 of the host's time against 0.60 and 0.63,
#: in place level; 4 ranks 2 and 4 MiB 0.62 to 0.72 against 0.47 to 0.62).
NATIVE_PIPELINE_MIN = 512 << 10


class ViaHost:
    """A device all_reduce run by the host algorithm on one page-locked copy of its input:
    after the caller's queued work, download the input, run ``make``'s algorithm on host
    memory (in place), upload the result, and (without ``stream=``) wait for the upload.
    With ``ring`` (``make`` builds a :class:`RingAllReduce`) the copies are pipelined with
    the algorithm (:class:`RingStaging`)."""

    def __init__(self, ctx: OpContext, make: Callable[[OpContext, Buffer, Buffer], Algorithm],
                 send: Buffer, recv: Buffer, order: StreamOrder, mem: MemorySpace,
                 host: HostSpace, timeout: float, ring: bool = False,
                 native: tuple[NativeRing, ReduceOp] | None = None) -> None:
        self.ctx, self.make, self.send, self.recv = ctx, make, send, recv
        self.order, self.mem, self.host, self.timeout = order, mem, host, timeout
        self.ring = ring and native is None
        # (the native ring's place in line is taken now, when the op starts)
        self.native = (None if native is None else
                       NativeRingAllReduce(ctx, send, recv, native[1], native[0]))

    async def run(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeout
        staging = self.mem.staging()
        assert staging is not None  # (a device space always stages)
        order, ctx = self.order, self.ctx
        try:
            view, block = await staging.lease_async(self.send.nbytes)
        except BaseException:
            if self.native is not None:
                self.native.leave()  # (the next op's turn: this one never ran)
            raise
        data = self.host.wrap(view.array.view(self.send.dtype))
        ctx.mem = self.host  # the algorithm's scratch and reductions: on the host
        fence: Fence | None = None
        try:
            # (the copies' pieces: element ranges, independent of the ring's own chunks)
            chunk = _chunk_items(ctx, self.send.itemsize)
            if self.ring and self.send.count > chunk:
                stage = RingStaging(OrderedCopies(staging, order), self.send, self.recv,
                                    data, ctx.n, ctx.rank, chunk)
                stage.deadline = deadline
                ctx.stage = stage
                try:
                    await self.make(ctx, data, data).run()
                    fence = stage.finish()
                finally:
                    fence = stage.last  # (the last copy enqueued, whatever raised)
            else:
                fence = staging.download_first(order, view, self.send)
                await fence.wait(deadline)
                await _host_algorithm(self.native, self.make, ctx, data).run()
                fence = staging.upload_last(order, self.recv, view)
            if order.settle:
                # The upload is this op's last work: once it is done, so is the op.
                assert fence is not None
                await fence.wait(deadline)
        finally:
            if self.native is not None:
                self.native.leave()  # (if it never ran: the next op's turn)
            staging.release(block, fence)  # reused once the last copy touching it is done


def _host_algorithm(native: NativeRingAllReduce | None,
                    make: Callable[[OpContext, Buffer, Buffer], Algorithm], ctx: OpContext,
                    data: Buffer) -> Algorithm:
    """The algorithm of a via-host op on its host copy ``data`` (in place)."""
    if native is None:
        return make(ctx, data, data)
    native.on(data, data)
    return native


class OrderedCopies:
    """Where :class:`RingStaging` puts its copies on the ordered path: the space's own
    stream, after the caller's stream's queued work (``order``), which is ordered after the
    last copy at the end."""

    __slots__ = ("first", "order", "staging")

    def __init__(self, staging: Staging, order: StreamOrder) -> None:
        self.staging, self.order, self.first = staging, order, True

    def download(self, dst: Buffer, src: Buffer) -> Fence:
        if self.first:
            self.first = False
            return self.staging.download_first(self.order, dst, src)
        return self.staging.download(dst, src)

    def upload(self, dst: Buffer, src: Buffer) -> Fence:
        return self.staging.upload(dst, src)

    def finish(self) -> None:
        self.order.finish()


class CallerCopies:
    """Where :class:`RingStaging` puts its copies on the direct path: the caller's stream
    itself (the op starts at the call), each fenced by an event of its own."""

    __slots__ = ("staging", "stream")

    def __init__(self, staging: DirectStaging, stream: Any) -> None:
        self.staging, self.stream = staging, stream

    def download(self, dst: Buffer, src: Buffer) -> Fence:
        return self.staging.download_on(self.stream, dst, src, own=True)

    def upload(self, dst: Buffer, src: Buffer) -> Fence:
        return self.staging.upload_on(self.stream, dst, src, own=True)

    def finish(self) -> None:
        pass  # (later work on the caller's stream follows the uploads already)


class RingStaging:
    """The copies of one via-host call on the ring, pipelined with the algorithm.

    Made at the op's start (``copies``: on which stream, after what), it enqueues the
    whole input's download in pieces, segment ``rank`` first (what the ring sends first),
    then the segments in the order its reduce-scatter steps read them. The algorithm calls
    :meth:`ready` before it first reads a piece of its input and :meth:`final` once a piece
    of its output holds the result (:class:`~acoll._coll.algorithms.RingAllReduce`), which
    uploads that piece at once. Copies go on one stream in the order enqueued, so an upload
    never overtakes a download, and a piece's fence covers every piece enqueued before it.
    ``deadline`` (loop time) bounds the waits; set it before the algorithm runs.
    """

    __slots__ = ("_done_upto", "_fences", "_index", "_pend", "_piece", "_starts", "copies",
                 "data", "deadline", "itemsize", "last", "recv", "uploaded")

    def __init__(self, copies: OrderedCopies | CallerCopies, send: Buffer, recv: Buffer,
                 data: Buffer, n: int, rank: int, chunk_items: int) -> None:
        self.copies, self.recv, self.data = copies, recv, data
        self.deadline, self.itemsize = float("inf"), data.itemsize
        segs = split_even(send.count, n)
        # Pieces of a few chunks, and at most about MAX_PIECES of them (each is a CUDA call
        # on the loop's thread: a small chunk size must not make thousands).
        piece = max(PIECE_CHUNKS * chunk_items, -(-send.count // MAX_PIECES))
        self._piece = piece
        self._pend = (0, 0)  # the final range not uploaded yet (contiguous pieces join)
        fences: list[Fence] = []
        spans: list[tuple[int, int]] = []  # (start, issue index), sorted by start below
        self.last: Fence | None = None
        for j in range(n):
            start, length = segs[(rank - j) % n]
            for cs, cl in chunk_ranges(start, length, piece):
                fence = copies.download(data[cs:cs + cl], send[cs:cs + cl])
                spans.append((cs, len(fences)))
                fences.append(fence)
                self.last = fence
        spans.sort()
        self._starts = [s for s, _ in spans]
        self._index = [i for _, i in spans]
        self._fences = fences
        self._done_upto = -1  # every download up to this issue index has passed
        self.uploaded = 0  # elements of the result uploaded so far

    async def ready(self, start: int, count: int) -> None:
        """Return once elements ``start`` to ``start + count`` of the input (of the host
        copy) are downloaded. (Called per chunk: offsets, not buffers, keep it cheap.)"""
        starts, index = self._starts, self._index
        end = start + count
        k = bisect_right(starts, start) - 1
        need = -1
        while k < len(starts) and starts[k] < end:
            if index[k] > need:
                need = index[k]
            k += 1
        if need > self._done_upto:
            fence = self._fences[need]
            if not fence.done():
                await fence.wait(self.deadline)
            self._done_upto = need  # (copies pass in the order enqueued)

    def final(self, start: int, count: int) -> None:
        """Elements ``start`` to ``start + count`` of the host copy hold their final
        result: upload them, at once or joined with the next range when that one follows
        (up to a download piece)."""
        end = start + count
        first, last = self._pend
        if last == start and end - first <= self._piece:
            self._pend = (first, end)
        else:
            self._upload()
            self._pend = (start, end)
        if self._pend[1] - self._pend[0] >= self._piece:
            self._upload()

    def _upload(self) -> None:
        start, end = self._pend
        if end > start:
            self.last = self.copies.upload(self.recv[start:end], self.data[start:end])
            self.uploaded += end - start
        self._pend = (0, 0)

    def finish(self) -> Fence:
        """After the algorithm: the fence of the last upload (the whole op's work), with
        the caller's stream ordered after it."""
        self._upload()
        if self.uploaded != self.data.count:  # (the ring finalises every element once)
            raise AssertionError(f"ring staging uploaded {self.uploaded} of "
                                 f"{self.data.count} elements")
        assert self.last is not None
        self.copies.finish()
        return self.last


class DirectPlan:
    """What calls of one (count, dtype, op) on the direct path share: the algorithm and
    descriptor, a page-locked block of their own (allocated once), and the fence of the
    last upload not waited for (a call with ``stream=``: the next download waits for it on
    the device, so that a call on another stream does not overwrite the block while that
    upload still reads it; an event of acoll's own, valid whatever becomes of the stream).
    """

    __slots__ = ("block", "cls", "data", "desc", "factor", "last", "op", "staging", "view")

    def __init__(self, staging: DirectStaging, host: HostSpace, s: Buffer, rop: ReduceOp,
                 cls: Any, desc: Descriptor, factor: Any = None) -> None:
        self.staging, self.cls, self.desc, self.op = staging, cls, desc, rop
        self.view, self.block = staging.lease(s.nbytes)
        self.data = host.wrap(self.view.array.view(s.dtype))
        self.last: Fence | None = None
        #: a floating-point AVG's rounded 1/n: each call scales its downloaded copy by it
        #: (on the host, as NCCL's PreMulSum scales each input), then sums (``op``)
        self.factor = factor

    def drop(self) -> None:
        """Give the block back to the staging pool, reused only once the last upload
        (if one was not waited for) has read it."""
        self.staging.release(self.block, self.last)


class DirectCall:
    """One call on the direct path (``Communicator._via_host_direct``): its download was
    enqueued at the call; wait for it, run the host algorithm, upload on the caller's
    stream, and (without ``stream=``) wait for the upload."""

    def __init__(self, ctx: OpContext, plan: DirectPlan, download: Fence, recv: Buffer,
                 stream: Any, settle: bool, host: HostSpace, timeout: float,
                 native: NativeRing | None = None) -> None:
        self.ctx, self.plan, self.download, self.recv = ctx, plan, download, recv
        self.stream, self.settle, self.host, self.timeout = stream, settle, host, timeout
        self.native = (None if native is None else  # (its place in line: at the start)
                       NativeRingAllReduce(ctx, plan.data, plan.data, plan.op, native))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self.native is not None:
                self.native.leave()

    async def _run(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeout
        plan = self.plan
        await self.download.wait_soon(deadline)
        if plan.factor is not None:
            own = plan.data.array
            scale_into(own, own, plan.factor)
        self.ctx.mem = self.host  # the algorithm's scratch and reductions: on the host
        if self.native is not None:
            await self.native.run()
        else:
            await plan.cls(self.ctx, plan.data, plan.data, plan.op).run()
        fence = plan.staging.upload_on(self.stream, self.recv, plan.view)
        if self.settle:
            await fence.wait_soon(deadline)
            plan.last = None  # (on an error the communicator fails: no later call)
        else:
            plan.last = fence.detached()
            plan.staging.left_behind(plan.last)


class DirectLarge:
    """A larger call on the direct path (``Communicator._via_host_direct_large``): a pooled
    block was leased and its input's download enqueued on the caller's stream at the call,
    whole (``download``) or in pieces pipelined with the ring (``stage``); run the host
    algorithm, upload the result on the caller's stream (each piece once final, with
    ``stage``), and (without ``stream=``) wait for it. The block goes back to the pool
    fenced by the last copy enqueued (none once the upload was waited for); a call that
    never ran (:meth:`abandon`) gives it back fenced by its download."""

    def __init__(self, cls: Any, op: ReduceOp, staging: DirectStaging,
                 lease: tuple[Buffer, Buffer], data: Buffer, recv: Buffer, stream: Any,
                 download: Fence | None, stage: RingStaging | None, settle: bool,
                 host: HostSpace, timeout: float, native: NativeRing | None = None,
                 copies: NativeCopies | None = None) -> None:
        self.cls, self.op, self.staging = cls, op, staging
        (self.view, self.block), self.data, self.recv = lease, data, recv
        self.stream, self.stage, self.settle = stream, stage, settle
        self.host, self.timeout = host, timeout
        self._last = download  # (whole copies: the last one enqueued)
        self.ctx: OpContext | None = None
        self.started = False
        self._ring = native  # (with it: ``stage`` is None; copies whole or ``copies``)
        self.copies = copies
        self.native: NativeRingAllReduce | None = None

    @property
    def last(self) -> Fence | None:
        """The fence of the last copy enqueued (it covers every copy before it: they go
        on the caller's stream, or after its work)."""
        if self.stage is not None:
            return self.stage.last
        copies = self.copies
        if copies is not None:
            return copies.download if copies.upload is None else copies.upload
        return self._last

    def bind(self, ctx: OpContext) -> DirectLarge:
        """This call as the executor's algorithm for ``ctx`` (its op starts: a native ring
        op takes its place in line now)."""
        self.ctx = ctx
        if self._ring is not None:
            self.native = NativeRingAllReduce(ctx, self.data, self.data, self.op, self._ring)
            copies = self.copies
            if copies is not None:
                self.native.stage = copies.stage
                # (the copies' own method: a hook referring back to this call would keep
                # it, and its fences, in a reference cycle until the cyclic collector ran)
                self.native.started = copies.start_uploads
        return self

    def abandon(self) -> None:
        """The call failed before it ran: give the block back."""
        if self.native is not None:
            self.native.leave()
        if not self.started:
            self.started = True
            self.staging.release(self.block, self.last)

    async def run_copies(self, deadline: float) -> None:
        """The native ring with its copies through counters (``copies``): on failure the
        waiting uploads are let go; either way the caller's stream joins them."""
        copies, native = self.copies, self.native
        assert copies is not None
        assert native is not None
        try:
            if copies.mode == "up":
                await copies.download.wait(deadline)
            await native.run()  # (the copies wait on the ring, and it on them)
        except BaseException:
            copies.finish(failed=True)
            raise
        copies.finish(failed=False)

    async def run(self) -> None:
        self.started = True
        deadline = asyncio.get_running_loop().time() + self.timeout
        ctx, data, stage = self.ctx, self.data, self.stage
        assert ctx is not None
        ctx.mem = self.host  # the algorithm's scratch and reductions: on the host
        waited = False
        try:
            if self.copies is not None:
                await self.run_copies(deadline)
            elif stage is None:
                assert self._last is not None
                await self._last.wait(deadline)
                if self.native is not None:
                    await self.native.run()
                else:
                    await self.cls(ctx, data, data, self.op).run()
                self._last = self.staging.upload_on(self.stream, self.recv, self.view,
                                                    own=True)
            else:
                stage.deadline = deadline
                ctx.stage = stage
                await self.cls(ctx, data, data, self.op).run()
                stage.finish()
            fence = self.last
            assert fence is not None
            if self.settle:
                await fence.wait(deadline)
                waited = True
            else:
                self.staging.left_behind(fence)
        finally:
            self.staging.release(self.block, None if waited else self.last)


class NativeCopies:
    """The copies of a staged native all-reduce (``ring.c``'s contract) on the caller's
    stream: the downloads, piece by piece in the order the ring reads them, each bumping
    the block's ready counter, queued at the call; the uploads, each waiting on the device
    for the ring to make its piece final, queued once the C call is on its way
    (:meth:`start_uploads`). Nothing is awaited from the loop until the op's end."""

    def __init__(self, staging: SignalledStaging, signals: CopySignals, stream: Any,
                 send: Buffer, recv: Buffer, view: Buffer, size: int, rank: int,
                 mode: str, piece_bytes: int = 0) -> None:
        self.staging, self.signals, self.stream = staging, signals, stream
        self.recv, self.view = recv, view
        #: which copies go in pieces: "both", "down" or "up" (``ACOLL_GPU_VIA_HOST_COUNTERS``)
        self.mode = mode
        isz = send.itemsize
        if piece_bytes <= 0:  # (auto; ``ACOLL_GPU_VIA_HOST_PIECE``)
            piece_bytes = auto_piece(send.nbytes)
        piece = max(1, piece_bytes // isz)
        downloads, uploads = staged_pieces(send.count, size, rank, piece)
        self.uploads = [(a * isz, b * isz) for a, b in uploads]
        signals.begin(len(uploads))
        ready_base = signals.ready_base
        if self.mode == "up":  # (one whole download, awaited before the ring starts:
            # the ring sees every piece landed from the first)
            self.download = staging.download_on(stream, view, send, own=True)
            ready_base = (ready_base - len(downloads)) & 0xFFFFFFFF
        else:
            self.download = staging.download_pieces_on(
                stream, view, send, [(a * isz, b * isz) for a, b in downloads], signals)
        self.stage = Stage(signals.ready_addr, signals.final_addr, ready_base,
                           signals.final_base, piece)
        self.upload: Fence | None = None

    def start_uploads(self) -> None:
        """Queue the uploads (the ring's C call is on its way)."""
        if self.mode != "down":
            self.upload = self.staging.upload_pieces_on(self.stream, self.recv, self.view,
                                                        self.uploads, self.signals)

    def finish(self, failed: bool) -> None:
        """The ring returned (``failed``: or never ran, or failed): let every upload go
        when it failed, and order the caller's stream after the uploads (or, downloads
        only in pieces, upload the result whole)."""
        if failed:
            self.signals.release()  # (the upload stream must not wait forever)
        if self.mode == "down":
            if not failed:
                self.upload = self.staging.upload_on(self.stream, self.recv, self.view,
                                                     own=True)
        elif self.upload is not None:
            self.staging.join_on(self.stream, self.upload)


def native_pipelines(nbytes: int, nranks: int) -> bool:
    """Whether a via-host call of ``nbytes`` on the native ring of ``nranks`` pipelines
    its copies through copy counters (when ``ACOLL_GPU_VIA_HOST_COUNTERS`` asks for them
    and the staging has them): a local choice (the bytes on the wire are the same)."""
    return nbytes >= NATIVE_PIPELINE_MIN * nranks


def pipelines(cls: type, nbytes: int) -> bool:
    """Whether a via-host call of ``nbytes`` run by ``cls`` pipelines its copies (when
    the setting allows)."""
    return cls is RingAllReduce and nbytes > PIPELINE_MIN
