"""Shared reference checks for collective tests (in one loop and across processes).

Inputs are small integers that every dtype represents exactly, chosen so that sums and
products of up to 5 ranks stay exact: results are compared bit for bit with NumPy. The
exception is a floating-point AVG over a rank count that is not a power of two: each input
is scaled by the rounded ``1/n`` first (as NCCL does), and those inexact terms sum to
last bits that depend on the order (:func:`assert_result`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

import acoll
from acoll._dtypes import BFLOAT16, DTYPES, avg_factor, finish_avg, reduce_into, scale_into

ALL_DTYPES = list(DTYPES)
ALL_OPS = [acoll.SUM, acoll.PROD, acoll.MAX, acoll.MIN, acoll.AVG]
COUNTS = [0, 1, 7, 1000, 100003]


def make_input(rank: int, count: int, dtype: np.dtype[Any], op: acoll.ReduceOp,
               salt: int = 0) -> npt.NDArray[Any]:
    """Rank ``rank``'s input (read-only and shared: every rank of a one-loop test asks for
    every rank's input; copy before writing)."""
    return _make_input(rank, count, np.dtype(dtype), op, salt)


@functools.lru_cache(maxsize=4096)
def _make_input(rank: int, count: int, dtype: np.dtype[Any], op: acoll.ReduceOp,
                salt: int) -> npt.NDArray[Any]:
    idx = np.arange(count, dtype=np.int64)
    if op == acoll.PROD:
        vals = 1 + (idx + rank + salt) % 2  # 1 or 2: products <= 32
    elif dtype.kind == "u":
        vals = (idx * 7 + rank * 3 + salt) % 4
    else:
        vals = (idx * 5 + rank * 3 + salt) % 7 - 3  # (varies along idx, unlike idx * 7)
    out = vals.astype(dtype)
    out.setflags(write=False)
    return out


def _floating(dt: np.dtype[Any]) -> bool:
    return dt.kind == "f" or dt == BFLOAT16


def reference(inputs: list[npt.NDArray[Any]], op: acoll.ReduceOp) -> npt.NDArray[Any]:
    """The result in rank order (floating-point AVG: each input scaled by the rounded
    ``1/n``, then summed; integer AVG: the sum divided)."""
    n = len(inputs)
    if op == acoll.AVG and _floating(inputs[0].dtype):
        factor = avg_factor(inputs[0].dtype, n)
        acc = np.empty_like(inputs[0])
        scale_into(acc, inputs[0], factor)
        term = np.empty_like(acc)
        for x in inputs[1:]:
            scale_into(term, x, factor)
            reduce_into(acc, acc, term, acoll.SUM)
        return acc
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(acc, acc, x, op)
    if op == acoll.AVG:
        finish_avg(acc, n)
    return acc


def assert_result(got: npt.NDArray[Any], want: npt.NDArray[Any], op: acoll.ReduceOp,
                  n: int, what: str) -> None:
    """:func:`assert_same`, but for a floating-point AVG over ``n`` ranks, ``n`` not a
    power of two: within ``n`` units in the last place at 4 (every term is at most 3 / n
    in magnitude and each of the ``n - 1`` additions rounds once). A missing or doubled
    scaling is off by more wherever the inputs' sum is 2 or more in magnitude, as it is
    at most indices (the inputs vary along the array)."""
    if op != acoll.AVG or not _floating(want.dtype) or not n & (n - 1):
        assert_same(got, want, what)
        return
    assert got.dtype == want.dtype, what
    tol = n * 4 * float(ml_dtypes.finfo(want.dtype).eps)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = np.flatnonzero(~(diff <= tol))
    if bad.size:
        raise AssertionError(f"{what}: {bad.size} elements off by more than {tol:g}, "
                             f"first at {bad[:5]}: got {got[bad[:5]]} want {want[bad[:5]]}")


def assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any], what: str) -> None:
    assert got.dtype == want.dtype, what
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))
        raise AssertionError(f"{what}: {bad.size} wrong elements, first at {bad[:5]}: "
                             f"got {got[bad[:5]]} want {want[bad[:5]]}")


def _same(x: Any) -> Any:
    return x


def _v_block(src: int, dst: int, count: int) -> int:
    """Items rank ``src`` sends rank ``dst`` in the all-to-all-v check (uneven, some 0)."""
    return max(0, count - (2 * src + dst) % 3)


async def _all_to_all_v(comm: acoll.Communicator, count: int, dt: Any,
                        dev: Callable[[Any], Any], host: Callable[[Any], Any]) -> None:
    """An all-to-all-v as users write it with NCCL: one group, a send to and a recv from
    every rank, this one included (a send to self), blocks of uneven sizes."""
    n, r = comm.size, comm.rank

    def sent(q: int) -> npt.NDArray[Any]:
        total = sum(_v_block(q, d, count) for d in range(n))
        return make_input(q, total, dt, acoll.SUM, salt=4)

    mine = sent(r)
    outs = [dev(np.empty(_v_block(q, r, count), dt)) for q in range(n)]
    async with comm.group():
        at = 0
        for d in range(n):
            size = _v_block(r, d, count)
            await comm.send(dev(mine[at:at + size]), d)
            at += size
        for q in range(n):
            await comm.recv(outs[q], q)
    for q in range(n):
        start = sum(_v_block(q, d, count) for d in range(r))
        assert_same(host(outs[q]), sent(q)[start:start + _v_block(q, r, count)],
                    f"all-to-all-v block from {q} n={n} count={count} {dt}")


