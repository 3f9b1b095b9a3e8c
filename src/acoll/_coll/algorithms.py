"""Host collective algorithms and the tuner that picks between them.

Every algorithm is an object: ``__init__`` plans (peers, segments, chunks, buffers) and
``run`` only posts receives, sends, waits and reduces. Receives are posted before the
matching data can arrive whenever the algorithm allows, so payloads land in their final
place (zero copy); chunks are reduced and forwarded one at a time, so sending, receiving
and reducing overlap.

Ring all-reduce (rank ``r`` of ``n``; segment ``i`` is the ``i``-th of ``n`` even parts):
reduce-scatter step ``s`` sends segment ``r - s`` and receives segment ``r - s - 1``,
which is reduced with the local input and becomes the next step's send; after ``n - 1``
steps rank ``r`` holds the total of segment ``r + 1``. All-gather step ``s`` then sends
segment ``r + 1 - s`` and receives segment ``r - s`` straight into the output.

Bounded steps: ``run`` never holds the event loop for long, whatever the message size.
Reductions and local copies go through :func:`_paced`, which cuts them into pieces that
take about ``_PIECE_NS`` each (the piece size is learnt per dtype and op) and checks the
op's step bound (:data:`.base.STEP_NS`) between pieces; waits check it too, and loops that
post many chunks check it per chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._config import Setting, get_logger, parse_size
from .._dtypes import ReduceOp, finish_avg, reduce_into
from ..errors import InvalidUsage
from .base import OpContext, chunk_ranges, split_even

log = get_logger("COLL")

CHUNK = Setting("CHUNK_SIZE", parse_size, 512 << 10,
                "Pipeline chunk size in bytes for ring and chain algorithms.", "COLL")
ALGO = Setting("ALGO", str, "",
               "Force an algorithm: ring, rd (recursive doubling), tree, chain, direct.",
               "COLL")
SMALL = Setting("SMALL_MSG", parse_size, 64 << 10,
                "Messages up to this many bytes use the latency-optimised algorithm.",
                "COLL")

Array = npt.NDArray[Any]


def _chunk_items(ctx: OpContext, itemsize: int) -> int:
    return max(1, ctx.comm.chunk_bytes // itemsize)


_PIECE_NS = 200_000  # target duration of one piece of a reduction or copy
_FIRST_PIECE = 1 << 14  # items, before the speed of a kind of piece is known
# Largest piece whatever the learnt speed: memory written for the first time costs a page
# fault per 4 KiB (several us in a VM), so a size learnt on warm buffers would overrun.
# Equal to the default chunk, so that a ring step reduces its chunk and posts the send
# without a yield in between (that gap is on the critical path of the pipeline).
_MAX_PIECE_BYTES = 512 << 10
_piece_items: dict[tuple[Any, ...], int] = {}  # learnt piece size per (work, dtype, op)


async def _paced(ctx: OpContext, key: tuple[Any, ...], n: int, itemsize: int,
                 work: Callable[[int, int], None]) -> None:
    """Run ``work(start, stop)`` over ``[0, n)`` (items of ``itemsize`` bytes) in pieces
    of about ``_PIECE_NS`` and at most ``_MAX_PIECE_BYTES`` each, with a checkpoint of the
    op's step bound between pieces.

    The piece size for ``key`` adapts after every full piece (at most x4 or /4 at a time,
    so one preempted piece does not swing it) and is remembered for the next call.
    """
    most = max(_MAX_PIECE_BYTES // itemsize, 1)
    per = min(_piece_items.get(key, _FIRST_PIECE), most)
    start = 0
    while start < n:
        stop = min(n, start + per)
        t0 = time.perf_counter_ns()
        work(start, stop)
        if stop - start == per:
            scale = (_PIECE_NS / max(time.perf_counter_ns() - t0, 1)) ** 0.5
            per = min(max(int(per * min(max(scale, 0.25), 4.0)), 1 << 10), most)
        start = stop
        if start < n:
            await ctx.checkpoint()
    _piece_items[key] = per


_SMALL_WORK = 64 << 10  # bytes (ACOLL_SMALL_MSG): reduced or copied at once, unpaced


async def _reduce(ctx: OpContext, out: Array, a: Array, b: Array, op: ReduceOp) -> None:
    """``out[:] = a (op) b`` (:func:`reduce_into`), in paced pieces."""
    if out.nbytes <= _SMALL_WORK:
        reduce_into(out, a, b, op)
        return

    def work(i: int, j: int) -> None:
        reduce_into(out[i:j], a[i:j], b[i:j], op)

    await _paced(ctx, ("reduce", out.dtype, op), out.size, out.itemsize, work)


async def _avg(ctx: OpContext, arr: Array, n: int) -> None:
    """:func:`finish_avg` in paced pieces."""
    if arr.nbytes <= _SMALL_WORK:
        finish_avg(arr, n)
        return

    def work(i: int, j: int) -> None:
        finish_avg(arr[i:j], n)

    if n > 1:
        await _paced(ctx, ("avg", arr.dtype), arr.size, arr.itemsize, work)


async def _copy(ctx: OpContext, dst: Array, src: Array) -> None:
    """``dst[...] = src`` in paced pieces."""
    if dst.nbytes <= _SMALL_WORK:
        dst[...] = src
        return

    def work(i: int, j: int) -> None:
        dst[i:j] = src[i:j]

    await _paced(ctx, ("copy", dst.itemsize), dst.size, dst.itemsize, work)


class _Sends:
    """Outstanding sends of one op, awaited before the op returns."""

    __slots__ = ("ctx", "pending")

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx
        self.pending: list[tuple[asyncio.Future[None], int]] = []

    def post(self, peer: int, arr: Array, step: int) -> None:
        self.pending.append((self.ctx.post_send(peer, arr, step), peer))

    async def wait(self) -> None:
        await self.ctx.wait_sends(self.pending)
        self.pending = []


# --------------------------------------------------------------------------- all-reduce
class RingAllReduce:
    """Bandwidth-optimal ring all-reduce, pipelined in chunks (see module docstring)."""

    def __init__(self, ctx: OpContext, src: Array, dst: Array, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.nxt, self.prv = (r + 1) % n, (r - 1) % n
        segs = split_even(src.size, n)
        chunk = _chunk_items(ctx, src.itemsize)
        # Reduce-scatter: receive segment r-s-1 into scratch at step s.
        rs_recv = [segs[(r - s - 1) % n] for s in range(n - 1)]
        scratch = ctx.scratch(sum(length for _, length in rs_recv), src.dtype)
        self.rs: list[list[tuple[int, int, Array]]] = []  # per step: (start, len, scratch)
        off = 0
        for start, length in rs_recv:
            pieces = []
            for cs, cl in chunk_ranges(start, length, chunk):
                pieces.append((cs, cl, scratch[off:off + cl]))
                off += cl
            self.rs.append(pieces)
        self.first_send = chunk_ranges(*segs[r], chunk)
        self.ag = [chunk_ranges(*segs[(r - s) % n], chunk) for s in range(n - 1)]
        self.nchunks = max([len(self.first_send), *map(len, self.rs), *map(len, self.ag)])

    async def run(self) -> None:
        ctx, src, dst, op, nxt, prv = (self.ctx, self.src, self.dst, self.op, self.nxt,
                                       self.prv)
        n = ctx.n
        await ctx.connect(nxt, prv)
        k = self.nchunks
        base = (n - 1) * k
        rs_futs: list[list[asyncio.Future[bytes]]] = [[] for _ in self.rs]
        ag_futs: list[list[asyncio.Future[bytes]]] = [[] for _ in self.ag]
        for s, step in enumerate(self.rs):
            for c, (_, _, buf) in enumerate(step):
                rs_futs[s].append(ctx.post_recv(prv, buf, s * k + c))
                if ctx.due():
                    await ctx.pause()
        for s, ag_step in enumerate(self.ag):
            for c, (cs, cl) in enumerate(ag_step):
                ag_futs[s].append(ctx.post_recv(prv, dst[cs:cs + cl], base + s * k + c))
                if ctx.due():
                    await ctx.pause()
        sends = _Sends(ctx)
        for c, (cs, cl) in enumerate(self.first_send):
            sends.post(nxt, src[cs:cs + cl], c)
            if ctx.due():
                await ctx.pause()
        last = n - 2
        for s, step in enumerate(self.rs):
            for c, (cs, cl, tmp) in enumerate(step):
                await ctx.wait_recv(rs_futs[s][c], prv)
                out = dst[cs:cs + cl]
                await _reduce(ctx, out, src[cs:cs + cl], tmp, op)
                if s < last:
                    sends.post(nxt, out, (s + 1) * k + c)
                else:
                    if op == ReduceOp.AVG:
                        await _avg(ctx, out, n)
                    sends.post(nxt, out, base + c)
        for s, ag_step in enumerate(self.ag):
            for c, (cs, cl) in enumerate(ag_step):
                await ctx.wait_recv(ag_futs[s][c], prv)
                if s < last:
                    sends.post(nxt, dst[cs:cs + cl], base + (s + 1) * k + c)
        await sends.wait()


class RecursiveDoublingAllReduce:
    """Latency-optimised all-reduce: log2(n) exchanges of the whole buffer.

    For ``n`` not a power of two, the first ``2 * (n - p)`` ranks (``p`` the largest power
    of two <= n) pair up: odd ones fold their even neighbour's data in, the even ones wait,
    and get the result back at the end. Every rank ends with bit-identical results
    because each exchange combines the same two operands (in either order; all ops are
    commutative).
    """

    def __init__(self, ctx: OpContext, src: Array, dst: Array, op: ReduceOp) -> None:
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        n, r = ctx.n, ctx.rank
        p = 1 << (n.bit_length() - 1)
        self.rem = n - p
        self.tmp = ctx.scratch(src.size, src.dtype)
        if r < 2 * self.rem:
            self.role = "even" if r % 2 == 0 else "odd"
            self.vrank = -1 if r % 2 == 0 else r // 2
        else:
            self.role = "plain"
            self.vrank = r - self.rem
        self.partners = []
        if self.vrank >= 0:
            mask = 1
            while mask < p:
                v = self.vrank ^ mask
                self.partners.append(v * 2 + 1 if v < self.rem else v + self.rem)
                mask <<= 1

    async def run(self) -> None:
        ctx, src, dst, tmp, op = self.ctx, self.src, self.dst, self.tmp, self.op
        r = ctx.rank
        await ctx.connect(*self.partners, *([r + 1] if self.role == "even" else []),
                          *([r - 1] if self.role == "odd" else []))
        step = 0
        if self.role == "even":
            await ctx.wait_send(ctx.post_send(r + 1, src, 0), r + 1)
            await ctx.wait_recv(ctx.post_recv(r + 1, dst, 1000), r + 1)
            return
        if self.role == "odd":
            await ctx.wait_recv(ctx.post_recv(r - 1, tmp, 0), r - 1)
            await _reduce(ctx, dst, src, tmp, op)
        elif dst is not src:
            await _copy(ctx, dst, src)
        for i, peer in enumerate(self.partners):
            step = i + 1
            rf = ctx.post_recv(peer, tmp, step)
            sf = ctx.post_send(peer, dst, step)
            await ctx.wait_recv(rf, peer)
            await ctx.wait_send(sf, peer)
            await _reduce(ctx, dst, dst, tmp, op)
        if op == ReduceOp.AVG:
            await _avg(ctx, dst, ctx.n)
        if self.role == "odd":
            await ctx.wait_send(ctx.post_send(r - 1, dst, 1000), r - 1)


# --------------------------------------------------------------------------- broadcast
class TreeBroadcast:
    """Binomial tree from ``root``: ceil(log2 n) rounds, whole buffer per message."""

    def __init__(self, ctx: OpContext, buf: Array, root: int) -> None:
        self.ctx, self.buf, self.root = ctx, buf, root
        n, r = ctx.n, ctx.rank
        rel = (r - root) % n
        self.parent: int | None = None
        mask = 1
        while mask < n:
            if rel & mask:
                self.parent = (r - mask) % n
                break
            mask <<= 1
        self.children = []
        mask >>= 1
        while mask > 0:
            if rel + mask < n:
                self.children.append((r + mask) % n)
            mask >>= 1

    async def run(self) -> None:
        ctx, buf = self.ctx, self.buf
        await ctx.connect(*self.children, *([self.parent] if self.parent is not None else []))
        if self.parent is not None:
            await ctx.wait_recv(ctx.post_recv(self.parent, buf, 0), self.parent)
        sends = _Sends(ctx)
        for child in self.children:
            sends.post(child, buf, 0)
        await sends.wait()


class ChainBroadcast:
    """Pipelined chain root -> root+1 -> ...: each chunk is forwarded as it arrives."""

    def __init__(self, ctx: OpContext, buf: Array, root: int) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.buf = ctx, buf
        rel = (r - root) % n
        self.prv = None if rel == 0 else (r - 1) % n
        self.nxt = None if rel == n - 1 else (r + 1) % n
        self.chunks = chunk_ranges(0, buf.size, _chunk_items(ctx, buf.itemsize))

    async def run(self) -> None:
        ctx, buf, prv, nxt = self.ctx, self.buf, self.prv, self.nxt
        await ctx.connect(*[p for p in (prv, nxt) if p is not None])
        futs = []
        if prv is not None:
            for c, (s, ln) in enumerate(self.chunks):
                futs.append(ctx.post_recv(prv, buf[s:s + ln], c))
                if ctx.due():
                    await ctx.pause()
        sends = _Sends(ctx)
        for c, (s, ln) in enumerate(self.chunks):
            if prv is not None:
                await ctx.wait_recv(futs[c], prv)
            if nxt is not None:
                sends.post(nxt, buf[s:s + ln], c)
                if ctx.due():
                    await ctx.pause()
        await sends.wait()


# --------------------------------------------------------------------------- reduce
class TreeReduce:
    """Binomial tree toward ``root``; each rank folds its children's data into its own."""

    def __init__(self, ctx: OpContext, src: Array, dst: Array | None, root: int,
                 op: ReduceOp) -> None:
        self.ctx, self.src, self.root, self.op = ctx, src, root, op
        n, r = ctx.n, ctx.rank
        rel = (r - root) % n
        self.children: list[int] = []
        self.parent: int | None = None
        mask = 1
        while mask < n:
            if rel & mask:
                self.parent = (r - mask) % n
                break
            if rel + mask < n:
                self.children.append((r + mask) % n)
            mask <<= 1
        self.acc = dst if dst is not None else ctx.scratch(src.size, src.dtype, slot=1)
        self.tmps = [ctx.scratch(src.size, src.dtype, slot=2 + i)
                     for i in range(len(self.children))]

    async def run(self) -> None:
        ctx, acc, op = self.ctx, self.acc, self.op
        await ctx.connect(*self.children, *([self.parent] if self.parent is not None else []))
        futs = [ctx.post_recv(c, t, 0) for c, t in zip(self.children, self.tmps, strict=True)]
        if acc is not self.src:
            await _copy(ctx, acc, self.src)
        for child, fut, tmp in zip(self.children, futs, self.tmps, strict=True):
            await ctx.wait_recv(fut, child)
            await _reduce(ctx, acc, acc, tmp, op)
        if self.parent is not None:
            await ctx.wait_send(ctx.post_send(self.parent, acc, 0), self.parent)
        elif op == ReduceOp.AVG:
            await _avg(ctx, acc, ctx.n)


