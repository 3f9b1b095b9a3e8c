"""CUDA device memory (CuPy): one :class:`CudaSpace` per GPU communicator.

CuPy is imported when a space is made, never when acoll is imported. Buffers are
:class:`DeviceView` objects, raw pointer views (CuPy has no bfloat16, and the kernels take
pointers anyway). Everything is *enqueued* on the space's own stream, a non-blocking stream
created on the space's device, so the methods return at once:

- ``reduce`` / ``finish_avg`` / ``scale``: the generated kernels of
  :mod:`acoll._cuda.kernels` (``scale_at_call`` enqueues AVG's scaling on a caller's
  stream);
- ``copy``: ``cudaMemcpyAsync``;
- ``settle``: waits for the stream without blocking the loop (a short yielding spin on an
  event, then the pipe signal of :mod:`acoll._cuda.completion`);
- ``staging()``: D2H/H2D copies through pooled page-locked host buffers, for transports that
  move host memory (:mod:`acoll._transport.staged`).

Several ranks of one process may drive different GPUs: every call that touches CUDA enters
``cupy.cuda.Device(k)`` for its synchronous part only, never across an ``await``.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .._config import get_logger
from .._cuda import CudaUnavailable, import_cupy
from .._cuda.completion import arm_stream
from .._cuda.kernels import launch_finish_avg, launch_reduce, launch_scale
from .._dtypes import (
    _CAPSULES,
    _DTYPE_IN_TENSOR,
    BFLOAT16,
    DTYPES,
    ReduceOp,
    _capsule_pointer,
    export_capsule,
)
from ..errors import AcollError, InvalidUsage
from .base import (
    Buffer,
    CopySignals,
    DType,
    Fence,
    MemoryKind,
    MemorySpace,
    Pace,
    SignalledStaging,
    StreamOrder,
)
from .host import HostSpace

__all__ = ["CudaSpace", "DeviceView", "adopt_device_array"]

log = get_logger("COLL")

#: Seconds a wait polls its event (yielding to the loop in between) before it arms the
#: pipe signal: small copies and kernels finish within it, at a few µs of latency.
SPIN_S = 100e-6
#: Seconds a small op's wait polls its event without yielding first (the loop is held that
#: long at most; an 8 B copy's round trip is about 10 us on an H200).
TIGHT_SPIN_S = 20e-6
_D2H, _H2D, _DEFAULT = 2, 1, 4  # cudaMemcpyKind


class DeviceView:
    """``size`` elements of ``dtype`` at device pointer ``ptr`` on ``device``.

    ``owner`` keeps the memory alive (a CuPy array or allocation, a DLPack capsule and its
    producer). Slices (step 1) are views sharing ``owner``.
    """

    __slots__ = ("device", "dtype", "owner", "ptr", "size")

    def __init__(self, ptr: int, size: int, dtype: DType, device: int, owner: Any) -> None:
        self.ptr, self.size, self.dtype, self.device, self.owner = ptr, size, dtype, device, owner

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * int(self.dtype.itemsize)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, items: slice) -> DeviceView:
        if not isinstance(items, slice):
            raise TypeError("DeviceView takes slices only")
        start, stop, step = items.indices(self.size)
        if step != 1:
            raise ValueError("DeviceView slices must be contiguous (step 1)")
        return DeviceView(self.ptr + start * self.itemsize, max(stop - start, 0), self.dtype,
                          self.device, self.owner)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        typestr = "<u2" if self.dtype == BFLOAT16 else self.dtype.str
        return {"shape": (self.size,), "typestr": typestr, "data": (self.ptr, False),
                "version": 3, "strides": None}

    def __repr__(self) -> str:
        return f"<DeviceView {self.size} x {self.dtype} at {self.ptr:#x} on cuda:{self.device}>"


# ------------------------------------------------------------------------ adopting arrays

_KDLCUDA, _KDLCUDAMANAGED = 2, 13
_DL_CODES = {0: "i", 1: "u", 2: "f"}
_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


assert _DLTensor.code.offset == _DTYPE_IN_TENSOR  # the layout _dtypes relies on too


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    """C- or Fortran-contiguous (``strides`` in bytes; ``None``: C-contiguous)."""
    if strides is None or int(np.prod(shape)) <= 1:
        return True
    for dims, strs in ((shape, strides), (shape[::-1], strides[::-1])):
        step, ok = itemsize, True
        for dim, stride in zip(reversed(dims), reversed(strs), strict=True):
            if dim != 1 and stride != step:
                ok = False
                break
            step *= dim
        if ok:
            return True
    return False


_SUPPORTED = frozenset(DTYPES)


def _checked(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
             dtype: np.dtype[Any], device: int, owner: Any, what: str) -> DeviceView:
    if dtype not in _SUPPORTED:
        raise InvalidUsage(f"{what} has dtype {dtype}, which is not supported")
    if strides is not None and not _contiguous(shape, strides, dtype.itemsize):
        raise InvalidUsage(f"{what} is not contiguous")
    return DeviceView(ptr, math.prod(shape), dtype, device, owner)


def _from_dlpack(obj: Any, what: str, writable: bool) -> DeviceView:
    capsule, name = export_capsule(obj, what, "cannot export it through DLPack")
    if name is None:
        raise InvalidUsage(f"{what}: its __dlpack__ returned no DLPack capsule")
    base = _capsule_pointer(capsule, name)
    if name == b"dltensor_versioned" and writable:
        flags = ctypes.c_uint64.from_address(base + _CAPSULES[name] - 8).value
        if flags & _READ_ONLY:
            raise InvalidUsage(f"{what} is read-only")
    t = _DLTensor.from_address(base + _CAPSULES[name])
    if t.device_type not in (_KDLCUDA, _KDLCUDAMANAGED):
        raise InvalidUsage(f"{what} is not in GPU memory (DLPack device type "
                           f"{t.device_type})")
    if t.lanes != 1 or (t.code not in _DL_CODES and (t.code, t.bits) != (4, 16)):
        raise InvalidUsage(f"{what} has an unsupported DLPack dtype (code {t.code}, "
                           f"{t.bits} bits)")
    dtype = BFLOAT16 if t.code == 4 else np.dtype(f"{_DL_CODES[t.code]}{t.bits // 8}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * dtype.itemsize
                                               for i in range(t.ndim))
    # The capsule (and obj) own the memory: keep both for as long as the view lives.
    return _checked(int(t.data or 0) + int(t.byte_offset), shape, strides, dtype,
                    int(t.device_id), (obj, capsule), what)


def _from_cai(obj: Any, what: str, writable: bool, cp: Any) -> DeviceView:
    cai = obj.__cuda_array_interface__
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise InvalidUsage(f"{what} is read-only")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    strides = cai.get("strides")
    device = -1
    if ptr:
        try:
            device = int(cp.cuda.runtime.pointerGetAttributes(ptr).device)
        except Exception as exc:
            raise InvalidUsage(f"{what}: its __cuda_array_interface__ pointer is not GPU "
                               f"memory: {exc}") from None
    return _checked(int(ptr), shape, None if strides is None else tuple(strides), dtype,
                    device, obj, what)


def adopt_device_array(obj: Any, what: str, *, writable: bool = False) -> DeviceView:
    """``obj`` (a :class:`DeviceView`, a CuPy array, anything with a CUDA ``__dlpack__`` or
    ``__cuda_array_interface__``) as a flat device view, without copying.

    Raises:
        InvalidUsage: naming ``what``: host memory, not contiguous, read-only where
            ``writable``, unsupported dtype.
    """
    if isinstance(obj, DeviceView):
        return obj
    cp = sys.modules.get("cupy") or import_cupy()  # (an import statement per call costs)
    if isinstance(obj, cp.ndarray):
        flags = obj.flags
        if not (flags.c_contiguous or flags.f_contiguous):
            raise InvalidUsage(f"{what} is not contiguous")
        dtype = obj.dtype
        if dtype not in _SUPPORTED:
            raise InvalidUsage(f"{what} has dtype {dtype}, which is not supported")
        data = obj.data
        device = getattr(data, "device_id", None)  # (cheaper than obj.device.id)
        return DeviceView(data.ptr, obj.size, dtype,
                          obj.device.id if device is None else device, obj)
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None and hasattr(obj, "__dlpack__"):
        try:
            kind, index = (int(v) for v in dev())
        except Exception:
            kind, index = -1, 0
        if kind in (_KDLCUDA, _KDLCUDAMANAGED):
            # Producers may export only on their current device (torch does).
            with cp.cuda.Device(index):
                return _from_dlpack(obj, what, writable)
    if hasattr(obj, "__cuda_array_interface__"):
        try:
            return _from_cai(obj, what, writable, cp)
        except (TypeError, AttributeError, RuntimeError) as exc:  # e.g. torch bf16
            raise InvalidUsage(f"{what}: bad __cuda_array_interface__: {exc}") from None
    raise InvalidUsage(f"{what} is in host memory ({type(obj).__name__}); a GPU "
                       "communicator needs GPU buffers (CuPy arrays, torch CUDA tensors, "
                       "or anything with __cuda_array_interface__ or a CUDA __dlpack__)")


# ------------------------------------------------------------------------ waiting for work

class _EventFence(Fence):
    """A recorded event of ``space``'s stream, taken from the space's pool: it goes back
    when the fence is dropped (nothing else holds the event, so nothing can wait on it
    any more; a pipe signal already armed captured its record).

    While the fence lives, the space holds its event too (``CudaSpace.fenced``): a fence
    dropped in a reference cycle goes when the cyclic collector runs, which finalizes
    everything only the garbage reaches, and CuPy destroys the CUDA event in
    ``Event.__del__``, perhaps before this ``__del__`` gave it back to the pool, which
    would then hand out a destroyed event (on an H100: segfaults in cuEventQuery and
    "context is destroyed", session 46)."""

    __slots__ = ("event", "space")

    def __init__(self, space: CudaSpace, event: Any) -> None:
        self.space, self.event = space, event
        space.fenced[id(event)] = event

    def __del__(self) -> None:
        space, event = self.space, self.event
        space.fenced.pop(id(event), None)
        space.give_event(event)

    def done(self) -> bool:
        return bool(self.event.done)

    async def wait(self, deadline: float | None = None) -> None:
        await self.space.wait_event(self.event, deadline)

    async def wait_soon(self, deadline: float | None = None) -> None:
        event = self.event
        end = time.perf_counter() + TIGHT_SPIN_S
        while not event.done:
            if time.perf_counter() >= end:
                await self.space.wait_event(event, deadline)
                return


class _StreamFence(Fence):
    """Everything queued on the caller's ``stream`` so far (a copy acoll just put there,
    while holding the loop: nothing can have been queued after it yet). Polled with
    ``cudaStreamQuery``, so the copy needs no event; one is recorded only for a wait that
    must sleep (or to outlive the call: :meth:`detached`), and then covers at least the
    copy. Queried with the space's device current: the default-stream handles (0, 2) name
    the *current* device's stream."""

    __slots__ = ("_keep", "space", "stream")

    def __init__(self, space: CudaSpace, stream: Any) -> None:
        self.space, self.stream = space, stream
        self._keep: _EventFence | None = None

    def done(self) -> bool:
        space = self.space
        runtime = space.cp.cuda.runtime
        prev = runtime.getDevice()
        if prev == space.device:
            return bool(self.stream.done)
        runtime.setDevice(space.device)
        try:
            return bool(self.stream.done)
        finally:
            runtime.setDevice(prev)

    def recorded(self) -> Any:
        """An event recorded on the stream now (pooled: it goes back with this fence).
        Called at most once per fence (a second call would give back the first event while
        a wait may still poll it)."""
        assert self._keep is None
        space = self.space
        with space.cp.cuda.Device(space.device):
            event = space.take_event()
            event.record(self.stream)
        self._keep = _EventFence(space, event)
        return event

    async def wait(self, deadline: float | None = None) -> None:
        if not self.done():
            await self.space.wait_event(self.recorded(), deadline)

    async def wait_soon(self, deadline: float | None = None) -> None:
        end = time.perf_counter() + TIGHT_SPIN_S
        while not self.done():
            if time.perf_counter() >= end:
                await self.space.wait_event(self.recorded(), deadline)
                return

    def detached(self) -> Fence:
        self.recorded()
        assert self._keep is not None
        return self._keep


