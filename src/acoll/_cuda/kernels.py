"""Elementwise reduction kernels for GPU buffers, generated as CUDA C++ and run through CuPy.

Contract (the same as the host path in :mod:`acoll._dtypes`, bit for bit):

- ``reduce_into(out, a, b, op)``: ``out[i] = a[i] (op) b[i]``; ``out`` may alias ``a`` or
  ``b``. AVG runs the SUM kernel; the caller finishes with ``finish_avg(arr, n)``.
- Integers wrap modulo 2**bits (computed in unsigned arithmetic, so no C++ overflow).
- float16 / bfloat16: each pair is widened to float32, combined with IEEE round-to-nearest
  intrinsics and rounded back to nearest-even (``__float2half_rn`` / ``__float2bfloat16_rn``).
- MAX / MIN propagate NaN like ``np.maximum`` / ``np.minimum``: a NaN in ``a`` wins, else a
  NaN in ``b``; on ties (``-0.0`` vs ``+0.0``) float16 keeps ``a`` (NumPy's half loop) and the
  other floats keep ``b`` (NumPy's SIMD loops and ml_dtypes).
- ``finish_avg``: floats divide with IEEE division (16-bit floats in float32), integers
  truncate toward zero. Collectives use it for integer AVG only.
- ``scale_into(out, a, n)``: ``out[i] = a[i] * f`` with ``f`` = ``1/n`` rounded as
  :func:`acoll._dtypes.avg_factor` rounds it (floating-point dtypes): floating-point AVG
  scales each rank's input so, then sums (NCCL's ``PreMulSum``).

No compiler flag can change these results: float32 arithmetic and comparisons are explicit
non-flushing PTX (CuPy forces ``-ftz=true`` on NVRTC), float64 uses ``__d*_rn`` intrinsics,
and ``--fmad=false`` is passed as well.

One source exists per (kernel, dtype, vectorised): the vectorised form moves 16 bytes per
load/store when ``out``, ``a`` and ``b`` share the same offset modulo 16 (elements before
the first 16-byte boundary and after the last are done one by one); otherwise the scalar
form runs. Both use grid-stride loops and no scratch memory.
Element functions and kernel bodies are ``__host__ __device__`` so tests can run the same
code on a CPU (see ``tests/test_cuda_kernels.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import DTYPE_NAMES, DTYPES, ReduceOp, avg_factor, parse_dtype
from ..errors import InvalidUsage
from . import import_cupy

__all__ = [
    "NVRTC_OPTIONS", "THREADS", "KernelSource", "all_sources", "finish_avg",
    "finish_avg_source", "get_kernel", "launch_finish_avg", "launch_reduce", "launch_scale",
    "reduce_into", "reduce_source", "scale_into", "scale_source",
]

#: Threads per block, blocks per multiprocessor (at most), 16-byte vectors per thread and
#: grid-stride step (loads issued before the first use).
THREADS = 512
BLOCKS_PER_SM = 4
UNROLL = 4
VEC_BYTES = 16
#: Options that pin the arithmetic (for NVRTC through CuPy; nvcc takes the same spelling).
#: CuPy appends ``-ftz=true`` after these; the sources do not depend on it (see
#: ``_float_helper``).
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=false", "--prec-div=true")

_REDUCE_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN)


@dataclass(frozen=True)
class _CType:
    ctype: str
    family: str  # "int", "uint", "float" (fp32/fp64) or "half" (fp16/bf16, via float32)
    include: str | None = None
    to_f: str = ""  # half: widen to float
    from_f: str = ""  # half: round float to the type (nearest-even)
    max_tie_keeps_a: bool = False


_CTYPES: dict[str, _CType] = {
    "int8": _CType("signed char", "int"),
    "uint8": _CType("unsigned char", "uint"),
    "int32": _CType("int", "int"),
    "uint32": _CType("unsigned int", "uint"),
    "int64": _CType("long long", "int"),
    "uint64": _CType("unsigned long long", "uint"),
    "float16": _CType("__half", "half", "cuda_fp16.h", "__half2float", "__float2half_rn",
                      max_tie_keeps_a=True),
    "bfloat16": _CType("__nv_bfloat16", "half", "cuda_bf16.h", "__bfloat162float",
                       "__float2bfloat16_rn"),
    "float32": _CType("float", "float"),
    "float64": _CType("double", "float"),
}


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel: ``code`` is a complete NVRTC/nvcc translation unit.

    ``body`` is ``code`` without its ``#include`` lines (so several bodies can share one
    translation unit inside separate namespaces). The kernel is ``extern "C"`` ``name``;
    its ``__host__ __device__`` body is ``acoll_body`` with the kernel's parameters plus
    ``(tid, nthreads)``. Parameters: reduce ``(T* out, const T* a, const T* b, u64 n,
    u64 head)``; finish_avg ``(T* x, u64 n, u64 head, D divisor)``; scale ``(T* out,
    const T* a, u64 n, D factor)``; ``D`` = ``divisor_type``.
    """

    name: str
    kind: str  # "reduce", "finish_avg" or "scale"
    op: ReduceOp | None
    dtype: np.dtype[Any]
    vectorised: bool
    includes: tuple[str, ...]
    body: str
    divisor_type: str = ""

    @property
    def code(self) -> str:
        return "".join(f"#include <{h}>\n" for h in self.includes) + self.body

    @property
    def elems_per_vec(self) -> int:
        return VEC_BYTES // self.dtype.itemsize


