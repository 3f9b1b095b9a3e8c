"""Reduction ops, data types and buffer adaptation (host side).

:class:`ReduceOp` numbers match NCCL's ``ncclRedOp_t``. Host reductions use NumPy ufuncs
with ``out=`` into preallocated memory (no temporaries per chunk). Float16 and bfloat16
are reduced by converting each pair to float32, combining, and rounding back, as NCCL
does: NumPy's and ml_dtypes' own loops do that one element at a time (8 to 12 ns an
element for float16 on an AVX2 machine), so once the native library (``ring.c``, see
:mod:`acoll._native`) is loaded, :func:`combiner` and :func:`scale_into` hand arrays of a
few thousand 16-bit floats or more to its loops (F16C and AVX2 where the CPU has them),
which give the same bits (tests/test_native_halves.py compares every float16 and
bfloat16 value against NumPy's and ml_dtypes' results).

AVG follows NCCL: on floating-point dtypes every rank's input is first multiplied by
``1/n`` rounded to the dtype (:func:`avg_factor`, :func:`scale_into`) and the scaled inputs
are summed, so an average never overflows where the sum would; on integers the sum is
divided at the end, truncating toward zero (:func:`finish_avg`).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import mmap
import os
import queue
import threading
import time
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .errors import InvalidUsage

__all__ = ["AVG", "MAX", "MIN", "PROD", "SUM", "ReduceOp", "as_host_array", "dtype_code"]


class ReduceOp(enum.IntEnum):
    """Reduction operators (NCCL numbering). Strings like ``"sum"`` are accepted too."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4

    @classmethod
    def coerce(cls, op: ReduceOp | str | int) -> ReduceOp:
        """Turn ``op`` into a :class:`ReduceOp` or raise :class:`InvalidUsage`."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.strip().upper()]
            except KeyError:
                pass
        elif isinstance(op, int | np.integer) and not isinstance(op, bool):
            try:
                return cls(int(op))
            except ValueError:
                pass
        raise InvalidUsage(f"unknown reduction op {op!r}: use SUM, PROD, MAX, MIN or AVG")


SUM, PROD, MAX, MIN, AVG = ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: Wire codes of the supported dtypes (also the order tests iterate in).
DTYPES: dict[np.dtype[Any], int] = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2,
    np.dtype(np.uint32): 3, np.dtype(np.int64): 4, np.dtype(np.uint64): 5,
    np.dtype(np.float16): 6, BFLOAT16: 7, np.dtype(np.float32): 8, np.dtype(np.float64): 9,
}
DTYPE_BY_CODE = {code: dt for dt, code in DTYPES.items()}
DTYPE_NAMES = {dt: ("bfloat16" if dt == BFLOAT16 else dt.name) for dt in DTYPES}
_LOW_PRECISION = (np.dtype(np.float16), BFLOAT16)

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
}


#: What NumPy raises for an IEEE overflow or invalid operation (inf + -inf) under
#: ``np.seterr(all="raise")`` or with warnings turned into errors (``pytest -W error``).
#: By then ``out`` holds the whole result (NumPy checks the FPU flags after its loop), and
#: NCCL returns inf and NaN without complaint: reductions catch these and go on.
_FP_SIGNALS = (FloatingPointError, RuntimeWarning)


def _ieee(uf: Any) -> Any:
    """``uf(a, b, out=o)`` that returns ``o`` where NumPy would raise :data:`_FP_SIGNALS`."""
    def combine(a: Any, b: Any, out: Any) -> Any:
        try:
            return uf(a, b, out=out)
        except _FP_SIGNALS:
            return out

    return combine


def parse_dtype(name: str | np.dtype[Any] | type) -> np.dtype[Any]:
    """A supported dtype from a name (``float32``, ``bf16``, ``half``...) or dtype."""
    aliases = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
               "double": "float64", "int": "int32", "fp32": "float32", "fp64": "float64"}
    try:
        if isinstance(name, str):
            name = aliases.get(name.lower(), name.lower())
            dt = BFLOAT16 if name == "bfloat16" else np.dtype(name)
        else:
            dt = np.dtype(name)
    except TypeError as exc:
        raise InvalidUsage(f"unknown dtype {name!r}") from exc
    if dt not in DTYPES:
        raise InvalidUsage(f"dtype {dt} is not supported; use one of "
                           f"{', '.join(DTYPE_NAMES.values())}")
    return dt


def dtype_code(dt: np.dtype[Any]) -> int:
    """Wire code of a supported dtype; :class:`InvalidUsage` names unsupported ones."""
    code = DTYPES.get(dt)
    if code is None:
        raise InvalidUsage(f"dtype {dt} is not supported; use one of "
                           f"{', '.join(DTYPE_NAMES.values())}")
    return code


# ---------------------------------------------------------------- native 16-bit floats
#: wire code of each 16-bit float dtype (ring.c's DT_F16 / DT_BF16)
_HALF_CODES = {np.dtype(np.float16): 6, BFLOAT16: 7}
#: the fewest elements handed to the native loops: below, NumPy's own loop costs less
#: than the call (about 6 us: three array addresses and a ctypes call). Measured on the
#: 2-core VM: float16 1,024 elements 12 us in NumPy; bfloat16 8,192 elements 16 us.
_HALF_MIN = {np.dtype(np.float16): 1024, BFLOAT16: 8192}
_native_reduce: Any = None  # ring.c's acoll_nr_reduce, once loaded (use_native_halves)
_native_scale: Any = None


def use_native_halves(reduce_fn: Any, scale_fn: Any) -> None:
    """Hand 16-bit float arrays to the native library's ``acoll_nr_reduce`` and
    ``acoll_nr_scale`` from now on, in this process (``None``: NumPy's loops again).
    Called by :mod:`acoll._native` when it loads; the results are the same bits."""
    global _native_reduce, _native_scale
    _native_reduce, _native_scale = reduce_fn, scale_fn


def _flat_addresses(*arrays: Any) -> list[int] | None:
    """The arrays' data addresses when every one is a C-contiguous ndarray of the first's
    dtype and shape, the first (the output) is writeable and is each other one or lies
    apart from it; ``None`` otherwise (NumPy's loop then handles them as NumPy does,
    errors included)."""
    out = arrays[0]
    dt, shape = out.dtype, out.shape
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != dt or a.shape != shape or not (
                a.flags.c_contiguous):
            return None
    if not out.flags.writeable:
        return None
    addrs = [a.ctypes.data for a in arrays]
    po, nbytes = addrs[0], out.nbytes
    for pa in addrs[1:]:
        if pa != po and pa < po + nbytes and po < pa + nbytes:
            return None  # (partly overlapping: NumPy buffers it; the C loop would not)
    return addrs


@functools.cache
def combiner(op: ReduceOp, dt: np.dtype[Any]) -> Any:
    """A callable ``f(a, b, out=o)`` doing ``o[:] = a (op) b`` on arrays of ``dt`` as
    NumPy's ufunc for ``op`` does (SUM's for AVG's sum), with the same bits: the ufunc
    itself, or for 16-bit floats a function that hands large contiguous arrays to the
    native loops once they are loaded (:func:`use_native_halves`)."""
    uf = _UFUNCS[op]
    code = _HALF_CODES.get(dt)
    if code is None:
        return uf if dt.kind in "iub" else _ieee(uf)  # (integers raise no FP signals)
    uf = _ieee(uf)
    least, opcode = _HALF_MIN[dt], int(ReduceOp.SUM if op == ReduceOp.AVG else op)

    def combine(a: Any, b: Any, out: Any) -> Any:
        fn = _native_reduce
        if fn is not None and getattr(out, "size", 0) >= least and out.dtype == dt:
            addrs = _flat_addresses(out, a, b)
            if addrs is not None:
                fn(addrs[0], addrs[1], addrs[2], out.size, code, opcode)
                return out
        return uf(a, b, out=out)

    return combine


def reduce_into(out: npt.NDArray[Any], a: npt.NDArray[Any], b: npt.NDArray[Any],
                op: ReduceOp) -> None:
    """``out[:] = a (op) b`` elementwise, without temporaries. ``out`` may alias a or b."""
    if out.dtype in _HALF_CODES:
        combiner(op, out.dtype)(a, b, out=out)
        return
    try:
        _UFUNCS[op](a, b, out=out)
    except _FP_SIGNALS:
        pass  # (the IEEE result is in out)


def prescales(op: ReduceOp, dt: np.dtype[Any]) -> bool:
    """Whether ``op`` on ``dt`` scales each input by ``1/n`` before summing (NCCL's AVG on
    floating-point dtypes, its ``ncclDevPreMulSum``); integer AVG divides the sum."""
    return op == ReduceOp.AVG and (dt.kind == "f" or dt == BFLOAT16)


@functools.lru_cache(maxsize=256)
def avg_factor(dt: np.dtype[Any], n: int) -> Any:
    """``1/n`` as the scalar of ``dt`` that AVG multiplies each input by: ``1.0/n`` in
    double, rounded to float32, then to the 16-bit float (as NCCL rounds it)."""
    if dt == np.float64:
        return np.float64(1.0 / n)
    return dt.type(np.float32(1.0 / n))


def scale_into(dst: npt.NDArray[Any], src: npt.NDArray[Any], factor: Any) -> None:
    """``dst[:] = src * factor`` in ``dst``'s dtype (16-bit floats: the product of two
    16-bit values, exact in float32, rounded once). ``dst`` may be ``src``."""
    code = _HALF_CODES.get(dst.dtype)
    if code is None:
        _multiply(src, factor, out=dst)
        return
    # 16-bit floats: the factor is rounded to the dtype first on both paths (ml_dtypes
    # releases differ on whether bfloat16 * float promotes to float32).
    factor = dst.dtype.type(factor)
    fn = _native_scale
    if fn is not None and dst.size >= _HALF_MIN[dst.dtype]:
        addrs = _flat_addresses(dst, src)
        if addrs is not None:
            fn(addrs[0], addrs[1], dst.size, code, float(factor))
            return
    _multiply(src, factor, out=dst)


_multiply = _ieee(np.multiply)  # (AVG's factor <= 1: underflow, or inf * 0 = NaN)


def finish_avg(arr: npt.NDArray[Any], n: int) -> None:
    """Divide a sum by ``n`` in place (float32 for 16-bit floats, truncating for ints).

    Collectives use it for integer AVG only; floating-point AVG scales its inputs first
    (:func:`prescales`)."""
    if n == 1 or arr.size == 0:
        return
    if arr.dtype in _LOW_PRECISION:
        with np.errstate(all="ignore"):  # (collectives divide only integer sums here)
            arr[...] = (arr.astype(np.float32) / np.float32(n)).astype(arr.dtype)
    elif arr.dtype.kind == "f":
        with np.errstate(all="ignore"):
            np.divide(arr, arr.dtype.type(n), out=arr)
    elif arr.dtype.kind == "u":
        np.floor_divide(arr, arr.dtype.type(n), out=arr)
    else:  # C-style truncation toward zero, as NCCL's integer average
        wide = arr.astype(np.int64)
        q = wide // n  # floors; step back toward zero where a negative sum did not divide
        q += (wide < 0) & (q * n != wide)
        arr[...] = q.astype(arr.dtype)


def check_op_dtype(op: ReduceOp, dt: np.dtype[Any], coll: str) -> None:
    """Refuse combinations whose result would be silently wrong.

    AVG sums before dividing, in the buffer's own type: for 8-bit integers the sum wraps
    around after two or three ranks (the average of four 100s would be -28), so AVG is
    refused for int8 and uint8. Wider integers wrap too, but only past 2**31 (as NCCL).

    Raises:
        InvalidUsage: naming the op and dtype, and what to do instead.
    """
    if op == ReduceOp.AVG and dt.kind in "iu" and dt.itemsize == 1:
        raise InvalidUsage(f"{coll}: AVG on {dt} would wrap around while summing; "
                           "convert to a wider type (e.g. int32) or use SUM and divide")


def as_host_array(obj: Any, what: str, *, writable: bool = False) -> npt.NDArray[Any]:
    """A 1-D view (no copy) of a contiguous host buffer with a supported dtype.

    Accepts NumPy arrays, objects with ``__dlpack__`` on the CPU (torch tensors...,
    bfloat16 included: NumPy cannot import bf16 DLTensors, so they are viewed as uint16 and
    reinterpreted as ``ml_dtypes.bfloat16``), objects with ``__array_interface__``, and
    anything with the buffer protocol.

    Raises:
        InvalidUsage: not contiguous, read-only where ``writable``, a device buffer, or an
            unsupported dtype; the message names the argument (``what``).
    """
    if isinstance(obj, np.ndarray):
        # (a subclass as a plain array: np.matrix stays 2-D when reshaped, and its rows
        # would be sliced as blocks)
        arr = obj if type(obj) is np.ndarray else obj.view(np.ndarray)
    elif hasattr(obj, "__cuda_array_interface__"):
        raise InvalidUsage(f"{what} is a GPU buffer; this communicator moves host memory "
                           "(GPU buffers need a communicator created with device=...)")
    elif hasattr(obj, "__dlpack__"):
        arr = _from_dlpack(obj, what)
    elif hasattr(obj, "__array_interface__"):
        try:
            arr = np.asarray(obj)
        except (TypeError, ValueError) as exc:
            raise InvalidUsage(f"{what}: bad __array_interface__: {exc}") from exc
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError as exc:
            raise InvalidUsage(f"{what} is not a buffer (got {type(obj).__name__})") from exc
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidUsage(f"{what} is not contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidUsage(f"{what} is read-only")
    dtype_code(arr.dtype) if arr.dtype in DTYPES else _bad_dtype(arr.dtype, what)
    return arr.reshape(-1, order="A")


# DLPack (dlpack.h): DLDeviceType kDLCPU and DLDataTypeCode kDLUInt, kDLBfloat.
_KDLCPU, _KDLUINT, _KDLBFLOAT = 1, 1, 4
_PTR = ctypes.sizeof(ctypes.c_void_p)
# Offset of DLTensor.dtype in DLTensor: after void* data, DLDevice {int32, int32}, int32 ndim.
_DTYPE_IN_TENSOR = _PTR + 8 + 4
# Where the DLTensor starts in each capsule's struct: DLManagedTensor ("dltensor") begins
# with it; DLManagedTensorVersioned ("dltensor_versioned", DLPack >= 1.0) puts it after
# DLPackVersion {uint32, uint32}, void* manager_ctx, the deleter and uint64 flags.
_CAPSULES = {b"dltensor_versioned": 8 + 2 * _PTR + 8, b"dltensor": 0}


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Capsule:
    """Hands NumPy one already-exported DLPack capsule (the DLPack consumer protocol)."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **_kw: Any) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDLCPU, 0)


