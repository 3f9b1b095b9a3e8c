"""Buffers and memory spaces: what algorithms and transports see of user memory.

A :class:`Buffer` is a contiguous, one-dimensional run of ``count`` elements of one dtype,
living in one :class:`MemorySpace`. Slicing a buffer (``buf[i:j]``, in elements) gives a
buffer in the same space. The space owns every operation on its memory, so algorithms
never call NumPy (or CuPy) themselves:

- ``adopt(obj, what)``: a user's array as a buffer, or :class:`~acoll.InvalidUsage` naming
  ``what`` (argument adaptation);
- ``scratch(count, dtype, slot)``: pooled work memory, ``empty``: fresh memory;
- ``reduce`` / ``finish_avg`` / ``copy``: arithmetic and copies, awaited. They *start* the
  work; on a synchronous space (host) it is finished when the await returns, on an
  asynchronous one (a GPU stream) it is only ordered, and :meth:`MemorySpace.settle`
  returns once everything started so far is done. Who hands a buffer to something outside
  the space's ordering (a host-memory transport reading a device buffer) settles first;
- ``overlaps`` / ``same``: aliasing checks between buffers of the space.

Long operations are cut into pieces with ``pace`` between them (an awaitable that yields
to the event loop when the caller's step budget is spent), so that no single loop step
runs for long whatever the size.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import numpy as np

from .._dtypes import ReduceOp

__all__ = ["BYTE", "Buffer", "DType", "MemoryKind", "MemorySpace", "Pace"]

#: Element types are NumPy dtypes in every space (CuPy uses them too).
DType = np.dtype[Any]
BYTE: DType = np.dtype(np.uint8)

#: Called between pieces of long work: returns an awaitable that yields to the loop when
#: the caller's step is due (see :meth:`acoll._coll.base.OpContext.checkpoint`).
Pace = Callable[[], Awaitable[None]]


class MemoryKind(enum.Enum):
    """Where memory lives; transports declare which kinds they can move."""

    HOST = "host"
    CUDA = "cuda"


class Buffer:
    """``count`` elements of ``dtype`` at ``ptr``, in ``space``; slice with ``buf[i:j]``.

    ``array`` is the space's native array object (a NumPy array on the host); only the
    space's own code looks inside it.
    """

    __slots__ = ("array", "space")

    def __init__(self, array: Any, space: MemorySpace) -> None:
        self.array = array
        self.space = space

    def __getitem__(self, items: slice) -> Buffer:
        return Buffer(self.array[items], self.space)

    @property
    def count(self) -> int:
        return int(self.array.size)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def itemsize(self) -> int:
        return int(self.array.itemsize)

    @property
    def dtype(self) -> DType:
        return self.array.dtype  # type: ignore[no-any-return]

    @property
    def ptr(self) -> int:
        return self.space.pointer(self)

    @property
    def kind(self) -> MemoryKind:
        return self.space.kind

    def view(self) -> memoryview:
        """The bytes as a flat writable-if-possible memoryview (host memory only)."""
        return self.space.byte_view(self)

    def __repr__(self) -> str:
        return f"<Buffer {self.count} x {self.dtype} in {self.space}>"


class MemorySpace(ABC):
    """The operations on one kind of memory (one device). See the module docstring.

    Attributes:
        kind: the memory kind of every buffer of this space.
        device: the device ordinal (``None`` for host memory).
    """

    kind: ClassVar[MemoryKind]
    device: int | None = None

    @abstractmethod
    def adopt(self, obj: Any, what: str, *, writable: bool = False) -> Buffer:
        """``obj`` (a user's array) as a buffer of this space, without copying.

        Raises:
            InvalidUsage: naming ``what``: wrong space or device, not contiguous, read-only
                where ``writable``, unsupported dtype.
        """

    @abstractmethod
    def empty(self, count: int, dtype: DType) -> Buffer:
        """New, uninitialised memory for ``count`` elements."""

    @abstractmethod
    def scratch(self, count: int, dtype: DType, slot: int = 0) -> Buffer:
        """Work memory from a pool: the same ``slot`` reuses (and grows) one allocation, so
        a buffer from slot ``k`` is valid until the next ``scratch(..., slot=k)``."""

    @abstractmethod
    async def reduce(self, out: Buffer, a: Buffer, b: Buffer, op: ReduceOp,
                     pace: Pace) -> None:
        """``out = a (op) b`` elementwise; ``out`` may be ``a`` or ``b``."""

    @abstractmethod
    async def finish_avg(self, buf: Buffer, n: int, pace: Pace) -> None:
        """Divide a sum of ``n`` contributions by ``n`` in place (NCCL's AVG rules)."""

    @abstractmethod
    async def copy(self, dst: Buffer, src: Buffer, pace: Pace) -> None:
        """``dst = src`` (same count and dtype)."""

    async def settle(self) -> None:  # noqa: B027 - synchronous spaces have nothing to wait
        """Return once every operation started on this space so far has finished."""

    @abstractmethod
    def pointer(self, buf: Buffer) -> int:
        """The address of ``buf``'s first byte."""

    @abstractmethod
    def byte_view(self, buf: Buffer) -> memoryview:
        """``buf``'s bytes as a flat memoryview (raises InvalidUsage off the host)."""

    def same(self, a: Buffer, b: Buffer) -> bool:
        """``a`` and ``b`` are the same memory (address and size)."""
        return a.ptr == b.ptr and a.nbytes == b.nbytes

    def overlaps(self, a: Buffer, b: Buffer) -> bool:
        """``a`` and ``b`` share at least one byte."""
        if not a.nbytes or not b.nbytes:
            return False
        pa, pb = a.ptr, b.ptr
        return pa < pb + b.nbytes and pb < pa + a.nbytes