def _dtype_name(dtype: Any) -> tuple[np.dtype[Any], str]:
    dt = parse_dtype(dtype)
    return dt, DTYPE_NAMES[dt]


_PTX_BINARY = {"add": "add.rn.f32", "mul": "mul.rn.f32", "div": "div.rn.f32"}
_C_BINARY = {"add": "+", "mul": "*", "div": "/"}
_C_CMP = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_HD = "static __host__ __device__ __forceinline__"


def _float_helper(nm: str, wide: str) -> str:
    """``acoll_<nm>(x, y)`` in ``wide`` (float or double): add, mul, div, or the
    comparisons gt, ge, lt, le; plus ``acoll_isnan``.

    CuPy appends ``-ftz=true`` to every NVRTC compile, which would flush float32
    subnormals in arithmetic and comparisons. So on the device float32 uses explicit
    non-ftz PTX instructions (round-to-nearest-even; ``div.rn`` is IEEE division) and a
    bit test for NaN; float64 is never flushed and uses the ``_rn`` intrinsics (immune to
    contraction). On the host (CPU emulation in tests) plain IEEE C++ arithmetic.
    """
    if nm == "isnan":
        dev = ("return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;" if wide == "float"
               else "return x != x;")
        return (f"{_HD} bool acoll_isnan({wide} x) {{\n#ifdef __CUDA_ARCH__\n  {dev}\n"
                f"#else\n  return x != x;\n#endif\n}}\n")
    if nm in _C_CMP:
        if wide == "float":
            dev = ("unsigned int r;\n  asm(\"{ .reg .pred p; setp."
                   f"{nm}.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }}\" : \"=r\"(r) "
                   ": \"f\"(x), \"f\"(y));\n  return r != 0;")
        else:
            dev = f"return x {_C_CMP[nm]} y;"
        return (f"{_HD} bool acoll_{nm}({wide} x, {wide} y) {{\n#ifdef __CUDA_ARCH__\n"
                f"  {dev}\n#else\n  return x {_C_CMP[nm]} y;\n#endif\n}}\n")
    if wide == "float":
        dev = (f"float r;\n  asm(\"{_PTX_BINARY[nm]} %0, %1, %2;\" : \"=f\"(r) "
               ": \"f\"(x), \"f\"(y));\n  return r;")
    else:
        dev = f"return __d{nm}_rn(x, y);"
    return (f"{_HD} {wide} acoll_{nm}({wide} x, {wide} y) {{\n#ifdef __CUDA_ARCH__\n"
            f"  {dev}\n#else\n  return x {_C_BINARY[nm]} y;\n#endif\n}}\n")