class ChainReduce:
    """Pipelined chain root+1 -> root+2 -> ... -> root, reducing chunk by chunk."""

    def __init__(self, ctx: OpContext, src: Array, dst: Array | None, root: int,
                 op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.op = ctx, src, op
        rel = (r - root - 1) % n  # position in the chain; root is last
        self.is_root = r == root
        self.prv = None if rel == 0 else (r - 1) % n
        self.nxt = None if self.is_root else (r + 1) % n
        self.out = dst if self.is_root else (
            ctx.scratch(src.size, src.dtype, slot=1) if self.prv is not None else src)
        self.tmp = ctx.scratch(src.size, src.dtype) if self.prv is not None else src
        self.chunks = chunk_ranges(0, src.size, _chunk_items(ctx, src.itemsize))

    async def run(self) -> None:
        ctx, src, out, tmp, op, prv, nxt = (self.ctx, self.src, self.out, self.tmp, self.op,
                                            self.prv, self.nxt)
        assert out is not None
        await ctx.connect(*[p for p in (prv, nxt) if p is not None])
        futs = []
        if prv is not None:
            for c, (s, ln) in enumerate(self.chunks):
                futs.append(ctx.post_recv(prv, tmp[s:s + ln], c))
                if ctx.due():
                    await ctx.pause()
        sends = _Sends(ctx)
        for c, (s, ln) in enumerate(self.chunks):
            piece = out[s:s + ln]
            if prv is not None:
                await ctx.wait_recv(futs[c], prv)
                await _reduce(ctx, piece, src[s:s + ln], tmp[s:s + ln], op)
            elif piece is not src[s:s + ln] and self.is_root:
                await _copy(ctx, piece, src[s:s + ln])
            if nxt is not None:
                sends.post(nxt, piece, c)
                if ctx.due():
                    await ctx.pause()
            elif op == ReduceOp.AVG:
                await _avg(ctx, piece, ctx.n)
        await sends.wait()


# --------------------------------------------------------------------------- gather/scatter
class RingAllGather:
    """Ring all-gather: step ``s`` forwards block ``r - s`` and receives ``r - s - 1``."""

    def __init__(self, ctx: OpContext, src: Array, dst: Array) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst = ctx, src, dst
        self.nxt, self.prv = (r + 1) % n, (r - 1) % n
        count = src.size
        chunk = _chunk_items(ctx, src.itemsize)
        self.steps = [chunk_ranges(((r - s - 1) % n) * count, count, chunk)
                      for s in range(n - 1)]
        self.own = chunk_ranges(r * count, count, chunk)
        self.k = max(1, len(self.own))

    async def run(self) -> None:
        ctx, dst, nxt, prv, k = self.ctx, self.dst, self.nxt, self.prv, self.k
        n, r, count = ctx.n, ctx.rank, self.src.size
        await ctx.connect(nxt, prv)
        futs: list[list[asyncio.Future[bytes]]] = [[] for _ in self.steps]
        for st, p in enumerate(self.steps):
            for c, (s, ln) in enumerate(p):
                futs[st].append(ctx.post_recv(prv, dst[s:s + ln], st * k + c))
                if ctx.due():
                    await ctx.pause()
        own = dst[r * count:(r + 1) * count]
        if not np.shares_memory(own, self.src):
            await _copy(ctx, own, self.src)
        sends = _Sends(ctx)
        for c, (s, ln) in enumerate(self.own):
            sends.post(nxt, dst[s:s + ln], c)
            if ctx.due():
                await ctx.pause()
        for st, pieces in enumerate(self.steps):
            for c, (s, ln) in enumerate(pieces):
                await ctx.wait_recv(futs[st][c], prv)
                if st < n - 2:
                    sends.post(nxt, dst[s:s + ln], (st + 1) * k + c)
        await sends.wait()


class RingReduceScatter:
    """Ring reduce-scatter: after ``n - 1`` steps rank ``r`` holds the total of block ``r``.

    Step ``s`` sends the partial sum of block ``r - s - 1`` and receives block ``r - s - 2``
    into scratch, where it is reduced in place with the local input and sent on.
    """

    def __init__(self, ctx: OpContext, src: Array, dst: Array, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.nxt, self.prv = (r + 1) % n, (r - 1) % n
        count = dst.size
        chunk = _chunk_items(ctx, src.itemsize)
        self.blocks = [((r - s - 2) % n) * count for s in range(n - 1)]
        self.first = ((r - 1) % n) * count
        self.pieces = chunk_ranges(0, count, chunk)
        self.scratch = ctx.scratch(count * (n - 1), src.dtype)

    async def run(self) -> None:
        ctx, src, dst, op, nxt, prv = (self.ctx, self.src, self.dst, self.op, self.nxt,
                                       self.prv)
        n, count, k = ctx.n, self.dst.size, max(1, len(self.pieces))
        await ctx.connect(nxt, prv)
        scr = self.scratch
        futs: list[list[asyncio.Future[bytes]]] = [[] for _ in range(n - 1)]
        for st in range(n - 1):
            for c, (s, ln) in enumerate(self.pieces):
                futs[st].append(ctx.post_recv(prv, scr[st * count + s:st * count + s + ln],
                                              st * k + c))
                if ctx.due():
                    await ctx.pause()
        sends = _Sends(ctx)
        for c, (s, ln) in enumerate(self.pieces):
            sends.post(nxt, src[self.first + s:self.first + s + ln], c)
            if ctx.due():
                await ctx.pause()
        for st, block in enumerate(self.blocks):
            for c, (s, ln) in enumerate(self.pieces):
                await ctx.wait_recv(futs[st][c], prv)
                tmp = scr[st * count + s:st * count + s + ln]
                local = src[block + s:block + s + ln]
                if st < n - 2:
                    await _reduce(ctx, tmp, local, tmp, op)
                    sends.post(nxt, tmp, (st + 1) * k + c)
                else:
                    out = dst[s:s + ln]
                    await _reduce(ctx, out, local, tmp, op)
                    if op == ReduceOp.AVG:
                        await _avg(ctx, out, n)
        await sends.wait()


class DirectAllToAll:
    """Every rank sends block ``p`` to rank ``p`` directly, all at once."""

    def __init__(self, ctx: OpContext, src: Array, dst: Array) -> None:
        self.ctx, self.src, self.dst = ctx, src, dst
        self.count = dst.size // ctx.n
        self.peers = [(ctx.rank + i) % ctx.n for i in range(1, ctx.n)]
        self.copy_from: Array | None = None
        if np.shares_memory(src, dst):  # in place: send from a copy of the input
            self.src, self.copy_from = ctx.scratch(src.size, src.dtype), src

    async def run(self) -> None:
        ctx, src, dst, count = self.ctx, self.src, self.dst, self.count
        if self.copy_from is not None:
            await _copy(ctx, src, self.copy_from)
        await ctx.connect(*self.peers)
        futs = [(ctx.post_recv(p, dst[p * count:(p + 1) * count], 0), p) for p in self.peers]
        sends = _Sends(ctx)
        for p in self.peers:
            sends.post(p, src[p * count:(p + 1) * count], 0)
        r = ctx.rank
        await _copy(ctx, dst[r * count:(r + 1) * count], src[r * count:(r + 1) * count])
        for fut, p in futs:
            await ctx.wait_recv(fut, p)
        await sends.wait()


class DisseminationBarrier:
    """ceil(log2 n) rounds: round ``k`` signals rank ``r + 2**k``, waits for ``r - 2**k``."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx
        n, r = ctx.n, ctx.rank
        self.rounds = []
        dist = 1
        while dist < n:
            self.rounds.append(((r + dist) % n, (r - dist) % n))
            dist <<= 1
        self.empty = np.empty(0, np.uint8)

    async def run(self) -> None:
        ctx = self.ctx
        await ctx.connect(*[p for pair in self.rounds for p in pair])
        for i, (to, frm) in enumerate(self.rounds):
            rf = ctx.post_recv(frm, self.empty, i)
            sf = ctx.post_send(to, self.empty, i)
            await ctx.wait_recv(rf, frm)
            await ctx.wait_send(sf, to)


class TreeBarrier:
    """Binomial gather of empty messages to rank 0, then a binomial release.

    2 * ceil(log2 n) hops but only ``n - 1`` connections in all, where the dissemination
    barrier needs ``n * log2 n``: used for large communicators (each connection is a
    socket pair, and hundreds of ranks may share one process).
    """

    def __init__(self, ctx: OpContext) -> None:
        tree = TreeBroadcast(ctx, np.empty(0, np.uint8), 0)
        self.ctx, self.parent, self.children = ctx, tree.parent, tree.children
        self.empty = np.empty(0, np.uint8)

    async def run(self) -> None:
        ctx, parent, children, empty = self.ctx, self.parent, self.children, self.empty
        await ctx.connect(*children, *([parent] if parent is not None else []))
        ups = [ctx.post_recv(c, empty, 0) for c in children]
        down = ctx.post_recv(parent, empty, 1) if parent is not None else None
        for child, fut in zip(children, ups, strict=True):
            await ctx.wait_recv(fut, child)
        if parent is not None and down is not None:
            await ctx.wait_send(ctx.post_send(parent, empty, 0), parent)
            await ctx.wait_recv(down, parent)
        sends = _Sends(ctx)
        for child in children:
            sends.post(child, empty, 1)
        await sends.wait()


class EmptyExchange:
    """For zero-element collectives: one empty message around the ring, to check
    every rank agrees it is a zero-element call (and on the rest of the descriptor)."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx
        self.empty = np.empty(0, np.uint8)

    async def run(self) -> None:
        ctx = self.ctx
        nxt, prv = (ctx.rank + 1) % ctx.n, (ctx.rank - 1) % ctx.n
        await ctx.connect(nxt, prv)
        rf = ctx.post_recv(prv, self.empty, 0)
        sf = ctx.post_send(nxt, self.empty, 0)
        await ctx.wait_recv(rf, prv)
        await ctx.wait_send(sf, nxt)


# --------------------------------------------------------------------------- tuner
#: Algorithm codes carried in descriptors, so ranks that chose differently (different
#: ACOLL_ALGO or ACOLL_SMALL_MSG) are told so instead of waiting on unmatched messages.
ALGO_CODES: dict[type, int] = {
    RingAllReduce: 1, RecursiveDoublingAllReduce: 2, TreeBroadcast: 3, ChainBroadcast: 4,
    TreeReduce: 3, ChainReduce: 4,
}
_CHOICES: dict[str, dict[str, type]] = {
    "all_reduce": {"ring": RingAllReduce, "rd": RecursiveDoublingAllReduce},
    "broadcast": {"tree": TreeBroadcast, "chain": ChainBroadcast},
    "reduce": {"tree": TreeReduce, "chain": ChainReduce},
}
_ALIASES = {"recursive_doubling": "rd", "recursivedoubling": "rd", "ring": "ring",
            "tree": "tree", "chain": "chain", "rd": "rd", "pipeline": "chain"}


def choose(coll: str, nbytes: int, nranks: int, forced: str, small_max: int) -> type:
    """Pick the algorithm class for ``coll`` (NCCL-tuner style: by size, overridable).

    ``ACOLL_ALGO`` may name one algorithm (applied where it exists) or per-collective
    choices such as ``all_reduce:ring,broadcast:tree``.
    """
    options = _CHOICES[coll]
    forced = forced.strip().lower()
    if forced:
        for part in forced.split(","):
            name, sep, algo = part.partition(":")
            if not sep:
                name, algo = coll, name
            algo = _ALIASES.get(algo.strip(), algo.strip())
            if name.strip() == coll:
                if algo not in options:
                    raise InvalidUsage(f"ACOLL_ALGO: {coll} has no algorithm {algo!r}; "
                                       f"choose from {sorted(options)}")
                log.debug("%s: %s (forced by ACOLL_ALGO)", coll, algo)
                return options[algo]
    small = nbytes <= small_max
    algo = {"all_reduce": "rd" if small else "ring",
            "broadcast": "tree" if small else "chain",
            "reduce": "tree" if small else "chain"}[coll]
    log.debug("%s of %d bytes on %d ranks: %s", coll, nbytes, nranks, algo)
    return options[algo]
