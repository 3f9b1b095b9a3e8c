"""A stand-in for the few CuPy calls acoll's CUDA space makes, over host memory.

Installed as ``sys.modules["cupy"]`` by a test, it lets :class:`acoll._memory.cuda.CudaSpace`
and its staging run unchanged on a CPU: "device" allocations are NumPy buffers tagged with
the device current when they were made, copies are ``memmove``, streams and events are
bookkeeping (events are always done), kernels are replaced by the host reduction on the
same pointers. It checks what a CPU can: every enqueue happens under the right device,
pointers belong to the device the space was made for, and the data flow is right.
"""

from __future__ import annotations

import ctypes
import threading
import types
import weakref
from typing import Any

import numpy as np

from acoll._dtypes import avg_factor, finish_avg, reduce_into, scale_into

NDEV = 2


class _CurrentDevice(threading.local):
    """The current device, per thread as in CUDA (acoll calls CuPy from threads of its own
    since session 55: a global here let one thread's ``with Device(...)`` show through in
    another's checks)."""

    def __init__(self) -> None:
        self.device = 0

    def __getitem__(self, _index: int) -> int:
        return self.device

    def __setitem__(self, _index: int, device: int) -> None:
        self.device = device


_current = _CurrentDevice()
_owner: dict[int, tuple[int, int]] = {}  # allocation start -> (size, device)
_keep: list[Any] = []
enqueued: list[tuple[str, int]] = []  # (what, device current when it was enqueued)
copies_on: list[int] = []  # the stream handle of each memcpyAsync
# (stream handle, the stream's device, the device current when it was queried): handle 0,
# the default stream, names the *current* device's stream in CUDA
stream_queries: list[tuple[int, int, int]] = []


def _device_of(ptr: int) -> int:
    # (a copy: a finalizer freeing an allocation may run during the loop, in this
    # thread or another, and change the dict; found on the 16-core host, session 57)
    for start, (size, dev) in reversed(_owner.copy().items()):
        if start <= ptr < start + max(size, 1):
            return dev
    raise ValueError(f"{ptr:#x} is not fake device memory")


class Device:
    def __init__(self, device: int = -1) -> None:
        self.id = _current[0] if device < 0 else device
        self._prev: list[int] = []

    def __enter__(self) -> Device:
        self._prev.append(_current[0])
        _current[0] = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _current[0] = self._prev.pop()

    def synchronize(self) -> None:
        pass


class _Streams:
    count = 0x1000


class Stream:
    _stack: list[Any] = []

    def __init__(self, non_blocking: bool = False, ptr: int | None = None,
                 device_id: int = -1) -> None:
        _Streams.count += 1
        self.ptr = _Streams.count if ptr is None else ptr
        self.device_id = _current[0] if device_id < 0 else device_id
        self.waits: list[Event] = []
        self.busy = False  # set by a test: work queued on it has not finished

    def wait_event(self, event: Event) -> None:
        self.waits.append(event)
        enqueued.append(("wait_event", _current[0]))

    @property
    def done(self) -> bool:
        stream_queries.append((self.ptr, self.device_id, _current[0]))
        return not self.busy

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Stream:
        Stream._stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        Stream._stack.pop()