def _bits_code(ct: _CType, itemsize: int) -> str:
    """``S`` (unsigned storage of T's size), ``acoll_from(S) -> T``, ``acoll_to(T) -> S``."""
    storage = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
               8: "unsigned long long"}[itemsize]
    head = f"typedef {storage} S;\n"
    if ct.family in ("int", "uint"):
        return (head + f"{_HD} T acoll_from(S s) {{ return (T)s; }}\n"
                f"{_HD} S acoll_to(T t) {{ return (S)t; }}\n")
    dev_from, dev_to = {
        "float": ("__uint_as_float(s)", "__float_as_uint(t)"),
        "double": ("__longlong_as_double((long long)s)", "(S)__double_as_longlong(t)"),
        "__half": ("__ushort_as_half(s)", "__half_as_ushort(t)"),
        "__nv_bfloat16": ("__ushort_as_bfloat16(s)", "__bfloat16_as_ushort(t)"),
    }[ct.ctype]
    return (head
            + f"{_HD} T acoll_from(S s) {{\n#ifdef __CUDA_ARCH__\n  return {dev_from};\n"
            "#else\n  T t;\n  __builtin_memcpy((void*)&t, &s, sizeof t);\n  return t;\n"
            "#endif\n}\n"
            f"{_HD} S acoll_to(T t) {{\n#ifdef __CUDA_ARCH__\n  return {dev_to};\n"
            "#else\n  S s;\n  __builtin_memcpy(&s, (const void*)&t, sizeof s);\n  return s;\n"
            "#endif\n}\n")


def _op_code(ct: _CType, itemsize: int, op: ReduceOp) -> tuple[str, str]:
    """(helpers, element function ``T acoll_op(T a, T b)``)."""
    sig = f"{_HD} T acoll_op(T a, T b)"
    if ct.family in ("int", "uint"):
        wide = "unsigned long long" if itemsize == 8 else "unsigned int"
        expr = {
            ReduceOp.SUM: f"(T)(({wide})a + ({wide})b)",
            ReduceOp.PROD: f"(T)(({wide})a * ({wide})b)",
            ReduceOp.MAX: "a > b ? a : b",
            ReduceOp.MIN: "a < b ? a : b",
        }[op]
        return "", f"{sig} {{ return {expr}; }}\n"
    wide = ct.ctype if ct.family == "float" else "float"
    if ct.family == "float":
        fa, fb, wrap = "a", "b", "{}"
    else:
        fa, fb, wrap = f"{ct.to_f}(a)", f"{ct.to_f}(b)", ct.from_f + "({})"
    if op in (ReduceOp.SUM, ReduceOp.PROD):
        fn = "add" if op == ReduceOp.SUM else "mul"
        return (_float_helper(fn, wide),
                f"{sig} {{ return {wrap.format(f'acoll_{fn}({fa}, {fb})')}; }}\n")
    cmp = ("g" if op == ReduceOp.MAX else "l") + ("e" if ct.max_tie_keeps_a else "t")
    # NaN in a -> a; NaN in b (a not NaN) -> the comparison is false -> b. Selects the
    # original bits, so NaN payloads and signed zeros pass through unchanged.
    return (_float_helper("isnan", wide) + _float_helper(cmp, wide),
            f"{sig} {{\n  const {wide} x = {fa}, y = {fb};\n"
            f"  return (acoll_isnan(x) || acoll_{cmp}(x, y)) ? a : b;\n}}\n")


def _finish_code(ct: _CType) -> tuple[str, str, str]:
    """(helpers, ``T acoll_fin(T x, D d)``, D)."""
    sig = f"{_HD} T acoll_fin(T x, D d)"
    if ct.family == "int":
        return "", f"{sig} {{ return (T)((long long)x / d); }}\n", "long long"
    if ct.family == "uint":
        return "", f"{sig} {{ return (T)((unsigned long long)x / d); }}\n", \
            "unsigned long long"
    if ct.family == "float":
        return (_float_helper("div", ct.ctype),
                f"{sig} {{ return acoll_div(x, d); }}\n", ct.ctype)
    return (_float_helper("div", "float"),
            f"{sig} {{ return {ct.from_f}(acoll_div({ct.to_f}(x), d)); }}\n", "float")