class _Order(StreamOrder):
    """Events come from the space's pool: a wait on an event captures its last record at
    the time of the wait, so an event is reusable as soon as that wait was enqueued."""

    def __init__(self, space: CudaSpace, stream: Any, settle: bool) -> None:
        self.space, self.stream, self.settle = space, stream, settle
        with space.cp.cuda.Device(space.device):
            self.event: Any = space.take_event()
            self.event.record(stream)

    def start(self) -> None:
        space = self.space
        with space.cp.cuda.Device(space.device):
            space.stream.wait_event(self.event)
            space.join_left_behind()
        space.give_event(self.event)

    def finish(self) -> None:
        if self.settle:
            # The op waits for its work before it returns: the caller's later work cannot
            # overtake it, so the caller's stream needs no wait (three CUDA calls saved).
            return
        space = self.space
        with space.cp.cuda.Device(space.device):
            done = space.take_event()
            done.record(space.stream)
            self.stream.wait_event(done)
        space.give_event(done)


# ------------------------------------------------------------------------ the space

class CudaSpace(MemorySpace):
    """CUDA memory of ``device`` (see the module docstring). One per communicator: it
    holds that communicator's stream, scratch pool and pinned staging pool.

    Raises:
        CudaUnavailable: no CuPy. InvalidUsage: no such device.
    """

    kind = MemoryKind.CUDA

    def __init__(self, device: int) -> None:
        cp = import_cupy()
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as exc:  # no driver
            raise CudaUnavailable(f"no usable CUDA driver or device: {exc}") from None
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise InvalidUsage(f"device must be a CUDA device in [0, {count}), got {device!r}")
        self.cp = cp
        self.device = device
        self.ordinal = device  # the same, typed as an int
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._side = cp.cuda.Stream(non_blocking=True)  # carries pipe signals of waits
        self._pool: dict[int, Any] = {}
        self._staging: CudaStaging | None = None
        self._events: list[Any] = []  # idle events (see take_event)
        #: the last copy of the last direct op, which it did not wait for (on a caller's
        #: stream, or joined to it): the next op ordered on ``stream`` waits for it first
        #: (:meth:`CudaStaging.left_behind`, :meth:`join_left_behind`)
        self.left: _EventFence | None = None
        #: the events of live fences, by id (see :class:`_EventFence`)
        self.fenced: dict[int, Any] = {}

    def take_event(self) -> Any:
        """An idle timing-free event of this device (call under its device context); give
        it back with :meth:`give_event` once nothing will wait on its current record (an
        event never given back is simply dropped). Never give one back from a finalizer
        (``__del__``) unless the space holds it meanwhile, as :class:`_EventFence` does."""
        return self._events.pop() if self._events else self.cp.cuda.Event(
            block=False, disable_timing=True)

    def join_left_behind(self) -> None:
        """Order the space's stream after the last direct op's copies it did not wait
        for, if any are left (call under this device's context, as an op ordered on the
        stream starts). Ops of one communicator run in the same order on every rank, and
        that op's ring has ended: its copies end without any peer."""
        left = self.left
        if left is not None:
            self.left = None
            self.stream.wait_event(left.event)

    def idle_event(self) -> Any:
        """An idle event from the pool (see :meth:`take_event`), or ``None`` when it is
        empty (creating one needs this device's context: :meth:`take_event` then)."""
        return self._events.pop() if self._events else None

    def give_event(self, event: Any) -> None:
        if len(self._events) < 64:
            self._events.append(event)

    def __repr__(self) -> str:
        return f"cuda:{self.device} memory"

    # -- buffers
    def adopt(self, obj: Any, what: str, *, writable: bool = False) -> Buffer:
        try:
            view = adopt_device_array(obj, what, writable=writable)
        except AcollError:
            raise
        except Exception as exc:  # (the object's own buffer interface failed)
            raise InvalidUsage(f"{what}: reading it as a buffer raised {exc!r}") from exc
        if view.size and view.device != self.device:
            raise InvalidUsage(f"{what} is on cuda:{view.device}; this communicator uses "
                               f"cuda:{self.device}")
        return Buffer(view, self)

    def _alloc(self, nbytes: int) -> Any:
        # Allocated while our stream is current, so CuPy's pool hands the block to other
        # work only in our stream's order once it is freed.
        with self.cp.cuda.Device(self.device), self.stream:
            return self.cp.cuda.alloc(max(nbytes, 256))

    def empty(self, count: int, dtype: DType) -> Buffer:
        mem = self._alloc(count * dtype.itemsize)
        return Buffer(DeviceView(int(mem.ptr), count, dtype, self.ordinal, mem), self)

    def scratch(self, count: int, dtype: DType, slot: int = 0) -> Buffer:
        nbytes = count * dtype.itemsize
        mem = self._pool.get(slot)
        if mem is None or mem.mem.size < nbytes:
            mem = self._pool[slot] = self._alloc(nbytes)
        return Buffer(DeviceView(int(mem.ptr), count, dtype, self.ordinal, mem), self)

    # -- work (enqueued)
    async def reduce(self, out: Buffer, a: Buffer, b: Buffer, op: ReduceOp,
                     pace: Pace) -> None:
        with self.cp.cuda.Device(self.device):
            launch_reduce(out.ptr, a.ptr, b.ptr, out.count, op, out.dtype, self.stream)

    async def finish_avg(self, buf: Buffer, n: int, pace: Pace) -> None:
        with self.cp.cuda.Device(self.device):
            launch_finish_avg(buf.ptr, buf.count, n, buf.dtype, self.stream)

    async def copy(self, dst: Buffer, src: Buffer, pace: Pace) -> None:
        if dst.nbytes:
            with self.cp.cuda.Device(self.device):
                self.cp.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, dst.nbytes, _DEFAULT,
                                                 self.stream.ptr)

    async def scale(self, dst: Buffer, src: Buffer, n: int, pace: Pace) -> None:
        with self.cp.cuda.Device(self.device):
            launch_scale(dst.ptr, src.ptr, dst.count, n, dst.dtype, self.stream)

    def scale_at_call(self, stream: Any, dst: Buffer | None, src: Buffer, n: int) -> Buffer:
        """Enqueue AVG's scaling of ``src`` (``dst = src * 1/n``) on the caller's
        ``stream`` (as :meth:`resolve_stream` takes it) at the call, so that an op ordered
        on that stream later reads the scaled values; ``dst=None``: into new memory,
        allocated in that stream's order (CuPy's pool hands it to later work only after
        the caller's stream has passed it, and every op that reads it makes the caller's
        stream wait for the op's end). Returns ``dst`` (or the new buffer)."""
        caller = self.resolve_stream(stream)
        with self.cp.cuda.Device(self.device):
            if dst is None:
                with caller:
                    mem = self.cp.cuda.alloc(max(src.nbytes, 256))
                dst = Buffer(DeviceView(int(mem.ptr), src.count, src.dtype, self.ordinal,
                                        mem), self)
            launch_scale(dst.ptr, src.ptr, src.count, n, src.dtype, caller)
        return dst

    def pointer(self, buf: Buffer) -> int:
        return int(buf.array.ptr)

    def byte_view(self, buf: Buffer) -> memoryview:
        raise InvalidUsage("GPU memory has no host view; a transport that moves host "
                           "memory needs staging (acoll._transport.staged)")

    # -- completion and streams
    def record(self) -> Any:
        """A new event recorded on the space's stream now."""
        with self.cp.cuda.Device(self.device):
            event = self.cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        return event

    async def wait_event(self, event: Any, deadline: float | None = None) -> None:
        """Return once ``event`` has passed: poll it for up to :data:`SPIN_S`, yielding to
        the loop between polls, then sleep until the pipe signal (never blocks the loop)."""
        if event.done:
            return
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            await asyncio.sleep(0)
            if event.done:
                return
        with self.cp.cuda.Device(self.device):
            self._side.wait_event(event)
            signal = arm_stream(self._side, deadline=deadline,
                                what=f"GPU work on cuda:{self.device}")
        await signal

    def fence(self) -> Fence:
        """An event recorded on the space's stream now (the caller's work was ordered
        before it by :meth:`order`)."""
        with self.cp.cuda.Device(self.device):
            event = self.take_event()
            event.record(self.stream)
        return _EventFence(self, event)

    async def settle(self, deadline: float | None = None) -> None:
        with self.cp.cuda.Device(self.device):
            event = self.take_event()
            event.record(self.stream)
        await self.wait_event(event, deadline)
        self.give_event(event)  # not on error: a wait may still be queued on it

    def resolve_stream(self, stream: Any) -> Any:
        """``stream`` as a CuPy stream: ``None`` (CuPy's current stream on this device), a
        CuPy stream, a torch stream (``.cuda_stream``) or a raw ``cudaStream_t`` int.

        Raises:
            InvalidUsage: anything else.
        """
        cp = self.cp
        if stream is None:
            if cp.cuda.runtime.getDevice() == self.device:  # (no device switch needed)
                return cp.cuda.get_current_stream()
            with cp.cuda.Device(self.device):
                return cp.cuda.get_current_stream()
        if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            return stream
        handle = getattr(stream, "cuda_stream", stream)
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise InvalidUsage(f"stream= must be a CuPy stream, a torch stream or a "
                               f"cudaStream_t int, not {type(stream).__name__}")
        with cp.cuda.Device(self.device), warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream in favour of Stream.from_external, which
            # takes objects with __cuda_stream__, not the raw handle we have here.
            warnings.simplefilter("ignore", DeprecationWarning)
            return cp.cuda.ExternalStream(handle)

    def order(self, stream: Any) -> StreamOrder:
        return _Order(self, self.resolve_stream(stream), settle=stream is None)

    def staging(self) -> CudaStaging:
        if self._staging is None:
            self._staging = CudaStaging(self)
        return self._staging


