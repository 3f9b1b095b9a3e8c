"""The collectives ``acoll-perf`` measures: every per-collective rule in one table.

Like nccl-tests' ``testColl`` structs, one frozen :class:`Coll` per collective says how a
test of ``nbytes`` bytes sizes its buffers, how busbw follows from algbw, what the in-place
form looks like, whether the op takes a reduction op and a root, where each output element
comes from (the result check), and which backends have no form of a mode. The sweep, the
check, the command line and the backends consult :data:`COLLS` instead of testing names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["COLLECTIVES", "COLLS", "Coll", "Extent", "InPlace", "Usage", "Where",
           "bus_factor", "counts"]


class Usage(Exception):
    """A command-line or environment problem: ``acoll-perf`` exits 2 with the message."""


#: A buffer's length for a test of ``count = nbytes // itemsize`` elements on ``n`` ranks:
#: ``count``; ``block``: ``count // n`` (one rank's share); ``blocks``: ``(count // n) * n``
#: (one block per rank); ``none``: 0 (no data).
Extent = Literal["count", "block", "blocks", "none"]

Idx = npt.NDArray[np.int64]


class InPlace(enum.Enum):
    """How the in-place form lays input and output into one buffer (nccl-tests' offsets)."""

    NONE = "no in-place form"
    SAME = "input and output start at the same element"
    INPUT_AT_RANK = "the input is block `rank` of the output (all_gather)"
    OUTPUT_AT_RANK = "the output is block `rank` of the input (reduce_scatter)"

    def offsets(self, rank: int, block: int) -> tuple[int, int]:
        """``(input, output)`` element offsets into the shared buffer."""
        at = rank * block
        return (at if self is InPlace.INPUT_AT_RANK else 0,
                at if self is InPlace.OUTPUT_AT_RANK else 0)


class Where(NamedTuple):
    """The checked rank's view: its rank, the job size, the root and the op's count."""

    rank: int
    nranks: int
    root: int
    block: int


#: Output element ``j`` of a rank is input element ``idx`` of rank ``src`` (``src`` may be an
#: array, one rank per element); ``src is None``: every rank's element ``idx``, reduced.
Source = Callable[[Idx, Where], "tuple[int | Idx | None, Idx]"]


@dataclass(frozen=True)
class Coll:
    """One collective's rules.

    Attributes:
        name: the command-line name.
        bus: busbw/algbw for ``n`` ranks (nccl-tests' PERFORMANCE.md).
        send, recv: the send and receive buffers' lengths (see :data:`Extent`); a test's
            size column is the larger one, in bytes.
        param: the op's count argument (the table's count column).
        inplace: the in-place form's layout, or :attr:`InPlace.NONE`.
        reduces: takes a reduction op (else the redop column reads ``none``).
        rooted: takes a root (else the root column reads -1).
        source: where output element ``j`` comes from (checked against it); ``None``: the
            output is not checked (barrier).
        min_ranks: fewest ranks it runs on.
        root_only: only the root's output is defined (and checked).
        one_buffer: the backends' call takes one buffer (the output); out-of-place runs it
            on the output buffer after the root copies its input there.
        dtype: a fixed element type (``-d`` is ignored), or ``None``.
        backends: the backends that measure it; the first one is acoll's side, the others
            are what ``--vs`` may name.
        na: ``(backend, inplace)`` modes that backend has no form of: printed as N/A.
    """

    name: str
    bus: Callable[[int], float]
    send: Extent
    recv: Extent
    param: Extent
    inplace: InPlace
    reduces: bool
    rooted: bool
    source: Source | None
    min_ranks: int = 1
    root_only: bool = False
    one_buffer: bool = False
    dtype: str | None = None
    backends: tuple[str, ...] = ("acoll", "gloo", "nccl", "mpi")
    na: frozenset[tuple[str, bool]] = frozenset()

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int, int]:
        """``(send, recv, param)`` element counts for a test of ``nbytes`` bytes."""
        count = nbytes // itemsize
        block = count // nranks
        length = {"count": count, "block": block, "blocks": block * nranks, "none": 0}
        return length[self.send], length[self.recv], length[self.param]

    @property
    def sized(self) -> bool:
        """Whether the op moves data (else the sweep has the one size 0)."""
        return self.param != "none"

    def has_form(self, backend: str, inplace: bool) -> bool:
        """Whether ``backend`` has this mode (out of place always, unless :attr:`na` says)."""
        if inplace and self.inplace is InPlace.NONE:
            return False
        return (backend, inplace) not in self.na

    def check_ranks(self, nranks: int, root: int) -> None:
        """Raise :class:`Usage` unless the op runs on ``nranks`` ranks with ``root``."""
        if nranks < self.min_ranks:
            raise Usage(f"{self.name} needs at least {self.min_ranks} ranks "
                        f"(use -N {self.min_ranks})")
        if self.rooted and not 0 <= root < nranks:
            raise Usage(f"-r {root}: root must be in [0, {nranks})")