def _scale_code(ct: _CType) -> tuple[str, str, str]:
    """(helpers, ``T acoll_scale(T x, D f)``, D) for a floating-point ``ct``."""
    sig = f"{_HD} T acoll_scale(T x, D f)"
    if ct.family == "float":
        return (_float_helper("mul", ct.ctype), f"{sig} {{ return acoll_mul(x, f); }}\n",
                ct.ctype)
    # (both factors have 8 or 11 significant bits: their float32 product is exact, so the
    # one rounding back gives the 16-bit product correctly rounded)
    return (_float_helper("mul", "float"),
            f"{sig} {{ return {ct.from_f}(acoll_mul({ct.to_f}(x), f)); }}\n", "float")


_PRELUDE = """\
typedef {ctype} T;
typedef unsigned long long u64;
"""

_BINARY_VEC = """\
// A 16-byte vector seen as {V} storage words (a union of trivial types; element values
// come from bit casts, so no pointer punning).
union acoll_vec {{ uint4 v; S s[{V}]; }};

static __host__ __device__ __forceinline__ uint4 acoll_vop(uint4 x, uint4 y) {{
  acoll_vec xa, ya, r;
  xa.v = x;
  ya.v = y;
#pragma unroll
  for (int k = 0; k < {V}; ++k)
    r.s[k] = acoll_to(acoll_op(acoll_from(xa.s[k]), acoll_from(ya.s[k])));
  return r.v;
}}

static __host__ __device__ __forceinline__ void acoll_body(
    T* out, const T* a, const T* b, u64 n, u64 head, u64 tid, u64 nthreads) {{
  // head < {V} leading elements bring all three pointers to a 16-byte boundary.
  const u64 nvec = (n - head) / {V};
  const uint4* av = reinterpret_cast<const uint4*>(a + head);
  const uint4* bv = reinterpret_cast<const uint4*>(b + head);
  uint4* ov = reinterpret_cast<uint4*>(out + head);
  u64 i = tid;
  // {U} independent 16-byte loads of each input in flight before the first use.
  for (; i + ({U} - 1) * nthreads < nvec; i += {U} * nthreads) {{
    uint4 x[{U}], y[{U}];
#pragma unroll
    for (int u = 0; u < {U}; ++u) {{ x[u] = av[i + u * nthreads]; y[u] = bv[i + u * nthreads]; }}
#pragma unroll
    for (int u = 0; u < {U}; ++u) ov[i + u * nthreads] = acoll_vop(x[u], y[u]);
  }}
  for (; i < nvec; i += nthreads) ov[i] = acoll_vop(av[i], bv[i]);
  const u64 tail = head + nvec * {V};  // n - tail < {V} trailing elements
  if (tid < head) {{
    out[tid] = acoll_op(a[tid], b[tid]);
  }} else if (tid - head < n - tail) {{
    const u64 j = tail + (tid - head);
    out[j] = acoll_op(a[j], b[j]);
  }}
}}
"""

_BINARY_SCALAR = """\
static __host__ __device__ __forceinline__ void acoll_body(
    T* out, const T* a, const T* b, u64 n, u64 head, u64 tid, u64 nthreads) {{
  (void)head;
  for (u64 i = tid; i < n; i += nthreads) out[i] = acoll_op(a[i], b[i]);
}}
"""

