"""The interface between the sweep and a communication library."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._dtypes import ReduceOp
from ..buffers import Allocator, Buffer, host_buffer
from ..colls import Coll

__all__ = ["Backend", "Op", "OpArgs"]

#: One run of a collective; awaiting it issues the op (see :meth:`Backend.make_op`).
Op = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class OpArgs:
    """What one op works on: the backend's views of its buffers (from :meth:`Buffer.view`).

    In place, ``inp`` and ``out`` are views of one buffer, laid out as the collective's
    :class:`~acoll.perf.colls.InPlace` says (for a one-buffer collective, the same view).
    """

    inplace: bool
    inp: Any
    out: Any
    op: ReduceOp
    root: int


class Backend(ABC):
    """What a sweep needs from a library.

    Contract (every rank of a job runs the same sweep, so the same calls in the same order):

    * ``name`` labels results (the JSON ``backend``) and keys :attr:`Coll.na`;
      ``rank``/``size`` place this process; ``info`` holds the table header's ``backend``,
      ``net``, ``loop`` and ``chunk`` strings.
    * :meth:`open` runs once before anything else, :meth:`close` once after the sweep (also
      when it failed).
    * :meth:`alloc` gives the sweep's buffers; it goes through ``allocator``, the one place
      that decides where test memory lives.
    * :meth:`make_op` is asked only for collectives that list this backend and modes
      :meth:`Coll.has_form` allows; ``None`` still means "no such form" (an N/A column).
      Awaiting the op issues it once; device work may still be running afterwards until
      :meth:`sync`.
    * :meth:`unsupported` decides whether an exception from an op's first run means the
      mode is refused (N/A, the sweep goes on); it must decide alike on every rank and only
      for errors that leave the backend usable.
    * :meth:`barrier`, :meth:`all_reduce_scalar` and :meth:`broadcast_scalar` are
      collectives over all ranks (timing and the #wrong sum use them).
    """

    name: str
    rank: int
    size: int
    info: dict[str, str]

    def __init__(self, allocator: Allocator = host_buffer) -> None:
        self.allocator = allocator

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect whatever the backend measures with (after construction)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`open` and the constructor took."""

    def alloc(self, count: int, dtype: np.dtype[Any]) -> Buffer:
        """A buffer of ``count`` elements of ``dtype``."""
        return self.allocator(count, dtype)

    async def prepare(self, bufs: Sequence[Buffer]) -> str | None:
        """Collective: get the sweep's buffers ready before any op (e.g. register them);
        returns a note for the results when something did not work out."""
        return None

    @abstractmethod
    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        """The op that runs ``coll`` once on ``args``, or ``None`` if it has no such form."""

    def unsupported(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by an op's first run, means "mode not supported"."""
        return False

    @abstractmethod
    async def barrier(self) -> None:
        """Return once every rank got here."""

    @abstractmethod
    async def all_reduce_scalar(self, value: float, op: ReduceOp) -> float:
        """``value`` reduced over ranks with ``op`` (SUM, MAX or MIN)."""

    @abstractmethod
    async def broadcast_scalar(self, value: float) -> float:
        """Rank 0's ``value``."""

    async def sync(self) -> None:  # noqa: B027 - optional hook, nothing to wait for on host
        """Wait until issued device work is done (GPU backends)."""

    async def combine(self, value: float, how: str) -> float:
        """``value`` combined over ranks: ``max``, ``min``, ``sum``, ``avg`` or ``rank0``."""
        if self.size == 1:
            return value
        if how == "rank0":
            return await self.broadcast_scalar(value)
        op = {"max": ReduceOp.MAX, "min": ReduceOp.MIN}.get(how, ReduceOp.SUM)
        total = await self.all_reduce_scalar(value, op)
        return total / self.size if how == "avg" else total