def _ring(n: int) -> float:  # all_reduce: reduce-scatter then all-gather
    return 2.0 * (n - 1) / n


def _share(n: int) -> float:  # every rank moves all but its own block
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


def _same(j: Idx, w: Where) -> tuple[None, Idx]:
    return None, j


def _own_block(j: Idx, w: Where) -> tuple[None, Idx]:
    return None, w.rank * w.block + j


def _from_root(j: Idx, w: Where) -> tuple[int, Idx]:
    return w.root, j


def _gathered(j: Idx, w: Where) -> tuple[Idx, Idx]:
    b = max(w.block, 1)
    return j // b, j % b


def _exchanged(j: Idx, w: Where) -> tuple[Idx, Idx]:
    b = max(w.block, 1)
    return j // b, w.rank * w.block + j % b


def _from_prev(j: Idx, w: Where) -> tuple[int, Idx]:
    return (w.rank - 1) % w.nranks, j


_TORCH_OUT_OF_PLACE_ONLY = frozenset({("gloo", True), ("nccl", True)})

#: Every collective, in the order ``--help`` lists them.
COLLS: dict[str, Coll] = {c.name: c for c in (
    # name, busbw factor, send, recv, count argument, in-place layout; then the rest by name
    Coll("all_reduce", _ring, "count", "count", "count", InPlace.SAME,
         reduces=True, rooted=False, source=_same),
    Coll("broadcast", _one, "count", "count", "count", InPlace.SAME,
         reduces=False, rooted=True, source=_from_root, one_buffer=True),
    Coll("reduce", _one, "count", "count", "count", InPlace.SAME,
         reduces=True, rooted=True, source=_same, root_only=True),
    Coll("all_gather", _share, "block", "blocks", "block", InPlace.INPUT_AT_RANK,
         reduces=False, rooted=False, source=_gathered),
    # MPI's in-place Reduce_scatter_block leaves the result at the buffer's start
    Coll("reduce_scatter", _share, "blocks", "block", "block", InPlace.OUTPUT_AT_RANK,
         reduces=True, rooted=False, source=_own_block, na=frozenset({("mpi", True)})),
    # torch's all_to_all_single has no in-place form
    Coll("all_to_all", _share, "blocks", "blocks", "block", InPlace.SAME,
         reduces=False, rooted=False, source=_exchanged, na=_TORCH_OUT_OF_PLACE_ONLY),
    # send to the ring successor, receive from the predecessor, as one group
    Coll("sendrecv", _one, "count", "count", "count", InPlace.SAME,
         reduces=False, rooted=False, source=_from_prev, min_ranks=2,
         na=_TORCH_OUT_OF_PLACE_ONLY),
    Coll("barrier", _one, "none", "none", "none", InPlace.NONE,
         reduces=False, rooted=False, source=None),
    # the raw TCP ceiling: one full-duplex ring step over plain sockets
    Coll("tcp", _one, "count", "count", "count", InPlace.NONE,
         reduces=False, rooted=False, source=_from_prev, min_ranks=2, dtype="uint8",
         backends=("tcp",)),
)}
COLLECTIVES = tuple(COLLS)


def bus_factor(coll: str, nranks: int) -> float:
    """nccl-tests' busbw/algbw factor for ``coll`` on ``nranks`` ranks."""
    return COLLS[coll].bus(nranks)


def counts(coll: str, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int, int]:
    """``(send, recv, param)`` element counts of ``coll`` for a test of ``nbytes`` bytes."""
    return COLLS[coll].counts(nbytes, itemsize, nranks)