_UNARY_VEC = """\
union acoll_vec {{ uint4 v; S s[{V}]; }};

static __host__ __device__ __forceinline__ uint4 acoll_vfin(uint4 v, D d) {{
  acoll_vec x;
  x.v = v;
#pragma unroll
  for (int k = 0; k < {V}; ++k) x.s[k] = acoll_to(acoll_fin(acoll_from(x.s[k]), d));
  return x.v;
}}

static __host__ __device__ __forceinline__ void acoll_body(
    T* x, u64 n, u64 head, D d, u64 tid, u64 nthreads) {{
  const u64 nvec = (n - head) / {V};
  uint4* xv = reinterpret_cast<uint4*>(x + head);
  u64 i = tid;
  for (; i + ({U} - 1) * nthreads < nvec; i += {U} * nthreads) {{
    uint4 v[{U}];
#pragma unroll
    for (int u = 0; u < {U}; ++u) v[u] = xv[i + u * nthreads];
#pragma unroll
    for (int u = 0; u < {U}; ++u) xv[i + u * nthreads] = acoll_vfin(v[u], d);
  }}
  for (; i < nvec; i += nthreads) xv[i] = acoll_vfin(xv[i], d);
  const u64 tail = head + nvec * {V};
  if (tid < head) {{
    x[tid] = acoll_fin(x[tid], d);
  }} else if (tid - head < n - tail) {{
    const u64 j = tail + (tid - head);
    x[j] = acoll_fin(x[j], d);
  }}
}}
"""

_UNARY_SCALAR = """\
static __host__ __device__ __forceinline__ void acoll_body(
    T* x, u64 n, u64 head, D d, u64 tid, u64 nthreads) {{
  (void)head;
  for (u64 i = tid; i < n; i += nthreads) x[i] = acoll_fin(x[i], d);
}}
"""

_SCALE_BODY = """\
static __host__ __device__ __forceinline__ void acoll_body(
    T* out, const T* a, u64 n, D f, u64 tid, u64 nthreads) {
  for (u64 i = tid; i < n; i += nthreads) out[i] = acoll_scale(a[i], f);
}
"""

_GLOBAL_SCALE = """\
extern "C" __global__ void __launch_bounds__({threads}) {name}(
    T* out, const T* a, u64 n, D f) {{
  acoll_body(out, a, n, f, (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}}
"""

_GLOBAL_BINARY = """\
extern "C" __global__ void __launch_bounds__({threads}) {name}(
    T* out, const T* a, const T* b, u64 n, u64 head) {{
  acoll_body(out, a, b, n, head, (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}}
"""

_GLOBAL_UNARY = """\
extern "C" __global__ void __launch_bounds__({threads}) {name}(T* x, u64 n, u64 head, D d) {{
  acoll_body(x, n, head, d, (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}}
"""


def _check_vec(vectorised: object) -> bool:
    if not isinstance(vectorised, bool):
        raise InvalidUsage(f"vectorised must be a bool, not {vectorised!r}")
    return vectorised


def reduce_source(op: ReduceOp | str | int, dtype: Any, vectorised: bool) -> KernelSource:
    """The reduction kernel source for ``op`` (AVG gives SUM's) on ``dtype``.

    Raises:
        InvalidUsage: unknown op, unsupported dtype, or a non-bool ``vectorised``.
    """
    rop = ReduceOp.coerce(op)
    rop = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    dt, _ = _dtype_name(dtype)
    return _reduce_source(rop, dt, _check_vec(vectorised))


@functools.cache
def _reduce_source(rop: ReduceOp, dt: np.dtype[Any], vec: bool) -> KernelSource:
    dname = DTYPE_NAMES[dt]
    ct = _CTYPES[dname]
    helpers, opfn = _op_code(ct, dt.itemsize, rop)
    name = f"acoll_{rop.name.lower()}_{dname}_{'v' if vec else 's'}"
    v = VEC_BYTES // dt.itemsize
    body = (_PRELUDE.format(ctype=ct.ctype) + helpers + opfn
            + (_bits_code(ct, dt.itemsize) if vec else "")
            + (_BINARY_VEC if vec else _BINARY_SCALAR).format(V=v, U=UNROLL)
            + _GLOBAL_BINARY.format(threads=THREADS, name=name))
    return KernelSource(name, "reduce", rop, dt, vec,
                        (ct.include,) if ct.include else (), body)