class _StreamMemOps:
    """The driver's stream memory operations (``cuStreamWriteValue32`` and
    ``cuStreamWaitValue32`` from ``libcuda``, through ctypes: CuPy has no binding), which
    copy counters (:class:`~.base.CopySignals`) need."""

    WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
    WRITE_DEFAULT = 0x0  # (the write follows a memory fence: earlier copies are visible)

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")

        def entry(*names: str) -> Any:
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    return fn
            raise OSError(f"libcuda has none of {', '.join(names)}")

        self._write = entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._wait = entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        for fn in (self._write, self._wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._device_pointer = entry("cuMemHostGetDevicePointer_v2",
                                     "cuMemHostGetDevicePointer")
        self._device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                         ctypes.c_uint]

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} failed (CUresult {code})")

    def write(self, stream: int, addr: int, value: int) -> None:
        self._check(self._write(stream, addr, value, self.WRITE_DEFAULT), "cuStreamWriteValue32")

    def wait(self, stream: int, addr: int, value: int) -> None:
        self._check(self._wait(stream, addr, value, self.WAIT_GEQ), "cuStreamWaitValue32")

    def device_pointer(self, host_ptr: int) -> int:
        out = ctypes.c_uint64(0)
        self._check(self._device_pointer(ctypes.byref(out), host_ptr, 0),
                    "cuMemHostGetDevicePointer")
        return int(out.value)


