"""Argument adaptation: users' arrays and ints checked and turned into buffers and
descriptors, with errors that name the argument (all :class:`~acoll.InvalidUsage`)."""

from __future__ import annotations

import operator
from typing import Any

from .._coll.algorithms import ALGO_CODES
from .._coll.base import Coll, Descriptor
from .._dtypes import dtype_code
from .._memory import Buffer, MemorySpace
from ..errors import InvalidUsage

__all__ = ["as_int", "buffer_pair", "check_peer", "check_root", "descriptor"]


def as_int(value: Any, name: str, lo: int = -(1 << 63), hi: int = (1 << 63) - 1,
           expect: str = "") -> int:
    """``value`` as a Python int in ``[lo, hi]``: ints and NumPy integers (anything with
    ``__index__``), never bool; else :class:`InvalidUsage` naming ``name`` and what it
    must be (``expect``, or the range)."""
    expect = expect or f"an int in [{lo}, {hi}]"
    if isinstance(value, bool):
        raise InvalidUsage(f"{name} must be {expect}, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidUsage(f"{name} must be {expect}, got {value!r}") from None
    except Exception as exc:  # (an __index__ of the caller's that fails)
        raise InvalidUsage(f"{name} must be {expect}; reading it raised {exc!r}") from exc
    if not lo <= number <= hi:
        raise InvalidUsage(f"{name} must be {expect}, got {number}")
    return number


def check_root(root: int, size: int) -> int:
    return as_int(root, "root", 0, size - 1)


def check_peer(peer: int, size: int) -> int:
    return as_int(peer, "peer", 0, size - 1)


def descriptor(coll: Coll, buf: Buffer, op: int = 0, root: int = 0, count: int | None = None,
               algo: type | None = None) -> Descriptor:
    """What this rank runs, as carried in every message of the op."""
    return Descriptor(coll, dtype_code(buf.dtype), op, root,
                      buf.count if count is None else count,
                      ALGO_CODES.get(algo, 0) if algo is not None else 0)


def _inside(block: Buffer, whole: Buffer, rank: int) -> bool:
    """``block`` is exactly rank ``rank``'s block of ``whole`` (NCCL's in-place layout)."""
    return block.ptr == whole.ptr + rank * block.nbytes


def buffer_pair(mem: MemorySpace, rank: int, size: int, send: Any, recv: Any, what: str,
                ratio_send: int = 1, ratio_recv: int = 1) -> tuple[Buffer, Buffer, Any]:
    """``(send, recv, what to return)`` for a collective with a send and a recv buffer.

    ``recv=None`` means in place (``send`` is written). ``ratio_send : ratio_recv`` is the
    size ratio the collective needs (``1 : size`` for all_gather, ``size : 1`` for
    reduce_scatter). Overlap is refused unless the buffers are the same, or (all_gather,
    reduce_scatter) the smaller is this rank's block of the larger.
    """
    if recv is None:
        if ratio_send != ratio_recv:
            raise InvalidUsage(f"{what} needs a recv buffer")
        s = r = mem.adopt(send, "send", writable=True)
        return s, r, send
    s = mem.adopt(send, "send")
    r = mem.adopt(recv, "recv", writable=True)
    if s.dtype != r.dtype:
        raise InvalidUsage(f"{what}: send has dtype {s.dtype}, recv has {r.dtype}")
    if s.count * ratio_recv != r.count * ratio_send:
        if ratio_send > ratio_recv:  # reduce_scatter: the send side is the multiple
            need = f"send must hold {r.count * ratio_send // ratio_recv} ({size} x recv)"
        else:
            need = f"recv must hold {s.count * ratio_recv // ratio_send}"
            if ratio_recv > 1:
                need += f" ({size} x send)"
        raise InvalidUsage(f"{what}: send holds {s.count} elements and recv {r.count}; "
                           f"{need}")
    if not mem.same(s, r) and mem.overlaps(s, r) and not (
            (what == "all_gather" and _inside(s, r, rank))
            or (what == "reduce_scatter" and _inside(r, s, rank))):
        raise InvalidUsage(f"{what}: send and recv overlap without being the same buffer")
    return s, r, recv