def finish_avg_source(dtype: Any, vectorised: bool) -> KernelSource:
    """The kernel source dividing a sum by the rank count in place (see module doc).

    Raises:
        InvalidUsage: unsupported dtype or a non-bool ``vectorised``.
    """
    dt, _ = _dtype_name(dtype)
    return _finish_avg_source(dt, _check_vec(vectorised))


@functools.cache
def _finish_avg_source(dt: np.dtype[Any], vec: bool) -> KernelSource:
    dname = DTYPE_NAMES[dt]
    ct = _CTYPES[dname]
    helpers, fin, dtype_c = _finish_code(ct)
    name = f"acoll_avgdiv_{dname}_{'v' if vec else 's'}"
    v = VEC_BYTES // dt.itemsize
    body = (_PRELUDE.format(ctype=ct.ctype) + f"typedef {dtype_c} D;\n" + helpers + fin
            + (_bits_code(ct, dt.itemsize) if vec else "")
            + (_UNARY_VEC if vec else _UNARY_SCALAR).format(V=v, U=UNROLL)
            + _GLOBAL_UNARY.format(threads=THREADS, name=name))
    return KernelSource(name, "finish_avg", None, dt, vec,
                        (ct.include,) if ct.include else (), body, dtype_c)


def scale_source(dtype: Any) -> KernelSource:
    """The kernel source of ``out = a * factor`` (AVG's scaling of one rank's input) on a
    floating-point ``dtype`` (one element per thread step; no vectorised form).

    Raises:
        InvalidUsage: an unsupported or integer dtype.
    """
    dt, dname = _dtype_name(dtype)
    if _CTYPES[dname].family not in ("float", "half"):
        raise InvalidUsage(f"AVG scales floating-point inputs only, not {dname}")
    return _scale_source(dt)


@functools.cache
def _scale_source(dt: np.dtype[Any]) -> KernelSource:
    dname = DTYPE_NAMES[dt]
    ct = _CTYPES[dname]
    helpers, fn, factor_c = _scale_code(ct)
    name = f"acoll_avgscale_{dname}"
    body = (_PRELUDE.format(ctype=ct.ctype) + f"typedef {factor_c} D;\n" + helpers + fn
            + _SCALE_BODY + _GLOBAL_SCALE.format(threads=THREADS, name=name))
    return KernelSource(name, "scale", None, dt, False,
                        (ct.include,) if ct.include else (), body, factor_c)


def all_sources() -> Iterator[KernelSource]:
    """Every kernel this module can launch (reduce ops x dtypes x vec, finish_avg, and
    scale on the floating-point dtypes)."""
    for dt in DTYPES:
        for vec in (True, False):
            for op in _REDUCE_OPS:
                yield reduce_source(op, dt, vec)
            yield finish_avg_source(dt, vec)
        if _CTYPES[DTYPE_NAMES[dt]].family in ("float", "half"):
            yield scale_source(dt)


# ---------------------------------------------------------------------------- launching

_cache: dict[tuple[str, int], Any] = {}
_sm_count: dict[int, int] = {}
_lock = threading.Lock()


def get_kernel(src: KernelSource) -> Any:
    """The compiled ``cupy.RawKernel`` of ``src`` on the current device (compiled once).

    Raises:
        CudaUnavailable: no CuPy.
    """
    cp = import_cupy()
    dev = cp.cuda.runtime.getDevice()
    key = (src.name, dev)
    kern = _cache.get(key)
    if kern is None:
        with _lock:
            kern = _cache.get(key)
            if kern is None:
                kern = cp.RawKernel(src.code, src.name, options=NVRTC_OPTIONS)
                kern.compile()
                _cache[key] = kern
                if dev not in _sm_count:
                    _sm_count[dev] = int(cp.cuda.Device(dev).attributes[
                        "MultiProcessorCount"])
    return kern


_launch: dict[tuple[Any, ...], tuple[Any, KernelSource, int]] = {}


