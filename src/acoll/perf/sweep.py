"""The sweep: sizes, timing and the result check, the same for every backend.

Input values depend only on rank and index and are exact in every dtype, so each output
element's expected value follows from the collective's :attr:`~.colls.Coll.source` alone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .._dtypes import DTYPE_NAMES, ReduceOp, parse_dtype
from .backends.base import Backend, Op, OpArgs
from .buffers import Buffer
from .colls import COLLS, Coll, InPlace, Usage, Where
from .report import Record, Result, Table, human

__all__ = ["Spec", "count_wrong", "expected", "sweep", "sweep_sizes", "values"]

_CHUNK = 1 << 20  # elements per step when filling and checking buffers
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: ``-a`` values: how per-rank times combine.
AVERAGE = {0: "rank0", 1: "avg", 2: "min", 3: "max"}


@dataclass(frozen=True)
class Spec:
    """One sweep as the command line asks for it; identical on every rank and backend.

    Sizes are bytes of the largest buffer an op touches (nccl-tests' ``-b/-e/-f/-i``);
    ``dtype`` and ``op`` are names; ``average`` is ``-a`` (a key of :data:`AVERAGE`).
    """

    coll: str
    minbytes: int
    maxbytes: int
    factor: float
    stepbytes: int
    iters: int
    warmup: int
    dtype: str
    op: str
    root: int
    check: bool
    average: int
    inplace: bool
    progress: bool = False
    inject_error: bool = False  # test hook: rank 0 corrupts one checked element


def sweep_sizes(minbytes: int, maxbytes: int, factor: float, step: int = 0) -> list[int]:
    """The sizes of a sweep: ``minbytes`` growing by ``step`` bytes (or ``factor``)."""
    if minbytes < 0 or maxbytes < minbytes:
        raise Usage(f"bad size range: -b {minbytes} -e {maxbytes}")
    if step <= 0 and factor <= 1:
        raise Usage(f"-f must be > 1 (got {factor:g}) unless -i gives a step")
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = size + step if step > 0 else int(size * factor)
        size = max(nxt, size + 1)
    return sizes


# --------------------------------------------------------------------------- data and check

def pattern(coll: Coll, op: ReduceOp) -> str:
    """The input pattern for :func:`values`: reductions stay exact, moved data varies."""
    if coll.reduces:
        return "prod" if op == ReduceOp.PROD else "sum"
    return "data"


def values(rank: int | npt.NDArray[np.int64], idx: npt.NDArray[np.int64], pattern: str,
           dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Input values of ``rank`` at indices ``idx``: small integers, exact in every dtype.

    ``sum`` keeps |v| <= 4 (sums of up to 31 ranks fit int8 and bfloat16 exactly); ``prod``
    gives 1 or 2; ``data`` (moved, not reduced) spans 200 values.
    """
    signed = dtype.kind in "if" or dtype == _BF16
    if pattern == "prod":
        v = 1 + (((idx * 7 + rank * 3 + (idx >> 3)) % 5) == 0).astype(np.int64)
    elif pattern == "sum":
        v = (idx * 7 + rank * 13 + (idx >> 5)) % 9 - (4 if signed else 0)
    else:
        v = (idx * 7 + rank * 131 + (idx >> 8)) % 200 - (100 if signed else 0)
    return np.asarray(v.astype(dtype))


def _fill(arr: npt.NDArray[Any], rank: int, pattern: str) -> None:
    """Fill ``arr`` with ``rank``'s input values."""
    for start in range(0, arr.size, _CHUNK):
        stop = min(arr.size, start + _CHUNK)
        arr[start:stop] = values(rank, np.arange(start, stop, dtype=np.int64), pattern,
                                 arr.dtype)


def _sentinel(arr: npt.NDArray[Any]) -> None:
    """Overwrite ``arr`` with values no correct result holds here (NaN, or the dtype's max)."""
    if arr.dtype.kind == "f" or arr.dtype == _BF16:
        arr.fill(np.nan)
    else:
        arr.fill(np.iinfo(arr.dtype).max)


def _reference(parts: Sequence[npt.NDArray[Any]], op: ReduceOp,
               dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """The reduction of ``parts`` (float64 for float dtypes, the dtype's wrap-around for ints)."""
    n = len(parts)
    floating = dtype.kind not in "iu"
    if op == ReduceOp.AVG:
        acc = np.sum([p.astype(np.float64 if floating else np.int64) for p in parts], axis=0)
        if floating:
            return np.asarray(acc / n, np.float64)
        q = np.abs(acc) // n
        return np.asarray((np.sign(acc) * q).astype(dtype))
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum,
             ReduceOp.MIN: np.minimum}[op]
    out = parts[0].astype(np.float64 if floating else dtype)
    for p in parts[1:]:
        ufunc(out, p.astype(out.dtype), out=out)
    return out


def expected(coll: str, j: npt.NDArray[np.int64], *, rank: int, nranks: int, root: int,
             per: int, op: ReduceOp, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """What output element ``j`` of ``rank`` must hold after ``coll`` (count ``per``)."""
    c = COLLS[coll]
    if c.source is None:
        raise ValueError(f"{coll} has no output to check")
    src, idx = c.source(j, Where(rank, nranks, root, per))
    pat = pattern(c, op)
    if src is None:
        return _reference([values(r, idx, pat, dtype) for r in range(nranks)], op, dtype)
    return values(src, idx, pat, dtype)


def count_wrong(got: npt.NDArray[Any], expected: npt.NDArray[Any], *,
                approx: int = 0) -> int:
    """Elements of ``got`` that differ from ``expected``.

    Exact, except that ``approx=n`` allows a floating-point AVG over ``n`` ranks its
    roundings: each input is scaled by the rounded ``1/n`` and the terms summed, each of
    the ``n - 1`` additions rounding once at a partial sum under 4 in magnitude (at most
    ``2 * eps``), whatever the average (a sum that cancels to 0 need not give exactly 0).
    """
    if got.dtype.kind in "iu":
        return int(np.count_nonzero(got != expected))
    g = got.astype(np.float64)
    if not approx:  # round the reference to the dtype first (overflow to inf matches)
        e = expected.astype(got.dtype).astype(np.float64)
        return int(g.size - np.count_nonzero(g == e))
    e = expected.astype(np.float64)
    eps = 2.0 ** -7 if got.dtype == _BF16 else float(np.finfo(got.dtype).eps)
    with np.errstate(invalid="ignore"):
        ok = (np.abs(g - e) <= eps * (np.abs(e) + 2.0 * approx)) | (g == e)
    return int(ok.size - np.count_nonzero(ok))


def _check(coll: Coll, out: npt.NDArray[Any], *, rank: int, nranks: int, root: int, per: int,
           op: ReduceOp) -> int:
    """Wrong elements of ``rank``'s output ``out`` (0 where the output is undefined)."""
    if coll.root_only and rank != root:
        return 0
    wrong = 0
    for start in range(0, out.size, _CHUNK):
        stop = min(out.size, start + _CHUNK)
        j = np.arange(start, stop, dtype=np.int64)
        exp = expected(coll.name, j, rank=rank, nranks=nranks, root=root, per=per, op=op,
                       dtype=out.dtype)
        wrong += count_wrong(out[start:stop], exp,
                             approx=nranks if op == ReduceOp.AVG else 0)
    return wrong


# --------------------------------------------------------------------------- the sweep

async def sweep(backend: Backend, spec: Spec) -> Result:
    """Open ``backend``, run ``spec`` on it, close it; rank 0 prints the table as it goes.

    Raises :class:`~.colls.Usage` when the job cannot run the collective (too few ranks,
    root out of range).
    """
    await backend.open()
    try:
        return await _Sweep(backend, spec).run()
    finally:
        backend.close()


class _Sweep:
    def __init__(self, backend: Backend, spec: Spec) -> None:
        self.backend, self.spec = backend, spec
        self.coll = coll = COLLS[spec.coll]
        self.n, self.rank = n, rank = backend.size, backend.rank
        coll.check_ranks(n, spec.root)
        self.dtype = parse_dtype(coll.dtype or spec.dtype)
        self.op = ReduceOp.coerce(spec.op)
        self.how = AVERAGE[spec.average]
        self.sizes = (sweep_sizes(spec.minbytes, spec.maxbytes, spec.factor, spec.stepbytes)
                      if coll.sized else [0])
        self.modes = [False, True] if spec.inplace and coll.inplace is not InPlace.NONE \
            else [False]
        self.checked = spec.check and coll.source is not None
        self.redop = self.op.name.lower() if coll.reduces else "none"  # the table's columns
        self.root = spec.root if coll.rooted else -1
        settings = {"collective": coll.name, "nranks": n, "dtype": DTYPE_NAMES[self.dtype],
                    "op": self.redop, "root": self.root,
                    "iters": spec.iters, "warmup": spec.warmup, "check": spec.check,
                    "minbytes": spec.minbytes, "maxbytes": spec.maxbytes,
                    "factor": spec.factor, "stepbytes": spec.stepbytes,
                    "time_combine": self.how, "host": socket.gethostname(), **backend.info}
        self.res = Result(backend.name, settings, [], [])
        self.table = Table(len(self.modes), spec.progress) if rank == 0 else None

    async def run(self) -> Result:
        if self.table is not None:
            self.table.header(self.res.settings)
        itemsize, n = self.dtype.itemsize, self.n
        biggest = max(max(self.coll.counts(s, itemsize, n)[:2]) for s in self.sizes)
        bufs = self.backend.alloc(biggest, self.dtype), self.backend.alloc(biggest, self.dtype)
        note = await self.backend.prepare(bufs)
        if note:
            self.res.note(note)
        for i, size in enumerate(self.sizes):
            recs = [await self._one(bufs, i, size, inplace) for inplace in self.modes]
            self.res.records.extend(recs)
            if self.table is not None:
                self.table.row(recs)
        if self.table is not None:
            self.table.footer(self.res, self.checked)
        return self.res

    async def _one(self, bufs: tuple[Buffer, Buffer], i: int, size: int,
                   inplace: bool) -> Record:
        """Measure (and check) the ``i``-th size in one mode; ``bufs``: input, output."""
        spec, coll, backend, rank = self.spec, self.coll, self.backend, self.rank
        a, b = bufs
        sc, rc, pc = coll.counts(size, self.dtype.itemsize, self.n)
        nbytes = max(sc, rc) * self.dtype.itemsize
        mode = "in-place" if inplace else "out-of-place"
        if self.table is not None:
            self.table.step(i + 1, len(self.sizes),
                            f"{backend.name} {coll.name} {human(nbytes)} {mode}")
        rec = Record(nbytes, pc, DTYPE_NAMES[self.dtype], self.redop, self.root, inplace,
                     None, None, None, None)
        in_off, out_off = coll.inplace.offsets(rank, pc) if inplace else (0, 0)
        ib = b if inplace else a
        args = OpArgs(inplace, ib.view(in_off, sc), b.view(out_off, rc), self.op, spec.root)
        h_in, h_out = ib.host[in_off:in_off + sc], b.host[out_off:out_off + rc]
        fn = backend.make_op(coll, args) if coll.has_form(backend.name, inplace) else None
        if fn is None:
            rec.note = "not supported"
            self.res.note(f"{mode} {coll.name} is not measured with {backend.name} "
                          "(no such form)")
            return rec
        self._prepare(bufs, h_in, h_out, inplace)
        try:
            await fn()
        except Exception as exc:
            if not backend.unsupported(exc):
                raise
            rec.note = f"not supported: {exc}"
            self.res.note(f"{mode} {coll.name} not supported by {backend.name}: "
                          f"{str(exc).splitlines()[0]}")
            return rec
        for _ in range(spec.warmup - 1):
            await fn()
        seconds = await backend.combine(await self._time(fn), self.how)
        rec.time_us = seconds * 1e6
        rec.algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        rec.busbw = rec.algbw * coll.bus(self.n)
        if self.checked:
            self._prepare(bufs, h_in, h_out, inplace)
            await fn()
            await backend.sync()
            a.download()
            b.download()
            if spec.inject_error and rank == 0:
                h_out[:1] += h_out.dtype.type(1)  # the check must notice
            wrong = _check(coll, h_out, rank=rank, nranks=self.n, root=spec.root, per=pc,
                           op=self.op)
            rec.wrong = round(await backend.combine(float(wrong), "sum"))
        return rec

    def _prepare(self, bufs: tuple[Buffer, Buffer], h_in: npt.NDArray[Any],
                 h_out: npt.NDArray[Any], inplace: bool) -> None:
        """Fresh input, a sentinel in the output, both uploaded."""
        a, b = bufs
        _sentinel(b.host[:max(h_in.size, h_out.size)] if inplace else h_out)
        _fill(h_in, self.rank, pattern(self.coll, self.op))
        if self.coll.one_buffer and not inplace and self.rank == self.spec.root:
            h_out[...] = h_in  # the op runs on the output: the root's data goes there first
        a.upload()
        b.upload()

    async def _time(self, fn: Op) -> float:
        """Average seconds per op over ``iters`` after a barrier (nccl-tests' timing)."""
        await self.backend.barrier()
        t0 = time.perf_counter()
        for _ in range(self.spec.iters):
            await fn()
        await self.backend.sync()
        return (time.perf_counter() - t0) / max(self.spec.iters, 1)
