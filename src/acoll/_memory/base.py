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
- ``overlaps`` / ``same``: aliasing checks between buffers of the space;
- ``order(stream)``: how an op fits into the caller's stream (device spaces);
- ``staging()``: the copy primitives that carry this space's buffers over a transport that
  moves host memory only (device spaces; see :class:`Staging`).

Long operations are cut into pieces with ``pace`` between them (an awaitable that yields
to the event loop when the caller's step budget is spent), so that no single loop step
runs for long whatever the size.
"""

from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import numpy as np

from .._dtypes import ReduceOp
from .._offloop import in_thread
from ..errors import InvalidUsage

__all__ = ["BYTE", "Buffer", "CopySignals", "DType", "Fence", "MemoryKind", "MemorySpace",
           "Pace", "DirectStaging", "SignalledStaging", "Staging", "StreamOrder"]

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

    __slots__ = ("_ptr", "_view", "array", "owned", "space")

    def __init__(self, array: Any, space: MemorySpace, owned: bool = False) -> None:
        self.array = array
        self.space = space
        #: acoll's own memory (a space's scratch), never a user's: a transport may let a
        #: receive into it be written a moment after the receive ended (a thread's read)
        self.owned = owned
        self._ptr = -1  # cached: an array's address and bytes do not move under it
        self._view: memoryview | None = None

    def __getitem__(self, items: slice) -> Buffer:
        return Buffer(self.array[items], self.space, self.owned)

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
        ptr = self._ptr
        if ptr < 0:
            ptr = self._ptr = self.space.pointer(self)
        return ptr

    @property
    def kind(self) -> MemoryKind:
        return self.space.kind

    def view(self) -> memoryview:
        """The bytes as a flat writable-if-possible memoryview (host memory only)."""
        view = self._view
        if view is None:
            view = self._view = self.space.byte_view(self)
        return view

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

    @abstractmethod
    async def scale(self, dst: Buffer, src: Buffer, n: int, pace: Pace) -> None:
        """``dst = src * (1/n)`` on a floating-point dtype, the factor rounded as
        :func:`acoll._dtypes.avg_factor` rounds it (AVG's scaling of one rank's input);
        ``dst`` may be ``src``."""

    def scale_at_call(self, stream: Any, dst: Buffer | None, src: Buffer, n: int
                      ) -> Buffer | None:
        """Where the space has streams: enqueue :meth:`scale` on the caller's ``stream``
        now, at the call (``dst=None``: into new memory), and return the buffer scaled.
        ``None`` (the default, host memory): nothing done; the op scales when it starts.

        Raises:
            InvalidUsage: ``stream`` is not one this space understands.
        """
        return None

    async def settle(self, deadline: float | None = None) -> None:  # noqa: B027
        """Return once every operation started on this space so far has finished (never
        blocking the loop). ``deadline``: loop time; past it, :class:`acoll.TimeoutError`.
        Synchronous spaces have nothing to wait for."""

    def fence(self) -> Fence | None:
        """A fence that passes once every operation started on this space so far has
        finished (``None``: a synchronous space, nothing is pending). For what reads or
        writes the space's memory outside its ordering (a NIC through GPUDirect RDMA)."""
        return None

    def order(self, stream: Any) -> StreamOrder | None:
        """Capture, at call time, the caller's place in ``stream`` for one op.

        ``None`` (the default, host memory) means there is no stream to order against.

        Raises:
            InvalidUsage: ``stream`` was given to a space without streams, or is not a
                stream this space understands.
        """
        if stream is not None:
            raise InvalidUsage("stream= needs a GPU communicator (init_rank(..., device=k))")
        return None

    def staging(self) -> Staging | None:
        """The staging primitives for this space's buffers (``None``: host memory, which
        every transport moves)."""
        return None

    @abstractmethod
    def pointer(self, buf: Buffer) -> int:
        """The address of ``buf``'s first byte."""

    @abstractmethod
    def byte_view(self, buf: Buffer) -> memoryview:
        """``buf``'s bytes as a flat memoryview (raises InvalidUsage off the host)."""

    def same(self, a: Buffer, b: Buffer) -> bool:
        """``a`` and ``b`` are the same memory (address and size)."""
        if a is b or a.array is b.array:
            return True
        return a.ptr == b.ptr and a.nbytes == b.nbytes

    def overlaps(self, a: Buffer, b: Buffer) -> bool:
        """``a`` and ``b`` share at least one byte."""
        if not a.nbytes or not b.nbytes:
            return False
        pa, pb = a.ptr, b.ptr
        return pa < pb + b.nbytes and pb < pa + a.nbytes


class StreamOrder(ABC):
    """One op's place in the caller's stream (see :meth:`MemorySpace.order`).

    Made when the op is called (it records the caller's queued work then); :meth:`start`
    runs before the op's first memory work, :meth:`finish` after its last. ``settle``
    says whether the op must also wait until its work is done before returning (no
    ``stream=`` given: the result must be readable when the await returns).
    """

    settle: bool = True

    @abstractmethod
    def start(self) -> None:
        """Order the space's later work after the caller's work queued at call time."""

    @abstractmethod
    def finish(self) -> None:
        """Order the caller's later work after everything the space has queued so far
        (an order that settles may skip it: the op returns only once that work is done)."""


class Fence(ABC):
    """The completion of one enqueued copy (a recorded event)."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the copy has finished (a query; never blocks)."""

    @abstractmethod
    async def wait(self, deadline: float | None = None) -> None:
        """Return once the copy has finished, without blocking the loop.

        Raises:
            acoll.TimeoutError: not finished at ``deadline`` (loop time).
        """

    async def wait_soon(self, deadline: float | None = None) -> None:
        """:meth:`wait` for a copy expected to finish within microseconds (a small op's):
        a space may first poll it for a few microseconds without yielding."""
        await self.wait(deadline)

    def detached(self) -> Fence:
        """This fence, in a form that stays valid after the call returns (one that polls
        a caller's stream becomes one on an event of its own: the caller may destroy
        the stream)."""
        return self


#: Page-locked blocks this large or larger are allocated off the loop's thread.
ALLOCATE_IN_THREAD = 1 << 20


class Staging(ABC):
    """Copies between one device space and host memory, for host-memory transports.

    ``download`` and ``upload`` *enqueue* a copy after all work queued on the space so
    far and return its :class:`Fence`; work the space queues later sees an upload's data.
    Host buffers come from a pool (:meth:`lease`): one is reused only after the fence it
    was released with has passed, so a copy still reading or writing it is never raced.
    """

    #: The device memory kind whose buffers this staging carries.
    kind: ClassVar[MemoryKind] = MemoryKind.CUDA
    #: The device (ordinal) whose buffers it carries (transports that can move that
    #: device's memory themselves look at it: GPUDirect RDMA).
    device: int | None = None

    def __init__(self) -> None:
        # Per size class, blocks in release order. Their fences may be on different
        # streams (the space's, callers'), so a pending one does not hold back the rest.
        self._free: dict[int, deque[tuple[Buffer, Fence | None]]] = {}
        self.leased = 0  # host buffers handed out over the pool's life (for tests)

    @abstractmethod
    def _allocate(self, nbytes: int) -> Buffer:
        """New host memory (page-locked where that matters) of ``nbytes`` bytes."""

    @abstractmethod
    def download(self, dst: Buffer, src: Buffer) -> Fence:
        """Enqueue ``dst`` (host) ``= src`` (device); same byte count."""

    @abstractmethod
    def upload(self, dst: Buffer, src: Buffer) -> Fence:
        """Enqueue ``dst`` (device) ``= src`` (host); same byte count."""

    def download_first(self, order: StreamOrder, dst: Buffer, src: Buffer) -> Fence:
        """An op's first work: :meth:`StreamOrder.start` of ``order``, then
        :meth:`download` (a space may do both at once)."""
        order.start()
        return self.download(dst, src)

    def upload_last(self, order: StreamOrder, dst: Buffer, src: Buffer) -> Fence:
        """An op's last work: :meth:`upload`, then :meth:`StreamOrder.finish` of
        ``order`` (a space may do both at once)."""
        fence = self.upload(dst, src)
        order.finish()
        return fence

    def lease(self, nbytes: int) -> tuple[Buffer, Buffer]:
        """``(view, block)``: a host buffer of ``nbytes`` bytes (``view``) inside a pooled
        ``block``; give ``block`` back with :meth:`release`."""
        size = _size_class(nbytes)
        block = self._reuse(size)
        return self._lent(nbytes, self._allocate(size) if block is None else block)

    async def lease_async(self, nbytes: int) -> tuple[Buffer, Buffer]:
        """:meth:`lease`, but a new block of :data:`ALLOCATE_IN_THREAD` bytes or more is
        allocated on a worker thread: page-locking tens of MiB takes milliseconds, which
        the event loop's thread must not spend."""
        size = _size_class(nbytes)
        block = self._reuse(size)
        if block is None and size >= ALLOCATE_IN_THREAD:
            block = await in_thread(functools.partial(self._allocate, size))
        return self._lent(nbytes, self._allocate(size) if block is None else block)

    def lease_now(self, nbytes: int) -> tuple[Buffer, Buffer] | None:
        """:meth:`lease` if that needs no new block of :data:`ALLOCATE_IN_THREAD` bytes
        or more; else ``None`` (then :meth:`lease_async`)."""
        size = _size_class(nbytes)
        block = self._reuse(size)
        if block is None:
            if size >= ALLOCATE_IN_THREAD:
                return None
            block = self._allocate(size)
        return self._lent(nbytes, block)

    def _reuse(self, size: int) -> Buffer | None:
        free = self._free.get(size)
        if not free:
            return None
        for i, (block, fence) in enumerate(free):
            if fence is None or fence.done():
                del free[i]
                return block
        return None

    def _lent(self, nbytes: int, block: Buffer) -> tuple[Buffer, Buffer]:
        self.leased += 1
        return block[:nbytes], block

    def release(self, block: Buffer, fence: Fence | None = None) -> None:
        """Return ``block`` to the pool; it is reused once ``fence`` (if any) has passed."""
        self._free.setdefault(block.nbytes, deque()).append((block, fence))


class DirectStaging(Staging):
    """A staging whose copies can also go on the caller's own stream (a small op made
    while nothing else runs: no events between streams; ``acoll._comm.via_host``)."""

    @abstractmethod
    def caller_stream(self, stream: Any) -> Any:
        """``stream`` (a collective's ``stream=``) as this staging's copies take it."""

    @abstractmethod
    def download_on(self, stream: Any, dst: Buffer, src: Buffer,
                    after: Fence | None = None, *, own: bool = False) -> Fence:
        """Enqueue ``dst`` (host) ``= src`` on the caller's ``stream`` itself (after its
        queued work, and after ``after``, an earlier copy's fence).

        The fence may also cover work queued on ``stream`` later (a query of the stream:
        the cheapest for one small copy); with ``own`` it covers this copy and what was
        queued before it only (pieces awaited one by one while later ones are queued), and
        stays valid whatever becomes of the stream."""

    @abstractmethod
    def upload_on(self, stream: Any, dst: Buffer, src: Buffer, *, own: bool = False
                  ) -> Fence:
        """Enqueue ``dst`` (device) ``= src`` (host) on the caller's ``stream``; later work
        on it sees the data. ``own`` as for :meth:`download_on`."""

    def left_behind(self, fence: Fence) -> None:
        """A direct op ended without waiting for its last copy (``fence``, own, covering
        every copy it put on the caller's stream): the next op ordered on this staging's
        own stream must wait for it first. A call made on the same stream while that op
        ran was ordered after the stream's work *at its call*, before those copies were
        queued, so nothing else puts it after them. Here nothing: copies are not on
        streams of their own (override where they are)."""


class CopySignals:
    """Two 32-bit counters in page-locked host memory that a pooled block's copies and the
    native ring (``ring.c``'s staged all-reduce) share: the device's stream bumps
    ``ready`` once per download piece landed, the ring bumps ``final`` once per piece of
    the result that is final, and the stream waits on ``final`` before each upload.

    ``words``: 32 words of host memory (the counters in separate cache lines), which the
    device reaches at ``device_ptr`` (their first word). Values count from the bases
    :meth:`begin` takes and compare cyclically, so the counters are never reset."""

    READY, FINAL = 0, 16  # word offsets

    def __init__(self, words: np.ndarray[Any, Any], device_ptr: int) -> None:
        assert words.dtype == np.uint32
        assert words.size >= 32
        self.words = words
        self.device_ptr = device_ptr
        self.ready_base = self.final_base = 0
        self.uploads = 0

    @property
    def ready_addr(self) -> int:
        return int(self.words.ctypes.data) + 4 * self.READY

    @property
    def final_addr(self) -> int:
        return int(self.words.ctypes.data) + 4 * self.FINAL

    def begin(self, uploads: int) -> None:
        """A new op on the block, with ``uploads`` upload pieces: the bases are the
        counters' values now (the block's previous copies have all passed)."""
        self.ready_base = int(self.words[self.READY])
        self.final_base = int(self.words[self.FINAL])
        self.uploads = uploads

    def ready_value(self, i: int) -> int:
        """``ready`` once download piece ``i`` (from 0) has landed."""
        return (self.ready_base + i + 1) & 0xFFFFFFFF

    def final_value(self, i: int) -> int:
        """``final`` once upload piece ``i`` (from 0) may go."""
        return (self.final_base + i + 1) & 0xFFFFFFFF

    def release(self) -> None:
        """Let every upload of the op go (its ring failed or never ran: the stream must
        not wait forever; the uploads then carry whatever the block holds)."""
        self.words[self.FINAL] = self.final_value(self.uploads - 1)


class SignalledStaging(DirectStaging):
    """A direct staging whose device streams can bump and wait on host counters
    (:class:`CopySignals`): a staged native all-reduce's copies run on the caller's stream
    beside the ring, each download piece read by the ring once landed and each piece of
    the result uploaded once final, with nothing awaited from the loop in between."""

    @abstractmethod
    def signals(self, block: Buffer) -> CopySignals | None:
        """The copy counters of pooled ``block`` (made on first use, kept with it), or
        ``None`` where the device cannot bump and wait on host counters from its streams
        (then copies go whole, awaited from the loop)."""

    @abstractmethod
    def download_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                           pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        """Enqueue ``dst[a:b] = src[a:b]`` for each byte range ``(a, b)`` of ``pieces`` on
        the caller's ``stream``, in order, each followed by bumping ``signals``' ready
        counter to :meth:`CopySignals.ready_value` of its index; the fence is the last
        one's (own, as :meth:`download_on` with ``own``)."""

    @abstractmethod
    def upload_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                         pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        """Enqueue, for each byte range ``(a, b)`` of ``pieces`` in order, after the work
        queued on the caller's ``stream`` so far: wait until ``signals``' final counter
        reaches :meth:`CopySignals.final_value` of its index, then ``dst[a:b] =
        src[a:b]``; the fence is the last one's (own). The waits go on a stream of the
        staging's own, never the caller's: another rank of the process may queue work on
        that stream that this op's ring needs first (its downloads). :meth:`join_on` then
        orders the caller's stream after them."""

    @abstractmethod
    def join_on(self, stream: Any, fence: Fence) -> None:
        """Later work on the caller's ``stream`` waits for ``fence`` (of
        :meth:`upload_pieces_on`); called once the uploads' waits are all met or
        released."""


def _size_class(nbytes: int) -> int:
    """The pooled block size for ``nbytes``: a power of two, at least a page."""
    return max(4096, 1 << (nbytes - 1).bit_length())