def _prepared(kind: str, rop: ReduceOp | None, dt: np.dtype[Any], vec: bool
              ) -> tuple[Any, KernelSource, int]:
    """(kernel, source, most blocks) for the current device; cached, so a launch costs
    little more than CuPy's own kernel call."""
    dev = import_cupy().cuda.runtime.getDevice()
    key = (kind, rop, dt, vec, dev)
    hit = _launch.get(key)
    if hit is None:
        src = (_reduce_source(rop, dt, vec) if rop is not None
               else _scale_source(dt) if kind == "scale" else _finish_avg_source(dt, vec))
        kern = get_kernel(src)
        hit = _launch[key] = (kern, src, _sm_count[dev] * BLOCKS_PER_SM)
    return hit


def _blocks(work: int, most: int) -> int:
    """Blocks for ``work`` items: one item per thread, at most ``most``."""
    return max(1, min(-(-work // THREADS), most))


def _dt(dtype: Any) -> np.dtype[Any]:
    return dtype if isinstance(dtype, np.dtype) and dtype in DTYPES else parse_dtype(dtype)


def _head(ptrs: tuple[int, ...], itemsize: int, count: int) -> int | None:
    """Leading elements before a shared 16-byte boundary; None if none is shared."""
    off = ptrs[0] % VEC_BYTES
    if any(p % VEC_BYTES != off for p in ptrs) or off % itemsize:
        return None
    return min(count, (VEC_BYTES - off) % VEC_BYTES // itemsize)


def launch_reduce(out_ptr: int, a_ptr: int, b_ptr: int, count: int,
                  op: ReduceOp | str | int, dtype: Any, stream: Any = None) -> None:
    """Enqueue ``out = a (op) b`` over ``count`` elements at raw device pointers.

    ``stream``: a CuPy stream (``None``: CuPy's current stream). The pointers must be on the
    current device. AVG runs SUM (then call :func:`launch_finish_avg`).
    """
    rop = ReduceOp.coerce(op)
    rop = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    dt = _dt(dtype)
    if count < 0:
        raise InvalidUsage(f"count must be >= 0, not {count}")
    if count == 0:
        return
    head = _head((out_ptr, a_ptr, b_ptr), dt.itemsize, count)
    kern, src, most = _prepared("reduce", rop, dt, head is not None)
    work = (count - (head or 0)) // src.elems_per_vec if head is not None else count
    u64 = np.uint64
    kern((_blocks(work, most),), (THREADS,),
         (u64(out_ptr), u64(a_ptr), u64(b_ptr), u64(count), u64(head or 0)), stream=stream)


def _divisor(src: KernelSource, n: int) -> Any:
    return {"float": np.float32, "double": np.float64, "long long": np.int64,
            "unsigned long long": np.uint64}[src.divisor_type](n)


def launch_finish_avg(ptr: int, count: int, n: int, dtype: Any, stream: Any = None) -> None:
    """Enqueue the in-place division of a sum of ``n`` contributions (no-op for n == 1)."""
    dt = _dt(dtype)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidUsage(f"finish_avg needs a positive rank count, not {n!r}")
    if count < 0:
        raise InvalidUsage(f"count must be >= 0, not {count}")
    if n == 1 or count == 0:
        return
    head = _head((ptr,), dt.itemsize, count)
    kern, src, most = _prepared("finish_avg", None, dt, head is not None)
    work = (count - (head or 0)) // src.elems_per_vec if head is not None else count
    kern((_blocks(work, most),), (THREADS,),
         (np.uint64(ptr), np.uint64(count), np.uint64(head or 0), _divisor(src, n)),
         stream=stream)


def launch_scale(out_ptr: int, a_ptr: int, count: int, n: int, dtype: Any,
                 stream: Any = None) -> None:
    """Enqueue ``out = a * (1/n)`` (the factor rounded as AVG rounds it) over ``count``
    elements of a floating-point ``dtype``; ``out`` may be ``a``."""
    dt = _dt(dtype)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidUsage(f"scale needs a positive rank count, not {n!r}")
    if count < 0:
        raise InvalidUsage(f"count must be >= 0, not {count}")
    if count == 0 or (n == 1 and out_ptr == a_ptr):
        return
    scale_source(dt)  # (refuses integer dtypes)
    kern, src, most = _prepared("scale", None, dt, False)
    factor = (np.float64(1.0 / n) if src.divisor_type == "double"
              else np.float32(avg_factor(dt, n)))
    kern((_blocks(count, most),), (THREADS,),
         (np.uint64(out_ptr), np.uint64(a_ptr), np.uint64(count), factor), stream=stream)


def _view(arr: Any, what: str, dtype: np.dtype[Any] | None, writable: bool
          ) -> tuple[int, int, np.dtype[Any]]:
    """(pointer, element count, dtype) of a contiguous device array."""
    try:
        cai = arr.__cuda_array_interface__
    except AttributeError:
        raise InvalidUsage(f"{what} is not a GPU buffer (no __cuda_array_interface__; "
                           f"got {type(arr).__name__})") from None
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise InvalidUsage(f"{what} is read-only")
    shape = tuple(cai["shape"])
    own = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        expect, step = [], own.itemsize
        for dim in reversed(shape):
            expect.append(step)
            step *= dim
        if tuple(reversed(expect)) != tuple(strides) and int(np.prod(shape)) > 1:
            raise InvalidUsage(f"{what} is not C-contiguous")
    nbytes = int(np.prod(shape, dtype=np.int64)) * own.itemsize
    dt = parse_dtype(own if dtype is None else dtype)
    if nbytes % dt.itemsize:
        raise InvalidUsage(f"{what} has {nbytes} bytes, not a whole number of {dt}")
    return int(ptr), nbytes // dt.itemsize, dt


def reduce_into(out: Any, a: Any, b: Any, op: ReduceOp | str | int, stream: Any = None, *,
                dtype: Any = None) -> None:
    """``out[:] = a (op) b`` on the GPU, enqueued on ``stream`` (CuPy's current if None).

    Arrays: contiguous, on the current device, with ``__cuda_array_interface__`` (CuPy,
    torch, Numba...). ``dtype`` reinterprets their bytes (e.g. bfloat16 data held in a
    uint16 or uint8 array); otherwise their own dtype is used. ``out`` may alias ``a``/``b``.
    AVG sums (finish with :func:`finish_avg`).

    Raises:
        InvalidUsage: unsupported op/dtype, size mismatch, non-contiguous or read-only out.
        CudaUnavailable: no CuPy.
    """
    rop = ReduceOp.coerce(op)
    fixed = None if dtype is None else parse_dtype(dtype)
    po, no, dto = _view(out, "out", fixed, True)
    pa, na, dta = _view(a, "a", fixed, False)
    pb, nb, dtb = _view(b, "b", fixed, False)
    if not (dto == dta == dtb):
        raise InvalidUsage(f"dtypes differ: out {dto}, a {dta}, b {dtb}")
    if not (no == na == nb):
        raise InvalidUsage(f"sizes differ: out {no}, a {na}, b {nb} elements")
    launch_reduce(po, pa, pb, no, rop, dto, stream)


def scale_into(out: Any, a: Any, n: int, stream: Any = None, *, dtype: Any = None) -> None:
    """``out[:] = a * (1/n)`` on the GPU as AVG scales an input (see the module doc).

    Raises:
        InvalidUsage: an integer dtype, size or dtype mismatch, a read-only ``out``.
    """
    fixed = None if dtype is None else parse_dtype(dtype)
    po, no, dto = _view(out, "out", fixed, True)
    pa, na, dta = _view(a, "a", fixed, False)
    if dto != dta or no != na:
        raise InvalidUsage(f"out ({no} x {dto}) and a ({na} x {dta}) differ")
    launch_scale(po, pa, no, n, dto, stream)


def finish_avg(arr: Any, n: int, stream: Any = None, *, dtype: Any = None) -> None:
    """Divide a sum of ``n`` contributions in place on the GPU (see :func:`reduce_into`)."""
    p, count, dt = _view(arr, "arr", None if dtype is None else parse_dtype(dtype), True)
    launch_finish_avg(p, count, n, dt, stream)