def export_capsule(obj: Any, what: str, failure: str) -> tuple[object, bytes | None]:
    """``obj.__dlpack__()`` (DLPack 1.0's versioned capsule when the producer can make one:
    it carries the read-only flag) and the capsule's name (``None``: not a DLPack capsule).

    Raises:
        InvalidUsage: the producer refused, as ``"{what}: {failure}: ..."``.
    """
    try:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0))
        except TypeError:  # a producer older than DLPack 1.0
            capsule = obj.__dlpack__()
    except (BufferError, TypeError, RuntimeError) as exc:
        raise InvalidUsage(f"{what}: {failure}: {exc}") from exc
    return capsule, next((n for n in _CAPSULES if _capsule_is_valid(capsule, n)), None)


def _from_dlpack(obj: Any, what: str) -> npt.NDArray[Any]:
    """View a CPU DLPack exporter as an array; bfloat16 through a uint16 relabelling."""
    try:
        device = obj.__dlpack_device__()
    except (AttributeError, TypeError, BufferError):
        device = None
    if device is not None and int(device[0]) != _KDLCPU:
        raise InvalidUsage(f"{what} is not in host memory (DLPack device {tuple(device)}); "
                           "this communicator moves host memory")
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as exc:
        first = exc
    # NumPy knows no bfloat16. Export a capsule ourselves (versioned if the producer can:
    # it carries the read-only flag); if it holds bf16, mark it uint16 (same size; the
    # producer's deleter never reads the dtype) and let NumPy import that.
    capsule, name = export_capsule(obj, what, "cannot view it as host memory")
    if name is None:
        raise InvalidUsage(f"{what}: cannot view it as host memory: {first}") from first
    tensor = _capsule_pointer(capsule, name) + _CAPSULES[name]
    dtype = _DLDataType.from_address(tensor + _DTYPE_IN_TENSOR)
    if (dtype.code, dtype.bits, dtype.lanes) != (_KDLBFLOAT, 16, 1):
        raise InvalidUsage(f"{what}: cannot view it as host memory: {first}") from first
    dtype.code = _KDLUINT
    relabelled: Any = _Capsule(capsule)
    try:
        raw = np.from_dlpack(relabelled)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise InvalidUsage(f"{what}: cannot view it as host memory: {exc}") from exc
    return raw.view(BFLOAT16)


