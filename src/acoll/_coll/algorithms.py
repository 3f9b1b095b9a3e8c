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

Memory: algorithms see :class:`~acoll._memory.Buffer` objects only, and reduce, copy and
allocate through the op context (the communicator's memory space), so the same code runs
on any memory the space supports.

Bounded steps: ``run`` never holds the event loop for long, whatever the message size.
The memory space cuts reductions and copies into short pieces with a check of the op's
step bound (:data:`.base.STEP_NS`) between them; waits check it too, and loops that post
many chunks check it per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .. import _topology as topo
from .._config import Setting, get_logger, parse_size
from .._dtypes import ReduceOp
from .._memory import Buffer
from ..errors import InvalidUsage
from .base import OpContext, chunk_ranges, split_even

#: step numbers one call may use (the tag's low 32 bits; the agreement and the timeout
#: probes, acoll._comm.probe, use the top ones)
_STEPS = (1 << 32) - 64

log = get_logger("COLL")

CHUNK = Setting("CHUNK_SIZE", parse_size, 512 << 10,
                "Pipeline chunk size in bytes for ring and chain algorithms.", "COLL")
ALGO = Setting("ALGO", str, "",
               "Force an algorithm: ring, rd (recursive doubling), hd (halving-doubling), "
               "tree, chain, direct.",
               "COLL")
SMALL = Setting("SMALL_MSG", parse_size, 64 << 10,
                "Messages up to this many bytes use the latency-optimised algorithm.",
                "COLL")
RING_CHUNKS = Setting("RING_CHUNKS", int, 8,
                      "Ring algorithms cut a rank's segment into at most this many chunks: "
                      "chunks grow above CHUNK_SIZE for large segments (0: always "
                      "CHUNK_SIZE).", "COLL", lo=0)
RING_CHUNK_MAX = Setting("RING_CHUNK_MAX", parse_size, 4 << 20,
                         "Largest chunk RING_CHUNKS may grow a ring's chunks to (never below "
                         "CHUNK_SIZE). A chunk that arrives before its receive is posted is "
                         "kept only up to a transport's MAX_EARLY: keep those above it.",
                         "COLL")
HD_CHUNKS = Setting("HD_CHUNKS", int, 2,
                    "The halving-doubling all-reduce cuts each of its blocks into at most "
                    "this many chunks (at least CHUNK_SIZE, at most RING_CHUNK_MAX; 0: "
                    "always CHUNK_SIZE).", "COLL", lo=0)


def _chunk_items(ctx: OpContext, itemsize: int) -> int:
    return max(1, ctx.chunk_bytes // itemsize)


def ring_chunk_items(chunk_bytes: int, ring_chunks: int, max_bytes: int, itemsize: int,
                     segment: int) -> int:
    """Items per pipeline chunk of a ring moving segments of ``segment`` items.

    ``chunk_bytes`` (``ACOLL_CHUNK_SIZE``) is the smallest chunk; a larger segment is cut
    into ``ring_chunks`` (``ACOLL_RING_CHUNKS``; 0: no limit) chunks of at most
    ``max_bytes`` (``ACOLL_RING_CHUNK_MAX``: messages stay within what transports keep
    when they arrive early). Every chunk costs the same fixed work (a header, a wake-up, a
    reduce call, a hand-over to the send thread): on a 16-core host over loopback TCP,
    paired with always 512 KiB, 64 and 256 MiB all-reduces with 4 and 8 ranks moved 1.09
    to 1.18x more busbw this way (``bench/results/session24_h200/4_paired/``). Every rank
    computes the same value from the same arguments (ring tags count chunks).
    """
    base = max(1, chunk_bytes // itemsize)
    if ring_chunks <= 0:
        return base
    return max(base, min(-(-segment // ring_chunks), max_bytes // itemsize))


def _ring_chunk(ctx: OpContext, itemsize: int, segment: int) -> int:
    return ring_chunk_items(ctx.chunk_bytes, ctx.ring_chunks, ctx.ring_chunk_max, itemsize,
                            segment)


def _pieces(buf: Buffer, ranges: list[tuple[int, int]]) -> list[Buffer]:
    return [buf[s:s + ln] for s, ln in ranges]


class _Sends:
    """Outstanding sends of one op, awaited before the op returns."""

    __slots__ = ("ctx", "pending")

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx
        self.pending: list[tuple[asyncio.Future[None], int]] = []

    def post(self, peer: int, buf: Buffer, step: int) -> None:
        self.pending.append((self.ctx.post_send(peer, buf, step), peer))

    async def post_paced(self, peer: int, bufs: list[Buffer], first_step: int,
                         ranges: list[tuple[int, int]] | None = None) -> None:
        """Post a send per buffer (steps ``first_step, ...``), yielding when due (and,
        under a stage, once each buffer's input is there: ``ranges`` gives each buffer's
        (start, count) in the op's input)."""
        await self.post_each(peer, bufs, range(first_step, first_step + len(bufs)), ranges)

    async def post_each(self, peer: int, bufs: list[Buffer], steps: Sequence[int],
                        ranges: list[tuple[int, int]] | None = None) -> None:
        """:meth:`post_paced` with each buffer's step given."""
        ctx = self.ctx
        stage = ctx.stage
        for i, buf in enumerate(bufs):
            if stage is not None:
                assert ranges is not None
                await stage.ready(*ranges[i])
            self.post(peer, buf, steps[i])
            if ctx.due():
                await ctx.pause()

    async def wait(self) -> None:
        await self.ctx.wait_sends(self.pending)
        self.pending = []


# --------------------------------------------------------------------------- all-reduce
class RingAllReduce:
    """Bandwidth-optimal ring all-reduce, pipelined in chunks (see module docstring)."""

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.nxt, self.prv = topo.ring(r, n)
        segs = split_even(src.count, n)
        chunk = _ring_chunk(ctx, src.itemsize, -(-src.count // n))
        # Reduce-scatter: receive segment r-s-1 into scratch at step s.
        rs_recv = [segs[(r - s - 1) % n] for s in range(n - 1)]
        scratch = ctx.scratch(sum(length for _, length in rs_recv), src.dtype)
        self.rs: list[list[tuple[int, int, Buffer]]] = []  # per step: (start, len, scratch)
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
        rs_futs = [await ctx.post_recvs_paced(prv, [tmp for _, _, tmp in step],
                                              [s * k + c for c in range(len(step))])
                   for s, step in enumerate(self.rs)]
        ag_futs = [await ctx.post_recvs_paced(prv, _pieces(dst, step),
                                              [base + s * k + c for c in range(len(step))])
                   for s, step in enumerate(self.ag)]
        sends = _Sends(ctx)
        stage = ctx.stage  # (a device op on a host copy: see OpContext.stage)
        await sends.post_paced(nxt, _pieces(src, self.first_send), 0, self.first_send)
        last = n - 2
        for s, step in enumerate(self.rs):
            for c, (cs, cl, tmp) in enumerate(step):
                await ctx.wait_recv(rs_futs[s][c], prv)
                out = dst[cs:cs + cl]
                if stage is not None:
                    await stage.ready(cs, cl)
                await ctx.reduce(out, src[cs:cs + cl], tmp, op)
                if s < last:
                    sends.post(nxt, out, (s + 1) * k + c)
                else:
                    if op == ReduceOp.AVG:
                        await ctx.avg(out)
                    sends.post(nxt, out, base + c)
                    if stage is not None:
                        stage.final(cs, cl)
        for s, ag_step in enumerate(self.ag):
            for c, (cs, cl) in enumerate(ag_step):
                await ctx.wait_recv(ag_futs[s][c], prv)
                if s < last:
                    sends.post(nxt, dst[cs:cs + cl], base + (s + 1) * k + c)
                if stage is not None:
                    stage.final(cs, cl)
        await sends.wait()


class RecursiveDoublingAllReduce:
    """Latency-optimised all-reduce: log2(n) exchanges of the whole buffer.

    For ``n`` not a power of two, the first ``2 * (n - p)`` ranks (``p`` the largest power
    of two <= n) pair up: odd ones fold their even neighbour's data in, the even ones wait,
    and get the result back at the end (:class:`acoll._topology.RecursiveDoubling`). Every
    rank ends with bit-identical results because both partners of an exchange combine the
    same two operands in the same order, the lower rank's first (the ops commute in value,
    not in bits: a MAX of +0 and -0, or a sum of two NaNs, keeps one operand's bits).
    """

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp) -> None:
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.tmp = ctx.scratch(src.count, src.dtype)
        plan = topo.RecursiveDoubling.of(ctx.rank, ctx.n)
        self.role, self.partners = plan.role, plan.partners

    async def run(self) -> None:
        ctx, src, dst, tmp, op = self.ctx, self.src, self.dst, self.tmp, self.op
        r = ctx.rank
        await ctx.connect(*self.partners, *([r + 1] if self.role == "even" else []),
                          *([r - 1] if self.role == "odd" else []))
        if self.role == "even":
            await ctx.wait_send(ctx.post_send(r + 1, src, 0), r + 1)
            await ctx.wait_recv(ctx.post_recv(r + 1, dst, 1000), r + 1)
            return
        if self.role == "odd":
            await ctx.wait_recv(ctx.post_recv(r - 1, tmp, 0), r - 1)
            await ctx.reduce(dst, src, tmp, op)
        elif not ctx.mem.same(dst, src):
            await ctx.copy(dst, src)
        for i, peer in enumerate(self.partners):
            rf = ctx.post_recv(peer, tmp, i + 1)
            sf = ctx.post_send(peer, dst, i + 1)
            await ctx.wait_recv(rf, peer)
            await ctx.wait_send(sf, peer)
            if peer < r:
                await ctx.reduce(dst, tmp, dst, op)
            else:
                await ctx.reduce(dst, dst, tmp, op)
        if op == ReduceOp.AVG:
            await ctx.avg(dst)
        if self.role == "odd":
            await ctx.wait_send(ctx.post_send(r - 1, dst, 1000), r - 1)


class DirectAllReduce:
    """All-reduce in two phases, every rank talking to every peer at once: rank ``r`` sends
    segment ``p`` of its input to rank ``p`` and combines the ``n`` contributions to its
    own segment ``r`` (its own first, then ranks ``r + 1, r + 2, ...``, so in place is
    safe), then sends the result to every peer and receives theirs into the output. The
    same bytes as the ring, in 2 phases instead of ``2 (n - 1)`` steps; chunks as the
    ring's, so a chunk is combined while later ones arrive. Every rank gets the same bits
    (each segment is combined once, by its owner)."""

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.peers = [(r + i) % n for i in range(1, n)]  # (staggered: not all at rank 0)
        segs = split_even(src.count, n)
        chunk = _ring_chunk(ctx, src.itemsize, -(-src.count // n))
        self.chunks = [chunk_ranges(*seg, chunk) for seg in segs]
        self.k = max(map(len, self.chunks))
        mine = segs[r][1]
        scratch = ctx.scratch(mine * (n - 1), src.dtype)
        # what each peer sends towards this rank's segment, chunk by chunk
        self.incoming = [[scratch[i * mine + cs - segs[r][0]:i * mine + cs - segs[r][0] + cl]
                          for cs, cl in self.chunks[r]] for i in range(n - 1)]

    async def run(self) -> None:
        ctx, src, dst, op = self.ctx, self.src, self.dst, self.op
        r, k, peers, chunks = ctx.rank, self.k, self.peers, self.chunks
        await ctx.connect(*peers)
        steps = list(range(len(chunks[r])))
        rs = [await ctx.post_recvs_paced(p, self.incoming[i], steps)
              for i, p in enumerate(peers)]
        ag = [await ctx.post_recvs_paced(p, _pieces(dst, chunks[p]),
                                         [k + c for c in range(len(chunks[p]))])
              for p in peers]
        sends = _Sends(ctx)
        assert ctx.stage is None  # (via_host.pipelines() pipelines the ring's copies only)
        for p in peers:
            await sends.post_paced(p, _pieces(src, chunks[p]), 0, chunks[p])
        for c, (cs, cl) in enumerate(chunks[r]):
            for i, p in enumerate(peers):
                await ctx.wait_recv(rs[i][c], p)
            out = dst[cs:cs + cl]
            first = src[cs:cs + cl]
            for i in range(len(peers)):
                await ctx.reduce(out, first, self.incoming[i][c], op)
                first = out
            if op == ReduceOp.AVG:
                await ctx.avg(out)
            for p in peers:
                sends.post(p, out, k + c)
            if ctx.due():
                await ctx.pause()
        for i, p in enumerate(peers):
            for fut in ag[i]:
                await ctx.wait_recv(fut, p)
        await sends.wait()


class HalvingDoublingAllReduce:
    """Bandwidth-optimal all-reduce in ``2 log2(p)`` exchanges (Rabenseifner's scheme): a
    reduce-scatter by recursive halving, then an all-gather by recursive doubling.

    ``p`` is the largest power of two <= ``n``; the buffer is cut into ``p`` blocks. In
    reduce-scatter round ``i`` (partner at distance ``p / 2, p / 4, ..., 1`` in virtual
    ranks) a rank sends the half of its current blocks that the partner keeps and combines
    the other half with what the partner sends; it ends holding the total of block ``v``,
    its virtual rank. The all-gather then sends every final block to the partners of all
    later rounds as soon as it is final. The ring's bytes (``2 (p - 1) / p`` of the buffer
    each way), but ``2 log2(p)`` dependent hops instead of ``2 (n - 1)``, and blocks cut
    into at most ``ACOLL_HD_CHUNKS`` chunks: fewer, larger messages than the ring's.

    Pipelining across rounds: a partner sends (and a rank waits for) first the blocks the
    rank forwards in its next round, in the order its next partner waits for them, so a
    round's sends start while the round before is still arriving.

    For ``n`` not a power of two the first ``2 (n - p)`` ranks pair up as in
    :class:`RecursiveDoublingAllReduce`: the even one sends its input to its odd
    neighbour, which folds it in, and gets each chunk of the result as soon as it is final.
    Every rank gets the same bits: each block is combined by one owner, then copied.

    Steps: an empty hello to every partner first (a partner of a later round sends no data
    before its earlier rounds end, and a timeout must not name a rank that started the op
    as silent), then chunk ``c`` of every message before chunk ``c + 1`` of any: the first
    chunks' steps do not depend on the chunk size, so ranks whose chunk settings differ
    fail at once on a size mismatch instead of waiting for messages that never come.
    """

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        assert n >= 2
        assert ctx.stage is None  # (via_host.pipelines() pipelines the ring's copies only)
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        p = 1 << (n.bit_length() - 1)
        rem = n - p
        self.role = topo.RecursiveDoubling.of(r, n).role
        self.p = p
        v = r // 2 if self.role == "odd" else r - rem  # (unused for "even")
        self.real = [u * 2 + 1 if u < rem else u + rem for u in range(p)]
        self.rounds = rounds = p.bit_length() - 1
        self.masks = [p >> (i + 1) for i in range(rounds)]  # reduce-scatter: p/2 ... 1
        block = -(-src.count // p)  # (the largest block)
        chunk = ring_chunk_items(ctx.chunk_bytes, ctx.hd_chunks, ctx.ring_chunk_max,
                                 src.itemsize, block)
        k = max(1, -(-block // chunk))  # chunks of the largest block
        # steps: hellos 0 .. rounds, then per chunk index a span of every message:
        # reduce-scatter (round, block), all-gather (round, block), the fold both ways
        self.span = 2 * rounds * p + 2 * p
        if rounds + 1 + k * self.span >= _STEPS:
            raise InvalidUsage(f"all_reduce: {src.count} items in chunks of {chunk} need "
                               f"more message steps than a call has with {n} ranks "
                               "(raise ACOLL_CHUNK_SIZE or ACOLL_HD_CHUNKS)")
        self.chunks = [chunk_ranges(*blk, chunk) for blk in split_even(src.count, p)]
        self.fold = [(b, c) for b in range(p) for c in range(len(self.chunks[b]))]
        self.fold_tmp: Buffer | None = None
        if self.role == "even":
            return
        # Reduce-scatter, per round: partner, the blocks sent (in the order the partner
        # waits for them) and the blocks received (in the order this rank waits).
        self.rs: list[tuple[int, list[int], list[int]]] = []
        lo, hi = 0, p
        for i, m in enumerate(self.masks):
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & m else ((lo, mid), (mid, hi))
            self.rs.append((v ^ m, self._order(*give, v ^ m, i), self._order(*keep, v, i)))
            lo, hi = keep
        assert (lo, hi) == (v, v + 1)
        # All-gather round j: the partner v ^ 2**j sends the blocks it holds then, in the
        # order it got them (its own first).
        self.ag = [(v ^ (1 << j), self._held(v ^ (1 << j), j)) for j in range(rounds)]
        scratch = ctx.scratch(sum(cl for _, _, blks in self.rs for b in blks
                                  for _, cl in self.chunks[b]), src.dtype)
        self.rs_tmp: list[list[list[Buffer]]] = []  # per round, per block, per chunk
        off = 0
        for _, _, blks in self.rs:
            per_block = []
            for b in blks:
                pieces = []
                for _, cl in self.chunks[b]:
                    pieces.append(scratch[off:off + cl])
                    off += cl
                per_block.append(pieces)
            self.rs_tmp.append(per_block)
        if self.role == "odd":
            self.fold_tmp = ctx.scratch(src.count, src.dtype, slot=1)

    def _order(self, lo: int, hi: int, who: int, i: int) -> list[int]:
        """Blocks ``lo .. hi - 1``, which virtual rank ``who`` keeps in reduce-scatter
        round ``i``, in the order it wants them: first the half it sends in round
        ``i + 1`` (in that partner's order), then the rest."""
        if i + 1 >= self.rounds:
            return list(range(lo, hi))
        m = self.masks[i + 1]
        mid = (lo + hi) // 2
        give, keep = ((lo, mid), (mid, hi)) if who & m else ((mid, hi), (lo, mid))
        return self._order(*give, who ^ m, i + 1) + list(range(*keep))

    def _held(self, who: int, j: int) -> list[int]:
        """The blocks virtual rank ``who`` holds before all-gather round ``j``, in the
        order it got them: its own, then what each earlier round brought."""
        out = [who]
        for jj in range(j):
            out += self._held(who ^ (1 << jj), jj)
        return out

    def _step(self, phase: int, rnd: int, block: int, c: int) -> int:
        return self.rounds + 1 + c * self.span + (phase * self.rounds + rnd) * self.p + block

    def _fold_step(self, out: bool, block: int, c: int) -> int:
        return self._step(2, 0, block + (self.p if out else 0), c)

    def _fold_pieces(self, buf: Buffer) -> tuple[list[Buffer], list[tuple[int, int]]]:
        ranges = [self.chunks[b][c] for b, c in self.fold]
        return _pieces(buf, ranges), ranges

    async def run(self) -> None:
        if self.role == "even":
            await self._run_even()
        else:
            await self._run()

    async def _run_even(self) -> None:
        ctx, r = self.ctx, self.ctx.rank
        await ctx.connect(r + 1)
        hello = ctx.post_recv(r + 1, ctx.empty(), self.rounds)
        outs, ranges = self._fold_pieces(self.dst)
        futs = await ctx.post_recvs_paced(r + 1, outs,
                                          [self._fold_step(True, b, c) for b, c in self.fold])
        sends = _Sends(ctx)
        await sends.post_each(r + 1, _pieces(self.src, ranges),
                              [self._fold_step(False, b, c) for b, c in self.fold])
        await ctx.wait_recv(hello, r + 1)
        for fut in futs:
            await ctx.wait_recv(fut, r + 1)
        await sends.wait()

    async def _run(self) -> None:
        ctx, src, dst, op, chunks = self.ctx, self.src, self.dst, self.op, self.chunks
        real, step, r = self.real, self._step, ctx.rank
        partners = [real[u] for u, _, _ in self.rs]
        # Hellos first, each as soon as its connection is there (a stalled partner's may
        # never be); then every receive, before its data can come (payloads land in place).
        sends = _Sends(ctx)
        hellos: list[tuple[asyncio.Future[bytes], int]] = []

        def hello(q: int) -> None:
            if q in partners:
                i = partners.index(q)
                sends.post(q, ctx.empty(), i)
                hellos.append((ctx.post_recv(q, ctx.empty(), i), q))
            else:  # (the folded even neighbour, which hears nothing else for long)
                sends.post(q, ctx.empty(), self.rounds)

        await ctx.connect_each([*([r - 1] if self.role == "odd" else []), *partners], hello)
        rs_futs = [[await ctx.post_recvs_paced(real[u], pieces,
                                               [step(0, i, b, c) for c in range(len(pieces))])
                    for b, pieces in zip(blks, self.rs_tmp[i], strict=True)]
                   for i, (u, _, blks) in enumerate(self.rs)]
        ag_futs = [[await ctx.post_recvs_paced(real[u], _pieces(dst, chunks[b]),
                                               [step(1, j, b, c)
                                                for c in range(len(chunks[b]))])
                    for b in blks]
                   for j, (u, blks) in enumerate(self.ag)]
        source = src  # what round 0 reads: the input, or (odd ranks) the folded sum
        if self.role == "odd":
            assert self.fold_tmp is not None
            tmps, ranges = self._fold_pieces(self.fold_tmp)
            futs = await ctx.post_recvs_paced(r - 1, tmps, [self._fold_step(False, b, c)
                                                            for b, c in self.fold])
            for (cs, cl), tmp, fut in zip(ranges, tmps, futs, strict=True):
                await ctx.wait_recv(fut, r - 1)
                await ctx.reduce(dst[cs:cs + cl], src[cs:cs + cl], tmp, op)
            source = dst
        u0, give0, _ = self.rs[0]
        for b in give0:
            await sends.post_each(real[u0], _pieces(source, chunks[b]),
                                  [step(0, 0, b, c) for c in range(len(chunks[b]))])
        last = self.rounds - 1
        for i, (u, _, blks) in enumerate(self.rs):
            first = source if i == 0 else dst
            nxt, forward = (real[self.rs[i + 1][0]], set(self.rs[i + 1][1])) if i < last \
                else (-1, set())
            for b, futs, tmps in zip(blks, rs_futs[i], self.rs_tmp[i], strict=True):
                for c, ((cs, cl), fut) in enumerate(zip(chunks[b], futs, strict=True)):
                    await ctx.wait_recv(fut, real[u])
                    out = dst[cs:cs + cl]
                    await ctx.reduce(out, first[cs:cs + cl], tmps[c], op)
                    if b in forward:
                        sends.post(nxt, out, step(0, i + 1, b, c))
                    elif i == last:  # this rank's own block: final
                        if op == ReduceOp.AVG:
                            await ctx.avg(out)
                        self._spread(sends, b, c, out, -1)
        for j, (u, blks) in enumerate(self.ag):
            for b, futs in zip(blks, ag_futs[j], strict=True):
                for c, ((cs, cl), fut) in enumerate(zip(chunks[b], futs, strict=True)):
                    await ctx.wait_recv(fut, real[u])
                    self._spread(sends, b, c, dst[cs:cs + cl], j)
                    if ctx.due():
                        await ctx.pause()
        for fut, q in hellos:
            await ctx.wait_recv(fut, q)
        await sends.wait()

    def _spread(self, sends: _Sends, b: int, c: int, piece: Buffer, after: int) -> None:
        """Send a final chunk to the all-gather partners of the rounds after ``after``
        and, from an odd rank, to its folded even neighbour."""
        real, step = self.real, self._step
        for j in range(after + 1, self.rounds):
            sends.post(real[self.ag[j][0]], piece, step(1, j, b, c))
        if self.role == "odd":
            sends.post(self.ctx.rank - 1, piece, self._fold_step(True, b, c))


# --------------------------------------------------------------------------- broadcast
class TreeBroadcast:
    """Binomial tree from ``root``: ceil(log2 n) rounds, whole buffer per message."""

    def __init__(self, ctx: OpContext, buf: Buffer, root: int) -> None:
        self.ctx, self.buf = ctx, buf
        tree = topo.binomial_tree(ctx.rank, ctx.n, root)
        self.parent, self.children = tree.parent, tree.children

    async def run(self) -> None:
        ctx, buf = self.ctx, self.buf
        await ctx.connect(*self.children, *([self.parent] if self.parent is not None else []))
        if self.parent is not None:
            await ctx.wait_recv(ctx.post_recv(self.parent, buf, 0), self.parent)
        sends = _Sends(ctx)
        for child in self.children:
            sends.post(child, buf, 0)
        await sends.wait()


class _Chain:
    """Set-up shared by the pipelined chains: neighbours and chunks.

    ``position`` is this rank's place in the chain (0 first); ``prv``/``nxt`` are ``None``
    at the ends.
    """

    def __init__(self, ctx: OpContext, count: int, itemsize: int, position: int) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx = ctx
        self.prv = None if position == 0 else (r - 1) % n
        self.nxt = None if position == n - 1 else (r + 1) % n
        self.chunks = chunk_ranges(0, count, _chunk_items(ctx, itemsize))

    async def start(self, into: Buffer) -> list[asyncio.Future[bytes]]:
        """Connect to the neighbours; post a receive per chunk of ``into`` from ``prv``."""
        ctx, prv = self.ctx, self.prv
        await ctx.connect(*[p for p in (prv, self.nxt) if p is not None])
        if prv is None:
            return []
        return await ctx.post_recvs_paced(prv, _pieces(into, self.chunks),
                                          list(range(len(self.chunks))))


class ChainBroadcast(_Chain):
    """Pipelined chain root -> root+1 -> ...: each chunk is forwarded as it arrives."""

    def __init__(self, ctx: OpContext, buf: Buffer, root: int) -> None:
        super().__init__(ctx, buf.count, buf.itemsize, (ctx.rank - root) % ctx.n)
        self.buf = buf

    async def run(self) -> None:
        ctx, buf, prv, nxt = self.ctx, self.buf, self.prv, self.nxt
        futs = await self.start(buf)
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

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer | None, root: int,
                 op: ReduceOp) -> None:
        self.ctx, self.src, self.op = ctx, src, op
        tree = topo.binomial_tree(ctx.rank, ctx.n, root)
        self.parent = tree.parent
        self.children = tree.children[::-1]  # smallest subtree first: it finishes first
        self.acc = dst if dst is not None else ctx.scratch(src.count, src.dtype, slot=1)
        self.tmps = [ctx.scratch(src.count, src.dtype, slot=2 + i)
                     for i in range(len(self.children))]

    async def run(self) -> None:
        ctx, acc, op = self.ctx, self.acc, self.op
        await ctx.connect(*self.children, *([self.parent] if self.parent is not None else []))
        futs = [ctx.post_recv(c, t, 0) for c, t in zip(self.children, self.tmps, strict=True)]
        if not ctx.mem.same(acc, self.src):
            await ctx.copy(acc, self.src)
        for child, fut, tmp in zip(self.children, futs, self.tmps, strict=True):
            await ctx.wait_recv(fut, child)
            await ctx.reduce(acc, acc, tmp, op)
        if self.parent is not None:
            await ctx.wait_send(ctx.post_send(self.parent, acc, 0), self.parent)
        elif op == ReduceOp.AVG:
            await ctx.avg(acc)


class ChainReduce(_Chain):
    """Pipelined chain root+1 -> root+2 -> ... -> root, reducing chunk by chunk."""

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer | None, root: int,
                 op: ReduceOp) -> None:
        super().__init__(ctx, src.count, src.itemsize, (ctx.rank - root - 1) % ctx.n)
        self.src, self.op = src, op
        self.is_root = ctx.rank == root
        if self.is_root:
            assert dst is not None
            self.out = dst
        else:
            self.out = ctx.scratch(src.count, src.dtype, slot=1) if self.prv is not None \
                else src
        self.tmp = ctx.scratch(src.count, src.dtype) if self.prv is not None else src

    async def run(self) -> None:
        ctx, src, out, tmp, op, prv, nxt = (self.ctx, self.src, self.out, self.tmp, self.op,
                                            self.prv, self.nxt)
        futs = await self.start(tmp)
        sends = _Sends(ctx)
        for c, (s, ln) in enumerate(self.chunks):
            piece = out[s:s + ln]
            if prv is not None:
                await ctx.wait_recv(futs[c], prv)
                await ctx.reduce(piece, src[s:s + ln], tmp[s:s + ln], op)
            if nxt is not None:
                sends.post(nxt, piece, c)
                if ctx.due():
                    await ctx.pause()
            elif op == ReduceOp.AVG:
                await ctx.avg(piece)
        await sends.wait()


# --------------------------------------------------------------------------- gather/scatter
class RingAllGather:
    """Ring all-gather: step ``s`` forwards block ``r - s`` and receives ``r - s - 1``."""

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst = ctx, src, dst
        self.nxt, self.prv = topo.ring(r, n)
        count = src.count
        chunk = _ring_chunk(ctx, src.itemsize, count)
        self.steps = [chunk_ranges(((r - s - 1) % n) * count, count, chunk)
                      for s in range(n - 1)]
        self.own = chunk_ranges(r * count, count, chunk)
        self.k = max(1, len(self.own))

    async def run(self) -> None:
        ctx, dst, nxt, prv, k = self.ctx, self.dst, self.nxt, self.prv, self.k
        n, r, count = ctx.n, ctx.rank, self.src.count
        await ctx.connect(nxt, prv)
        futs = [await ctx.post_recvs_paced(prv, _pieces(dst, p),
                                           [st * k + c for c in range(len(p))])
                for st, p in enumerate(self.steps)]
        own = dst[r * count:(r + 1) * count]
        if not ctx.mem.overlaps(own, self.src):
            await ctx.copy(own, self.src)
        sends = _Sends(ctx)
        await sends.post_paced(nxt, _pieces(dst, self.own), 0)
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

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer, op: ReduceOp) -> None:
        n, r = ctx.n, ctx.rank
        self.ctx, self.src, self.dst, self.op = ctx, src, dst, op
        self.nxt, self.prv = topo.ring(r, n)
        count = dst.count
        chunk = _ring_chunk(ctx, src.itemsize, count)
        self.blocks = [((r - s - 2) % n) * count for s in range(n - 1)]
        self.first = ((r - 1) % n) * count
        self.pieces = chunk_ranges(0, count, chunk)
        self.scratch = ctx.scratch(count * (n - 1), src.dtype)

    async def run(self) -> None:
        ctx, src, dst, op, nxt, prv = (self.ctx, self.src, self.dst, self.op, self.nxt,
                                       self.prv)
        n, count, k = ctx.n, self.dst.count, max(1, len(self.pieces))
        await ctx.connect(nxt, prv)
        scr = self.scratch
        futs = [await ctx.post_recvs_paced(prv, _pieces(scr[st * count:(st + 1) * count],
                                                        self.pieces),
                                           [st * k + c for c in range(len(self.pieces))])
                for st in range(n - 1)]
        sends = _Sends(ctx)
        await sends.post_paced(nxt, _pieces(src[self.first:self.first + count], self.pieces), 0)
        for st, block in enumerate(self.blocks):
            for c, (s, ln) in enumerate(self.pieces):
                await ctx.wait_recv(futs[st][c], prv)
                tmp = scr[st * count + s:st * count + s + ln]
                local = src[block + s:block + s + ln]
                if st < n - 2:
                    await ctx.reduce(tmp, local, tmp, op)
                    sends.post(nxt, tmp, (st + 1) * k + c)
                else:
                    out = dst[s:s + ln]
                    await ctx.reduce(out, local, tmp, op)
                    if op == ReduceOp.AVG:
                        await ctx.avg(out)
        await sends.wait()


class DirectAllToAll:
    """Every rank sends block ``p`` to rank ``p`` directly, all at once."""

    def __init__(self, ctx: OpContext, src: Buffer, dst: Buffer) -> None:
        self.ctx, self.src, self.dst = ctx, src, dst
        self.count = dst.count // ctx.n
        self.peers = [(ctx.rank + i) % ctx.n for i in range(1, ctx.n)]
        self.copy_from: Buffer | None = None
        if ctx.mem.overlaps(src, dst):  # in place: send from a copy of the input
            self.src, self.copy_from = ctx.scratch(src.count, src.dtype), src

    async def run(self) -> None:
        ctx, src, dst, count = self.ctx, self.src, self.dst, self.count
        if self.copy_from is not None:
            await ctx.copy(src, self.copy_from)
        await ctx.connect(*self.peers)
        futs = [(ctx.post_recv(p, dst[p * count:(p + 1) * count], 0), p) for p in self.peers]
        sends = _Sends(ctx)
        for p in self.peers:
            sends.post(p, src[p * count:(p + 1) * count], 0)
        r = ctx.rank
        await ctx.copy(dst[r * count:(r + 1) * count], src[r * count:(r + 1) * count])
        for fut, p in futs:
            await ctx.wait_recv(fut, p)
        await sends.wait()


class DisseminationBarrier:
    """ceil(log2 n) rounds: round ``k`` signals rank ``r + 2**k``, waits for ``r - 2**k``."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx
        self.rounds = topo.dissemination(ctx.rank, ctx.n)

    async def run(self) -> None:
        ctx = self.ctx
        empty = ctx.empty()
        await ctx.connect(*[p for pair in self.rounds for p in pair])
        for i, (to, frm) in enumerate(self.rounds):
            rf = ctx.post_recv(frm, empty, i)
            sf = ctx.post_send(to, empty, i)
            await ctx.wait_recv(rf, frm)
            await ctx.wait_send(sf, to)


class TreeBarrier:
    """Binomial gather of empty messages to rank 0, then a binomial release.

    2 * ceil(log2 n) hops but only ``n - 1`` connections in all, where the dissemination
    barrier needs ``n * log2 n``: used for large communicators (each connection is a
    socket pair, and hundreds of ranks may share one process).
    """

    def __init__(self, ctx: OpContext) -> None:
        tree = topo.binomial_tree(ctx.rank, ctx.n, 0)
        self.ctx, self.parent, self.children = ctx, tree.parent, tree.children

    async def run(self) -> None:
        ctx, parent, children = self.ctx, self.parent, self.children
        empty = ctx.empty()
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


# --------------------------------------------------------------------------- tuner
#: Algorithm codes carried in descriptors, so ranks that chose differently (different
#: ACOLL_ALGO or ACOLL_SMALL_MSG) are told so instead of waiting on unmatched messages.
ALGO_CODES: dict[type, int] = {
    RingAllReduce: 1, RecursiveDoublingAllReduce: 2, TreeBroadcast: 3, ChainBroadcast: 4,
    TreeReduce: 3, ChainReduce: 4, DirectAllReduce: 5, HalvingDoublingAllReduce: 6,
}
_CHOICES: dict[str, dict[str, type]] = {
    "all_reduce": {"ring": RingAllReduce, "rd": RecursiveDoublingAllReduce,
                   "direct": DirectAllReduce, "hd": HalvingDoublingAllReduce},
    "broadcast": {"tree": TreeBroadcast, "chain": ChainBroadcast},
    "reduce": {"tree": TreeReduce, "chain": ChainReduce},
}
_ALIASES = {"recursive_doubling": "rd", "recursivedoubling": "rd", "ring": "ring",
            "tree": "tree", "chain": "chain", "rd": "rd", "pipeline": "chain",
            "direct": "direct", "hd": "hd", "halving_doubling": "hd",
            "rabenseifner": "hd"}


def choose(coll: str, nbytes: int, nranks: int, forced: str, small_max: int) -> type:
    """Pick the algorithm class for ``coll`` (NCCL-tuner style: by size, overridable).

    ``ACOLL_ALGO`` may name one algorithm (applied to the collectives that have it; a
    name no collective has is refused) or per-collective choices such as
    ``all_reduce:ring,broadcast:tree`` (refused where that collective lacks it).
    """
    options = _CHOICES[coll]
    forced = forced.strip().lower()
    if forced:
        for part in forced.split(","):
            name, sep, algo = part.partition(":")
            if not sep:
                name, algo = coll, name
            algo = _ALIASES.get(algo.strip(), algo.strip())
            if not sep and algo not in options:
                if not any(algo in o for o in _CHOICES.values()):
                    raise InvalidUsage(f"ACOLL_ALGO: no collective has an algorithm "
                                       f"{algo!r}")
                continue  # (another collective's: this one keeps its tuner)
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