async def check_all(comm: acoll.Communicator, counts: list[int], dtypes: list[Any],
                    ops: list[acoll.ReduceOp], *, dev: Callable[[Any], Any] = _same,
                    host: Callable[[Any], Any] = _same) -> int:
    """Run every collective over the matrix on ``comm``; return the number of checks.

    ``dev(array)`` makes the buffer a collective gets from a NumPy array (a copy in device
    memory; it must slice like NumPy, sharing memory) and ``host(buf)`` reads one back as
    NumPy; both default to the array itself (host buffers).
    """
    n, r = comm.size, comm.rank
    checks = 0
    for count in counts:
        for dt in dtypes:
            for op in ops:
                if op == acoll.AVG and np.dtype(dt).kind in "iu" and np.dtype(dt).itemsize == 1:
                    continue  # refused (would wrap): tests/test_failures.py checks the error
                tag = f"n={n} count={count} dtype={dt} op={op.name} rank={r}"
                ins = [make_input(q, count, dt, op) for q in range(n)]
                want = reference(ins, op)
                # all_reduce, out of place and in place
                out = dev(np.empty_like(ins[r]))
                await comm.all_reduce(dev(ins[r]), out, op=op)
                assert_result(host(out), want, op, n, "all_reduce " + tag)
                buf = dev(ins[r].copy())
                await comm.all_reduce(buf, op=op)
                assert_result(host(buf), want, op, n, "all_reduce in-place " + tag)
                # reduce to a root that moves with the case
                root = (count + int(op)) % n
                out = dev(np.zeros_like(ins[r]))
                await comm.reduce(dev(ins[r]), out, op=op, root=root)
                if r == root:
                    assert_result(host(out), want, op, n, f"reduce root={root} " + tag)
                # reduce_scatter: every rank contributes n blocks of `count`
                big = [make_input(q, n * count, dt, op, salt=1) for q in range(n)]
                rs_want = reference(big, op)[r * count:(r + 1) * count]
                rs_out = dev(np.empty(count, dt))
                await comm.reduce_scatter(dev(big[r]), rs_out, op=op)
                assert_result(host(rs_out), rs_want, op, n, "reduce_scatter " + tag)
                whole = dev(big[r].copy())  # in place: recv is this rank's block of send
                mine = whole[r * count:(r + 1) * count]
                await comm.reduce_scatter(whole, mine, op=op)
                assert_result(host(mine), rs_want, op, n, "reduce_scatter in-place " + tag)
                others = host(whole).copy()
                others[r * count:(r + 1) * count] = big[r][r * count:(r + 1) * count]
                assert_same(others, big[r], "reduce_scatter in-place, other blocks " + tag)
                checks += 4
            # data movement (no op)
            ins = [make_input(q, count, dt, acoll.SUM, salt=2) for q in range(n)]
            root = count % n
            buf = dev(ins[r].copy())
            await comm.broadcast(buf, root=root)
            assert_same(host(buf), ins[root],
                        f"broadcast root={root} n={n} count={count} {dt}")
            if isinstance(buf, np.ndarray):  # a root's buffer is only read: may be read-only
                buf = ins[r].copy() if r == root else np.zeros_like(ins[r])
                buf.flags.writeable = r != root
                await comm.broadcast(buf, root=root)
                assert_same(buf, ins[root], f"broadcast, read-only root={root} n={n} {count}")
            gathered = dev(np.empty(n * count, dt))
            await comm.all_gather(dev(ins[r]), gathered)
            assert_same(host(gathered), np.concatenate(ins),
                        f"all_gather n={n} count={count} {dt}")
            inplace_host = np.zeros(n * count, dt)
            inplace_host[r * count:(r + 1) * count] = ins[r]
            inplace = dev(inplace_host)
            await comm.all_gather(inplace[r * count:(r + 1) * count], inplace)
            assert_same(host(inplace), np.concatenate(ins),
                        f"all_gather in-place n={n} {count}")
            a2a_in = [make_input(q, n * count, dt, acoll.SUM, salt=3) for q in range(n)]
            a2a_out = dev(np.empty(n * count, dt))
            await comm.all_to_all(dev(a2a_in[r]), a2a_out)
            a2a_want = np.concatenate([a2a_in[q][r * count:(r + 1) * count] for q in range(n)])
            assert_same(host(a2a_out), a2a_want, f"all_to_all n={n} count={count} {dt}")
            got = dev(np.empty(count, dt))
            async with comm.group():  # (one rank: a send to self)
                await comm.send(dev(ins[r]), (r + 1) % n)
                await comm.recv(got, (r - 1) % n)
            assert_same(host(got), ins[(r - 1) % n],
                        f"send/recv n={n} count={count} {dt}")
            await _all_to_all_v(comm, count, dt, dev, host)
            checks += 6
    await comm.barrier()
    return checks