def _bad_dtype(dt: np.dtype[Any], what: str) -> None:
    raise InvalidUsage(f"{what} has dtype {dt}, which is not supported; use one of "
                       f"{', '.join(DTYPE_NAMES.values())}")


_MMAP_MIN = 1 << 20
_unmap_lock = threading.Lock()
_unmap_queue: queue.SimpleQueue[mmap.mmap] | None = None  # (this process's: _unmap_pid)
_unmap_pid = 0


def empty_bytes(nbytes: int) -> npt.NDArray[np.uint8]:
    """An uninitialised byte array whose pages are faulted in as they are first written.

    From 1 MiB on it is an anonymous ``mmap`` (4 KiB pages), not ``np.empty``: NumPy
    madvises large arrays for transparent huge pages, and the first write to each 2 MiB
    then zeroes (and may compact memory for) a whole huge page inside one call — a stall
    of up to milliseconds in whichever loop callback touches it first. Unmapping many
    small pages is slow too (about 0.3 ms per MiB), so when the array is collected its
    mapping is released on a thread of its own (``munmap`` runs without the GIL). The
    array's finalizer only puts the mapping on a :class:`queue.SimpleQueue` (reentrant:
    a collection can run it while its thread holds any lock, ``concurrent.futures``'
    included, as ``ThreadPoolExecutor.submit`` would take).
    """
    if nbytes < _MMAP_MIN:
        return np.empty(nbytes, np.uint8)
    _start_unmapper()
    mm = mmap.mmap(-1, nbytes)
    arr = np.frombuffer(mm, np.uint8)
    weakref.finalize(arr, _unmap_later, mm).atexit = False
    return arr