class ExternalStream(Stream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__(ptr=ptr, device_id=device_id)


_null: dict[int, Stream] = {}


def get_current_stream(device_id: int = -1) -> Stream:
    if Stream._stack:
        return Stream._stack[-1]
    dev = _current[0] if device_id < 0 else device_id
    if dev not in _null:
        _null[dev] = Stream(ptr=0, device_id=dev)
    return _null[dev]


class Event:
    """As CuPy's: the CUDA event is destroyed in ``__del__`` (which the cyclic collector
    calls for everything only garbage reaches, even an object a finalizer then revives);
    using it after that is an error here (on a GPU: a crash or a destroyed context)."""

    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.recorded_on: Stream | None = None
        self.destroyed = False

    def __del__(self) -> None:
        self.destroyed = True

    def _alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("use of a destroyed CUDA event")

    def record(self, stream: Stream | None = None) -> None:
        self._alive()
        self.recorded_on = stream
        enqueued.append(("record", _current[0]))

    @property
    def done(self) -> bool:
        self._alive()
        return self.recorded_on is None or not self.recorded_on.busy


class _Allocation:
    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(max(nbytes, 1), np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        self.mem = types.SimpleNamespace(size=nbytes)
        self.device_id = _current[0]
        _owner[self.ptr] = (nbytes, self.device_id)
        weakref.finalize(self, _owner.pop, self.ptr, None)  # freed: the range may be reused


def alloc(nbytes: int) -> _Allocation:
    return _Allocation(nbytes)


def alloc_pinned_memory(nbytes: int) -> bytearray:
    return bytearray(nbytes)


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:
        return NDEV

    @staticmethod
    def getDevice() -> int:
        return _current[0]

    @staticmethod
    def setDevice(device: int) -> None:
        assert 0 <= device < NDEV
        _current[0] = device

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        if kind in (2, 3, 4):  # from the device
            assert _device_of(src) == _current[0], "copy from memory of another device"
        if kind in (1, 3, 4):
            assert _device_of(dst) == _current[0], "copy into memory of another device"
        enqueued.append(("memcpy", _current[0]))
        copies_on.append(stream)
        ctypes.memmove(dst, src, size)

    @staticmethod
    def pointerGetAttributes(ptr: int) -> Any:
        return types.SimpleNamespace(device=_device_of(ptr), type=2)


class ndarray:  # CuPy's name
    """A 1-D "device" array (NumPy memory registered as device memory)."""

    def __init__(self, arr: np.ndarray[Any, Any], device: int | None = None,
                 base: _Allocation | None = None) -> None:
        if base is None:
            with Device(_current[0] if device is None else device):
                base = _Allocation(arr.nbytes)
            np.copyto(base.buf[:arr.nbytes].view(arr.dtype).reshape(arr.shape), arr)
            arr = base.buf[:arr.nbytes].view(arr.dtype).reshape(arr.shape)
        self.arr, self.base = arr, base
        self.data = types.SimpleNamespace(ptr=int(arr.ctypes.data) if arr.size else base.ptr,
                                          device_id=base.device_id)
        self.device = Device(base.device_id)
        self.flags = arr.flags
        self.size, self.dtype = arr.size, arr.dtype

    def __getitem__(self, items: Any) -> ndarray:
        return ndarray(self.arr[items], base=self.base)

    def get(self) -> np.ndarray[Any, Any]:
        return self.arr.copy()


def _array(ptr: int, count: int, dtype: Any) -> np.ndarray[Any, Any]:
    nbytes = count * np.dtype(dtype).itemsize
    if not nbytes:
        return np.empty(0, dtype)
    assert _device_of(ptr) == _current[0], "kernel on memory of another device"
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), np.uint8).view(dtype)


def launch_reduce(out: int, a: int, b: int, count: int, op: Any, dtype: Any,
                  stream: Any = None) -> None:
    enqueued.append(("reduce", _current[0]))
    reduce_into(_array(out, count, dtype), _array(a, count, dtype), _array(b, count, dtype), op)


def launch_finish_avg(ptr: int, count: int, n: int, dtype: Any, stream: Any = None) -> None:
    enqueued.append(("finish_avg", _current[0]))
    if n > 1:
        finish_avg(_array(ptr, count, dtype), n)


def launch_scale(out: int, a: int, count: int, n: int, dtype: Any, stream: Any = None
                 ) -> None:
    enqueued.append(("scale", _current[0]))
    scale_into(_array(out, count, dtype), _array(a, count, dtype), avg_factor(dtype, n))


def module() -> types.ModuleType:
    """The fake ``cupy`` module."""
    cp = types.ModuleType("cupy")
    cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
        alloc=alloc, alloc_pinned_memory=alloc_pinned_memory, runtime=_Runtime,
        get_current_stream=get_current_stream)
    cp.cuda = cuda  # type: ignore[attr-defined]
    cp.ndarray = ndarray  # type: ignore[attr-defined]
    return cp