_MEM_OPS: list[_StreamMemOps | None] = []  # (found once per process)


def _stream_mem_ops() -> _StreamMemOps | None:
    if not _MEM_OPS:
        try:
            _MEM_OPS.append(_StreamMemOps())
        except (OSError, AttributeError) as exc:
            log.info("GPU copies through the host: no stream memory operations (%s); "
                     "the native ring's copies go whole", exc)
            _MEM_OPS.append(None)
    return _MEM_OPS[0]


class CudaStaging(SignalledStaging):
    """D2H/H2D copies on the space's stream through pooled page-locked host memory."""

    kind = MemoryKind.CUDA

    def __init__(self, space: CudaSpace) -> None:
        super().__init__()
        self.space = space
        self.device = space.device
        self._host = HostSpace()
        self._signals: dict[int, CopySignals] = {}  # by block address
        self._spare: list[CopySignals] = []  # made, not yet given to a block
        self._signals_work: bool | None = None  # (None: not tried yet)
        self._side: Any = None  # the stream piecewise uploads wait on (made on first use)

    def signals(self, block: Buffer) -> CopySignals | None:
        found = self._signals.get(block.ptr)
        if found is not None or self._signals_work is False:
            return found
        ops = _stream_mem_ops()
        if ops is None:
            self._signals_work = False
            return None
        if not self._spare:
            try:
                self._spare = self._new_signals(ops)
            except RuntimeError as exc:
                log.info("GPU copies through the host: copy counters unavailable on "
                         "device %d (%s); the native ring's copies go whole",
                         self.space.device, exc)
                self._signals_work = False
                return None
        self._signals_work = True
        made = self._signals[block.ptr] = self._spare.pop()
        return made

    def _new_signals(self, ops: _StreamMemOps) -> list[CopySignals]:
        """A page of copy counters (32 pairs); the first time, checked: a value the device
        writes is seen here, and a wait that holds passes (on a stream of its own, idle
        but for these two operations: its synchronize returns at once)."""
        cp = self.space.cp
        with cp.cuda.Device(self.space.device):
            mem = cp.cuda.alloc_pinned_memory(4096)
            words = np.frombuffer(mem, np.uint32, 1024)  # (keeps mem alive)
            words[...] = 0
            dev = ops.device_pointer(int(words.ctypes.data))
            if self._signals_work is None:
                stream = cp.cuda.Stream(non_blocking=True)
                ops.write(stream.ptr, dev, 0x9E3779B9)
                ops.wait(stream.ptr, dev, 0x9E3779B9)
                stream.synchronize()
                if int(words[0]) != 0x9E3779B9:
                    raise RuntimeError("a value the device wrote did not arrive")
                words[0] = 0
        return [CopySignals(words[i * 32:(i + 1) * 32], dev + i * 128) for i in range(32)]

    def download_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                           pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        ops = _stream_mem_ops()
        assert ops is not None
        ready = signals.device_ptr + 4 * signals.READY

        def enqueue(runtime: Any, sp: int) -> None:
            for i, (a, b) in enumerate(pieces):
                runtime.memcpyAsync(dst.ptr + a, src.ptr + a, b - a, _D2H, sp)
                ops.write(sp, ready, signals.ready_value(i))

        return self._pieces_on(stream, enqueue)

    def upload_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                         pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        ops = _stream_mem_ops()
        assert ops is not None
        final = signals.device_ptr + 4 * signals.FINAL
        space = self.space
        if self._side is None:
            with space.cp.cuda.Device(space.device):
                self._side = space.cp.cuda.Stream(non_blocking=True)
        side = self._side

        def enqueue(runtime: Any, sp: int) -> None:
            after = space.take_event()
            after.record(stream)
            side.wait_event(after)
            space.give_event(after)  # (the wait took the event's state: reusable)
            for i, (a, b) in enumerate(pieces):
                ops.wait(side.ptr, final, signals.final_value(i))
                runtime.memcpyAsync(dst.ptr + a, src.ptr + a, b - a, _H2D, side.ptr)

        return self._pieces_on(side, enqueue)

    def join_on(self, stream: Any, fence: Fence) -> None:
        assert type(fence) is _EventFence
        self._on_device(lambda runtime: stream.wait_event(fence.event))

    def _pieces_on(self, stream: Any, enqueue: Callable[[Any, int], None]) -> Fence:
        """``enqueue(runtime, stream pointer)`` under the space's device, then an event
        (pooled) recorded on ``stream`` as the fence."""
        space = self.space

        def work(runtime: Any) -> Any:
            enqueue(runtime, stream.ptr)
            event = space.take_event()
            event.record(stream)
            return event

        return _EventFence(space, self._on_device(work))

    def _on_device(self, work: Callable[[Any], Any]) -> Any:
        """``work(runtime)`` with the space's device current (switched only when it is
        not, and back after)."""
        space = self.space
        runtime = space.cp.cuda.runtime
        prev = runtime.getDevice()
        if prev != space.device:
            runtime.setDevice(space.device)
        try:
            return work(runtime)
        finally:
            if prev != space.device:
                runtime.setDevice(prev)

    def _allocate(self, nbytes: int) -> Buffer:
        cp = self.space.cp
        with cp.cuda.Device(self.space.device):
            mem = cp.cuda.alloc_pinned_memory(nbytes)
        return self._host.wrap(np.frombuffer(mem, np.uint8, nbytes))  # keeps mem alive

    def _copy(self, dst: Buffer, src: Buffer, kind: int, order: StreamOrder | None = None,
              first: bool = False) -> Fence:
        """Enqueue one copy on the space's stream; with ``order`` (one of this space's),
        also the order's start before it (``first``) or its finish after it, all under one
        device context (the small GPU ops over the host: fewest CUDA calls)."""
        space = self.space
        with space.cp.cuda.Device(space.device):
            if first and order is not None:
                space.stream.wait_event(order.event)  # type: ignore[attr-defined]
                space.join_left_behind()
            if dst.nbytes:
                space.cp.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, dst.nbytes, kind,
                                                  space.stream.ptr)
            event = space.take_event()
            event.record(space.stream)
            if order is not None and not first and not order.settle:
                order.stream.wait_event(event)  # type: ignore[attr-defined]
        if first and order is not None:
            space.give_event(order.event)  # type: ignore[attr-defined]
        return _EventFence(space, event)

    def caller_stream(self, stream: Any) -> Any:
        return self.space.resolve_stream(stream)

    def left_behind(self, fence: Fence) -> None:
        assert type(fence) is _EventFence  # (own: an event that outlives the op)
        self.space.left = fence

    def download_on(self, stream: Any, dst: Buffer, src: Buffer,
                    after: Fence | None = None, *, own: bool = False) -> Fence:
        return self._copy_on(stream, dst, src, _D2H, after, own)

    def upload_on(self, stream: Any, dst: Buffer, src: Buffer, *, own: bool = False
                  ) -> Fence:
        return self._copy_on(stream, dst, src, _H2D, None, own)

    def _copy_on(self, stream: Any, dst: Buffer, src: Buffer, kind: int,
                 after: Fence | None, own: bool) -> Fence:
        """One copy on the caller's ``stream`` (after ``after``, an event fence, when it has
        not passed), switching the current device only when it is not the space's; with
        ``own``, an event recorded after it (pooled) is its fence."""
        space = self.space
        runtime = space.cp.cuda.runtime
        prev = runtime.getDevice()  # (cheaper than entering cupy.cuda.Device)
        if prev != space.device:
            runtime.setDevice(space.device)
        try:
            if type(after) is _EventFence and not after.done():
                stream.wait_event(after.event)
            runtime.memcpyAsync(dst.ptr, src.ptr, dst.nbytes, kind, stream.ptr)
            if own:
                event = space.take_event()
                event.record(stream)
        finally:
            if prev != space.device:
                runtime.setDevice(prev)
        return _EventFence(space, event) if own else _StreamFence(space, stream)

    def download_first(self, order: StreamOrder, dst: Buffer, src: Buffer) -> Fence:
        if type(order) is not _Order or order.space is not self.space:
            return super().download_first(order, dst, src)
        return self._copy(dst, src, _D2H, order, first=True)

    def upload_last(self, order: StreamOrder, dst: Buffer, src: Buffer) -> Fence:
        if type(order) is not _Order or order.space is not self.space:
            return super().upload_last(order, dst, src)
        return self._copy(dst, src, _H2D, order)

    def download(self, dst: Buffer, src: Buffer) -> Fence:
        return self._copy(dst, src, _D2H)

    def upload(self, dst: Buffer, src: Buffer) -> Fence:
        return self._copy(dst, src, _H2D)