def _start_unmapper() -> None:
    """This process's unmapping thread (one more after a fork: the parent's is not here)."""
    global _unmap_queue, _unmap_pid
    pid = os.getpid()
    if _unmap_pid == pid:
        return
    with _unmap_lock:
        if _unmap_pid != pid:
            todo: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
            try:
                threading.Thread(target=_unmap_forever, args=(todo,), name="acoll-unmap",
                                 daemon=True).start()
            except RuntimeError:  # (interpreter shutdown: mappings are dropped in place)
                return
            _unmap_queue, _unmap_pid = todo, pid


def _after_fork_in_child() -> None:
    global _unmap_lock
    _unmap_lock = threading.Lock()  # (a fork while another thread held it)


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _unmap_later(mm: mmap.mmap) -> None:
    """(The finalizer: takes no lock.) In a child forked after the array was made, the
    mapping is dropped here instead, and unmapped when the array lets go of it."""
    todo = _unmap_queue
    if todo is not None and _unmap_pid == os.getpid():
        todo.put(mm)


def _unmap_forever(todo: queue.SimpleQueue[mmap.mmap]) -> None:
    while True:
        _unmap(todo.get())


def _unmap(mm: mmap.mmap) -> None:
    for _ in range(1000):  # the array may still be finishing its deallocation
        try:
            mm.close()
            return
        except BufferError:
            time.sleep(0.001)


def byte_view(arr: npt.NDArray[Any]) -> memoryview:
    """A flat unsigned-byte memoryview of a contiguous array (no copy)."""
    # ndarray.data is memoryview(arr); numpy only types __buffer__ for Python >= 3.12.
    if arr.size and arr.flags.c_contiguous:
        try:
            return arr.data.cast("B")  # (the fast way; not for every dtype)
        except (TypeError, ValueError, NotImplementedError):
            pass
    return (arr.view(np.uint8).reshape(-1) if arr.size else np.empty(0, np.uint8)).data
