"""Host memory: NumPy arrays, reduced with NumPy ufuncs (see :mod:`acoll._dtypes`).

Every operation is synchronous: it is finished when its await returns, so
:meth:`~.base.MemorySpace.settle` has nothing to wait for. Work on more than
``_SMALL_WORK`` bytes runs in paced pieces: each piece takes about ``_PIECE_NS`` (the
piece size is learnt per kind of work and dtype, and shared by every host space of the
process), with a ``pace()`` between pieces.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._dtypes import (
    ReduceOp,
    as_host_array,
    avg_factor,
    byte_view,
    empty_bytes,
    finish_avg,
    reduce_into,
    scale_into,
)
from ..errors import AcollError, InvalidUsage
from .base import Buffer, MemoryKind, MemorySpace, Pace

__all__ = ["HostSpace", "data_address", "paced"]

_PIECE_NS = 200_000  # target duration of one piece of a reduction or copy
_FIRST_PIECE = 1 << 14  # items, before the speed of a kind of piece is known
# Largest piece whatever the learnt speed: memory written for the first time costs a page
# fault per 4 KiB (several us in a VM), so a size learnt on warm buffers would overrun.
# Equal to the default chunk, so that a ring step reduces its chunk and posts the send
# without a yield in between (that gap is on the critical path of the pipeline).
_MAX_PIECE_BYTES = 512 << 10
_SMALL_WORK = 64 << 10  # bytes done at once, unpaced
_piece_items: dict[tuple[Any, ...], int] = {}  # learnt piece size per (work, dtype, op)


async def paced(pace: Pace, key: tuple[Any, ...], n: int, itemsize: int,
                 work: Callable[[int, int], None]) -> None:
    """Run ``work(start, stop)`` over ``[0, n)`` in pieces of about ``_PIECE_NS`` and at
    most ``_MAX_PIECE_BYTES``, awaiting ``pace()`` between pieces.

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
            await pace()
    _piece_items[key] = per


#: id(array) -> (weak reference, nbytes, data address) of arrays seen lately
_addresses: dict[int, tuple[Any, int, int]] = {}
_ADDRESSES_KEPT = 64


def data_address(arr: Any) -> int:
    """The address of NumPy array ``arr``'s first byte.

    ``arr.__array_interface__`` builds a dictionary each time (3.4 us on the 2-core VM);
    a zero-copy collective on the same registered array, called over and over, asks this
    several times a call. So the answer is kept per array object while the object lives,
    for arrays that do not own their memory (views, and arrays of ``empty_shared``): the
    data of those never moves. An array that owns its memory is not kept: a weak
    reference to it would stop ``ndarray.resize`` (which may move it)."""
    key = id(arr)
    seen = _addresses.get(key)
    if seen is not None and seen[0]() is arr and seen[1] == arr.nbytes:
        return seen[2]
    address = int(arr.__array_interface__["data"][0])
    if getattr(arr, "base", None) is None:
        return address
    try:
        ref = weakref.ref(arr)
    except TypeError:  # (no weak references: nothing kept)
        return address
    if len(_addresses) >= _ADDRESSES_KEPT:
        _addresses.clear()  # (atomic, unlike dropping the oldest, if threads share it)
    _addresses[key] = (ref, arr.nbytes, address)
    return address


class HostSpace(MemorySpace):
    """Host (CPU) memory. One per communicator: it holds that communicator's scratch pool."""

    kind = MemoryKind.HOST

    def __init__(self) -> None:
        self._pool: dict[int, np.ndarray[Any, Any]] = {}

    def __repr__(self) -> str:
        return "host memory"

    def adopt(self, obj: Any, what: str, *, writable: bool = False) -> Buffer:
        try:
            return Buffer(as_host_array(obj, what, writable=writable), self)
        except AcollError:
            raise
        except Exception as exc:  # (the object's own buffer interface failed)
            raise InvalidUsage(f"{what}: reading it as a buffer raised {exc!r}") from exc

    def wrap(self, arr: np.ndarray[Any, Any]) -> Buffer:
        """A NumPy array known to be 1-D and contiguous, as a buffer (no checks)."""
        return Buffer(arr, self)

    def empty(self, count: int, dtype: np.dtype[Any]) -> Buffer:
        return Buffer(empty_bytes(count * dtype.itemsize).view(dtype), self)

    def scratch(self, count: int, dtype: np.dtype[Any], slot: int = 0) -> Buffer:
        nbytes = count * dtype.itemsize
        raw = self._pool.get(slot)
        if raw is None or raw.size < nbytes:
            raw = empty_bytes(max(nbytes, 64))  # no huge pages: see empty_bytes
            self._pool[slot] = raw
        return Buffer(raw[:nbytes].view(dtype), self, owned=True)

    async def reduce(self, out: Buffer, a: Buffer, b: Buffer, op: ReduceOp,
                     pace: Pace) -> None:
        o, x, y = out.array, a.array, b.array
        if o.nbytes <= _SMALL_WORK:
            reduce_into(o, x, y, op)
            return

        def work(i: int, j: int) -> None:
            reduce_into(o[i:j], x[i:j], y[i:j], op)

        await paced(pace, ("reduce", o.dtype, op), o.size, o.itemsize, work)

    async def finish_avg(self, buf: Buffer, n: int, pace: Pace) -> None:
        arr = buf.array
        if n <= 1:
            return
        if arr.nbytes <= _SMALL_WORK:
            finish_avg(arr, n)
            return

        def work(i: int, j: int) -> None:
            finish_avg(arr[i:j], n)

        await paced(pace, ("avg", arr.dtype), arr.size, arr.itemsize, work)

    async def copy(self, dst: Buffer, src: Buffer, pace: Pace) -> None:
        d, s = dst.array, src.array
        if d.nbytes <= _SMALL_WORK:
            d[...] = s
            return

        def work(i: int, j: int) -> None:
            d[i:j] = s[i:j]

        await paced(pace, ("copy", d.itemsize), d.size, d.itemsize, work)

    async def scale(self, dst: Buffer, src: Buffer, n: int, pace: Pace) -> None:
        d, s = dst.array, src.array
        factor = avg_factor(d.dtype, n)
        if d.nbytes <= _SMALL_WORK:
            scale_into(d, s, factor)
            return

        def work(i: int, j: int) -> None:
            scale_into(d[i:j], s[i:j], factor)

        await paced(pace, ("scale", d.dtype), d.size, d.itemsize, work)

    def pointer(self, buf: Buffer) -> int:
        return int(buf.array.ctypes.data)

    def byte_view(self, buf: Buffer) -> memoryview:
        return byte_view(buf.array)
