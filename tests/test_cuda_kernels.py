"""GPU reduction kernels and completion waits (acoll._cuda).

CPU part (needs only ``nvcc``): every generated source is compiled for sm_90 (one nvcc run
per dtype, each source in its own namespace; the includes are per dtype, so this is the
translation unit NVRTC sees), and the same ``__host__ __device__`` kernel bodies are run on
the CPU — every thread index of a small grid in turn — against acoll's host reduction
(``acoll._dtypes``), bit for bit.

GPU part (marked ``gpu``; needs CuPy and a device): the kernels on the device against the
host reduction, and the completion waits.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from acoll._cuda import CudaUnavailable
from acoll._cuda import kernels as K
from acoll._dtypes import (
    BFLOAT16,
    DTYPE_NAMES,
    DTYPES,
    ReduceOp,
    avg_factor,
    finish_avg,
    reduce_into,
    scale_into,
)
from acoll.errors import InvalidUsage
from acoll.errors import TimeoutError as AcollTimeoutError

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: CUDA sources are "
                                "not compile-checked or CPU-emulated")

try:
    import cupy as cp

    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
    NO_GPU_REASON = ""
except Exception as exc:  # ImportError, or CUDARuntimeError without a driver/device
    cp = None
    HAVE_GPU = False
    NO_GPU_REASON = f"no CuPy/GPU ({type(exc).__name__}: {exc})"

gpu_only = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
DT_IDS = [DTYPE_NAMES[d] for d in DTYPES]
SIZES = [0, 1, 7, 1000, 100003]
INT64_MIN = np.iinfo(np.int64).min


# ----------------------------------------------------------------------------- test data

def _uint_view(dt: np.dtype[Any]) -> Any:
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]


def make_pair(dt: np.dtype[Any], n: int, seed: int, *, avg: bool = False
              ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Random operands with the awkward values mixed in: NaN of both signs, infinities,
    signed zeros and ties (incl. -0 vs +0), subnormals, values that overflow."""
    rng = np.random.default_rng(seed)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        b = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        small = rng.random(n) < 0.3  # small values too, so PROD is not always wrapped
        a[small] = (a[small] % 7).astype(dt)
        b[small] = (b[small] % 5).astype(dt)
        if n >= 3:
            a[:3] = [info.min, info.max, 0]
            b[:3] = [info.min, 1, info.max]
        if avg and dt == np.int64:  # the host average of INT64_MIN is wrong: see below
            a[a == INT64_MIN] += 1
            b[(a + b == INT64_MIN) | (b == INT64_MIN)] = 0
        return a, b
    a32 = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    b32 = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    a, b = a32.astype(dt), b32.astype(dt)
    tiny = {2: 6e-8, 4: 1e-40, 8: 1e-310}[dt.itemsize] if dt != BFLOAT16 else 1e-40
    big = np.finfo(np.float16).max if dt == np.float16 else 3e38
    specials = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, tiny, -tiny, big, 1.5]
    if n:
        k = max(1, n // 10)
        idx_a, idx_b = rng.integers(0, n, k), rng.integers(0, n, k)
        a[idx_a] = rng.choice(np.array(specials, dtype=np.float64), k).astype(dt)
        b[idx_b] = rng.choice(np.array(specials, dtype=np.float64), k).astype(dt)
        ties = rng.integers(0, n, max(1, n // 20))
        b[ties] = a[ties]
        zeros = rng.integers(0, n, max(1, n // 20))
        a[zeros], b[zeros] = dt.type(-0.0), dt.type(0.0)
        b[zeros[::2]], a[zeros[::2]] = dt.type(-0.0), dt.type(0.0)
    return a, b


def host_result(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], op: ReduceOp, navg: int
                ) -> np.ndarray[Any, Any]:
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        reduce_into(out, a, b, op)
        if op == ReduceOp.AVG:
            finish_avg(out, navg)
    return out


def assert_same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str) -> None:
    """Bit-for-bit equal, except that any NaN matches any NaN (payloads may differ)."""
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    if want.dtype.kind == "f" or want.dtype == BFLOAT16:
        gnan, wnan = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
        u = _uint_view(want.dtype)
        bad = (gnan != wnan) | (~wnan & (got.view(u) != want.view(u)))
    else:
        bad = got != want
    if bad.any():
        i = np.flatnonzero(bad)[:5]
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} differ; first at {i.tolist()}: "
                    f"got {got[i].tolist()} want {want[i].tolist()}")


# ------------------------------------------------------------------ generator (CPU only)

def test_every_source_is_generated_and_named_uniquely() -> None:
    srcs = list(K.all_sources())
    floats = sum(1 for d in DTYPES if d.kind == "f" or d == BFLOAT16)
    assert len(srcs) == len(DTYPES) * 2 * 5 + floats  # (+ one scale kernel per float)
    assert len({s.name for s in srcs}) == len(srcs)
    for s in srcs:
        assert f'extern "C" __global__ void __launch_bounds__({K.THREADS}) {s.name}(' in s.code
        assert s.code.startswith("".join(f"#include <{h}>\n" for h in s.includes))
        assert ("cuda_fp16.h" in s.includes) == (s.dtype == np.float16)
        assert ("cuda_bf16.h" in s.includes) == (s.dtype == BFLOAT16)
        assert ("uint4" in s.body) == s.vectorised


def test_generator_accepts_names_and_maps_avg_to_sum() -> None:
    s = K.reduce_source("avg", "bf16", True)
    assert s.name == "acoll_sum_bfloat16_v"
    assert s.op == ReduceOp.SUM
    assert K.reduce_source(1, np.float32, False).name == "acoll_prod_float32_s"
    assert K.finish_avg_source("int8", True).divisor_type == "long long"
    assert K.finish_avg_source("uint64", False).divisor_type == "unsigned long long"
    assert K.finish_avg_source("float16", False).divisor_type == "float"


@pytest.mark.parametrize(("args", "match"), [
    (("xor", "float32", True), "unknown reduction op"),
    ((7, "float32", True), "unknown reduction op"),
    (("sum", "int16", True), "not supported"),
    (("sum", "complex64", False), "not supported"),
    (("sum", "nonsense", False), "unknown dtype"),
    (("sum", "float32", 1), "vectorised must be a bool"),
])
def test_generator_rejects_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidUsage, match=match):
        K.reduce_source(*args)


def test_finish_avg_source_rejects_bad_dtype() -> None:
    with pytest.raises(InvalidUsage, match="not supported"):
        K.finish_avg_source(np.int16, True)


class FakeDeviceArray:
    """Just enough ``__cuda_array_interface__`` to exercise argument checks on a CPU."""

    def __init__(self, shape: tuple[int, ...], typestr: str, ptr: int = 4096,
                 strides: tuple[int, ...] | None = None, readonly: bool = False) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, readonly), "strides": strides,
                                         "version": 3}


@pytest.mark.parametrize(("out", "a", "b", "kw", "match"), [
    (np.zeros(4, np.float32), FakeDeviceArray((4,), "<f4"), FakeDeviceArray((4,), "<f4"),
     {}, "not a GPU buffer"),
    (FakeDeviceArray((4,), "<f4"), FakeDeviceArray((5,), "<f4"), FakeDeviceArray((4,), "<f4"),
     {}, "sizes differ"),
    (FakeDeviceArray((4,), "<f4"), FakeDeviceArray((4,), "<i4"), FakeDeviceArray((4,), "<f4"),
     {}, "dtypes differ"),
    (FakeDeviceArray((4, 4), "<f4", strides=(32, 4)), FakeDeviceArray((16,), "<f4"),
     FakeDeviceArray((16,), "<f4"), {}, "not C-contiguous"),
    (FakeDeviceArray((4,), "<f4", readonly=True), FakeDeviceArray((4,), "<f4"),
     FakeDeviceArray((4,), "<f4"), {}, "read-only"),
    (FakeDeviceArray((4,), "<i2"), FakeDeviceArray((4,), "<i2"), FakeDeviceArray((4,), "<i2"),
     {}, "not supported"),
    (FakeDeviceArray((3,), "|u1"), FakeDeviceArray((3,), "|u1"), FakeDeviceArray((3,), "|u1"),
     {"dtype": "bfloat16"}, "whole number"),
])
def test_reduce_into_rejects_bad_buffers(out: Any, a: Any, b: Any, kw: dict[str, Any],
                                         match: str) -> None:
    with pytest.raises(InvalidUsage, match=match):
        K.reduce_into(out, a, b, "sum", **kw)


def test_finish_avg_rejects_bad_rank_count() -> None:
    arr = FakeDeviceArray((4,), "<f4")
    for n in (0, -1, 1.5, True):
        with pytest.raises(InvalidUsage, match="positive rank count"):
            K.finish_avg(arr, n)  # type: ignore[arg-type]


@pytest.mark.skipif(cp is not None, reason="CuPy is installed: its absence is not testable")
def test_launch_without_cupy_raises_clearly() -> None:
    f = FakeDeviceArray((4,), "<f4")
    with pytest.raises(CudaUnavailable, match="CuPy"):
        K.reduce_into(f, f, f, "max")
    with pytest.raises(CudaUnavailable, match="CuPy"):
        asyncio.run(_wait_without_cupy())


async def _wait_without_cupy() -> None:
    from acoll._cuda.completion import wait_stream
    await wait_stream(None)


# ------------------------------------------------ nvcc: compile check and CPU emulation

_CTYPES_OF = {"float": ctypes.c_float, "double": ctypes.c_double,
              "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong}


def _emulation_unit(srcs: list[K.KernelSource]) -> str:
    """One translation unit: each source's body in its own namespace, plus host functions
    ``emu_<name>`` that run the body for every thread index of a grid of ``nthreads``."""
    parts = ["".join(f"#include <{h}>\n" for h in srcs[0].includes)]
    for s in srcs:
        ns = f"ns_{s.name}"
        parts.append(f"namespace {ns} {{\n{s.body}}}\n")
        if s.kind == "reduce":
            parts.append(
                f'extern "C" void emu_{s.name}(void* o, const void* a, const void* b, '
                f"unsigned long long n, unsigned long long head, unsigned long long nt) {{\n"
                f"  for (unsigned long long t = 0; t < nt; ++t)\n"
                f"    {ns}::acoll_body(({ns}::T*)o, (const {ns}::T*)a, (const {ns}::T*)b, "
                f"n, head, t, nt);\n}}\n")
        elif s.kind == "scale":
            parts.append(
                f'extern "C" void emu_{s.name}(void* o, const void* a, unsigned long long n, '
                f"{ns}::D f, unsigned long long nt) {{\n"
                f"  for (unsigned long long t = 0; t < nt; ++t)\n"
                f"    {ns}::acoll_body(({ns}::T*)o, (const {ns}::T*)a, n, f, t, nt);\n}}\n")
        else:
            parts.append(
                f'extern "C" void emu_{s.name}(void* x, unsigned long long n, '
                f"unsigned long long head, {ns}::D d, unsigned long long nt) {{\n"
                f"  for (unsigned long long t = 0; t < nt; ++t)\n"
                f"    {ns}::acoll_body(({ns}::T*)x, n, head, d, t, nt);\n}}\n")
    return "".join(parts)


#: What CuPy's NVRTC compile gets: our options, then its unconditional -ftz=true.
NVCC_OPTS = [*(o.replace("--", "-", 1) for o in K.NVRTC_OPTIONS), "-ftz=true"]


def _nvcc_build(unit: str, out_dir: Path, tag: str) -> tuple[Path | None, str]:
    """(shared library, "") or (None, nvcc's command and output)."""
    digest = hashlib.sha256(unit.encode()).hexdigest()[:16]
    src, lib = out_dir / f"{tag}_{digest}.cu", out_dir / f"{tag}_{digest}.so"
    if lib.exists():
        return lib, ""
    src.write_text(unit)
    cmd = [str(NVCC), "-arch=sm_90", *NVCC_OPTS, "-O2", "--Werror", "all-warnings",
           "-Xcompiler", "-fPIC,-Wall,-Wno-unknown-pragmas", "-shared", "-o", str(lib),
           str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        return None, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return lib, ""


@pytest.fixture(scope="module")
def emulators(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Callable[[np.dtype[Any]], Any]]:
    """dtype -> ctypes library of that dtype's kernels (all built in the background, a few
    nvcc at a time; a failed build fails only that dtype's tests)."""
    cache_dir = Path(os.environ.get("ACOLL_NVCC_CACHE", tmp_path_factory.mktemp("nvcc")))
    cache_dir.mkdir(parents=True, exist_ok=True)
    by_dtype: dict[np.dtype[Any], list[K.KernelSource]] = {}
    for s in K.all_sources():
        by_dtype.setdefault(s.dtype, []).append(s)
    libs: dict[np.dtype[Any], Any] = {}
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        futs = {dt: pool.submit(_nvcc_build, _emulation_unit(srcs), cache_dir,
                                DTYPE_NAMES[dt]) for dt, srcs in by_dtype.items()}

        def get(dt: np.dtype[Any]) -> Any:
            if dt not in libs:
                lib, log = futs[dt].result()
                if lib is None:
                    pytest.fail(f"nvcc failed for {DTYPE_NAMES[dt]}:\n{log}")
                libs[dt] = ctypes.CDLL(str(lib))
            return libs[dt]

        yield get


@needs_nvcc
@pytest.mark.parametrize("dtype", list(DTYPES), ids=DT_IDS)
def test_sources_compile_for_sm90(emulators: Callable[[np.dtype[Any]], Any],
                                  dtype: np.dtype[Any]) -> None:
    lib = emulators(dtype)
    for vec in (True, False):
        for op in OPS[:4]:
            assert hasattr(lib, "emu_" + K.reduce_source(op, dtype, vec).name)
        assert hasattr(lib, "emu_" + K.finish_avg_source(dtype, vec).name)
    if dtype.kind == "f" or dtype == BFLOAT16:
        assert hasattr(lib, "emu_" + K.scale_source(dtype).name)
    else:
        with pytest.raises(InvalidUsage, match="floating-point"):
            K.scale_source(dtype)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float_kernels_never_flush_subnormals(tmp_path: Path, dtype: str) -> None:
    """Under CuPy's forced -ftz=true, no float instruction may carry .ftz (that would make
    float32/bfloat16 subnormals differ from NumPy)."""
    srcs = [s for s in K.all_sources() if DTYPE_NAMES[s.dtype] == dtype]
    unit = _emulation_unit(srcs)
    (tmp_path / "k.cu").write_text(unit)
    proc = subprocess.run([str(NVCC), "-arch=sm_90", *NVCC_OPTS, "--ptx", "-o",
                           str(tmp_path / "k.ptx"), str(tmp_path / "k.cu")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    flushing = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
    assert not flushing, flushing[:5]
    assert ".entry" in ptx


def _find_nvrtc() -> str | None:
    """libnvrtc: $ACOLL_NVRTC_LIB, else an nvidia-cuda-nvrtc wheel's, else the system's."""
    import ctypes.util
    import glob
    import site
    if os.environ.get("ACOLL_NVRTC_LIB"):
        return os.environ["ACOLL_NVRTC_LIB"]
    for d in site.getsitepackages():
        hits = sorted(glob.glob(f"{d}/nvidia/*/lib/libnvrtc.so*"))
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


NVRTC = _find_nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="no libnvrtc (set ACOLL_NVRTC_LIB or install "
                    "nvidia-cuda-nvrtc): sources not compiled the way CuPy compiles them")
def test_every_source_compiles_with_nvrtc_as_cupy_would() -> None:
    """NVRTC has no host headers or GCC builtins: compile each source as CuPy does (our
    options, CuPy's -ftz=true, sm_90), no device needed. Warnings count as failures."""
    import glob
    assert NVRTC is not None
    for builtins in glob.glob(os.path.join(os.path.dirname(NVRTC), "libnvrtc-builtins.so*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # found by soname when nvrtc asks
    lib = ctypes.CDLL(NVRTC)
    inc = [f"-I{d}" for d in ("/usr/local/cuda/include",) if os.path.isdir(d)]
    opts = [o.encode() for o in (*K.NVRTC_OPTIONS, *inc, "-ftz=true", "-arch=sm_90")]
    from acoll._cuda.spin import SPIN_SOURCE
    units = [(s.name, s.code) for s in K.all_sources()] + [("acoll_spin", SPIN_SOURCE)]
    failures = []
    for name, code in units:
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(),
                                      f"{name}.cu".encode(), 0, None, None) == 0
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        text = log.value.decode(errors="replace")
        if rc != 0 or "warning" in text:
            failures.append(f"{name}: rc={rc}\n{text}")
    assert not failures, "\n".join(failures[:3])


def _ptr(arr: np.ndarray[Any, Any]) -> ctypes.c_void_p:
    return ctypes.c_void_p(arr.ctypes.data)


def _layouts(n: int, itemsize: int) -> list[tuple[str, int, int, int, bool]]:
    """(name, out/a/b element offsets into 16-byte aligned buffers, in place?)."""
    return [("aligned", 0, 0, 0, False), ("same offset 1", 1, 1, 1, False),
            ("offsets 0/1/2", 0, 1, 2, False), ("in place", 0, 0, 0, True),
            ("in place, offsets 3/5", 3, 3, 5, True)]


def _aligned(n: int, dt: np.dtype[Any], off: int) -> np.ndarray[Any, Any]:
    raw = np.zeros((n + off) * dt.itemsize + 64, np.uint8)
    start = (-raw.ctypes.data) % 16
    return raw[start:start + (n + off) * dt.itemsize].view(dt)[off:]


def _emu_case(lib: Any, dt: np.dtype[Any], op: ReduceOp, n: int, layout: Any,
              nthreads: int) -> None:
    name, oo, oa, ob, inplace = layout
    navg = 3
    a, b = make_pair(dt, n, seed=n + 7 * int(op), avg=op == ReduceOp.AVG)
    want = host_result(a, b, op, navg)
    xa, xb = _aligned(n, dt, oa), _aligned(n, dt, ob)
    xa[:], xb[:] = a, b
    xo = xa if inplace else _aligned(n, dt, oo)
    ptrs = [xo.ctypes.data, xa.ctypes.data, xb.ctypes.data]
    head = K._head(tuple(ptrs), dt.itemsize, n)
    src = K.reduce_source(op, dt, head is not None)
    fn = getattr(lib, "emu_" + src.name)
    fn.restype = None
    fn(_ptr(xo), _ptr(xa), _ptr(xb), ctypes.c_ulonglong(n), ctypes.c_ulonglong(head or 0),
       ctypes.c_ulonglong(nthreads))
    if op == ReduceOp.AVG:
        fhead = K._head((xo.ctypes.data,), dt.itemsize, n)
        fsrc = K.finish_avg_source(dt, fhead is not None)
        fin = getattr(lib, "emu_" + fsrc.name)
        fin.restype = None
        d = _CTYPES_OF[fsrc.divisor_type](navg)
        fin(_ptr(xo), ctypes.c_ulonglong(n), ctypes.c_ulonglong(fhead or 0), d,
            ctypes.c_ulonglong(nthreads))
    assert_same(np.array(xo), want, f"{op.name} {DTYPE_NAMES[dt]} n={n} {name} "
                f"({src.name}, head={head}, {nthreads} threads)")


@needs_nvcc
@pytest.mark.parametrize("dtype", list(DTYPES), ids=DT_IDS)
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_kernel_bodies_on_cpu_match_host(emulators: Callable[[np.dtype[Any]], Any],
                                         op: ReduceOp, dtype: np.dtype[Any]) -> None:
    lib = emulators(dtype)
    for n in SIZES:
        for layout in _layouts(n, dtype.itemsize):
            for nthreads in (32, 2048):
                _emu_case(lib, dtype, op, n, layout, nthreads)


FLOATS = [d for d in DTYPES if d.kind == "f" or d == BFLOAT16]


def host_scaled(a: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        scale_into(out, a, avg_factor(a.dtype, n))
    return out


@needs_nvcc
@pytest.mark.parametrize("dtype", FLOATS, ids=[DTYPE_NAMES[d] for d in FLOATS])
def test_scale_bodies_on_cpu_match_host(emulators: Callable[[np.dtype[Any]], Any],
                                        dtype: np.dtype[Any]) -> None:
    """AVG's input scaling, every rank count's factor, on the awkward values."""
    lib = emulators(dtype)
    src = K.scale_source(dtype)
    fn = getattr(lib, "emu_" + src.name)
    fn.restype = None
    for n in SIZES:
        a, _ = make_pair(dtype, n, seed=n + 5)
        for ranks in (1, 2, 3, 5, 7, 12):
            for inplace in (False, True):
                x = a.copy()
                out = x if inplace else np.zeros_like(a)
                f = _CTYPES_OF[src.divisor_type](float(np.float64(avg_factor(dtype, ranks))))
                fn(_ptr(out), _ptr(x), ctypes.c_ulonglong(n), f, ctypes.c_ulonglong(64))
                assert_same(out, host_scaled(a, ranks),
                            f"scale {DTYPE_NAMES[dtype]} n={n} ranks={ranks} "
                            f"{'in place' if inplace else ''}")


def test_avg_factor_is_rounded_as_nccl_rounds_it() -> None:
    """1/n in double, then float32, then the 16-bit type; float64 keeps the double."""
    for n in (1, 2, 3, 5, 6, 7, 12, 100, 1000):
        assert avg_factor(np.dtype(np.float64), n) == 1.0 / n
        assert avg_factor(np.dtype(np.float32), n) == np.float32(1.0 / n)
        assert avg_factor(np.dtype(np.float16), n) == np.float16(np.float32(1.0 / n))
        assert (np.float32(avg_factor(BFLOAT16, n))
                == np.float32(BFLOAT16.type(np.float32(1.0 / n))))
    # float16 40000 and 60000 over 2 ranks: scaled first, the average is finite
    x = np.array([40000, 60000], np.float16)
    scale_into(x, x, avg_factor(x.dtype, 2))
    assert x.sum(dtype=np.float16) == 50000


# ------------------------------------------------------------------------ GPU: kernels

def _dev_buffer(host: np.ndarray[Any, Any], off_elems: int) -> tuple[Any, int]:
    """A device copy of ``host`` starting ``off_elems`` elements past a 256-byte boundary."""
    nb, o = host.nbytes, off_elems * host.dtype.itemsize
    raw = cp.zeros(nb + o + 64, cp.uint8)
    if nb:
        raw[o:o + nb] = cp.asarray(host.view(np.uint8))
    return raw, raw.data.ptr + o


def _dev_read(raw: Any, ptr: int, n: int, dt: np.dtype[Any]) -> np.ndarray[Any, Any]:
    o = ptr - raw.data.ptr
    return cp.asnumpy(raw[o:o + n * dt.itemsize]).view(dt)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", list(DTYPES), ids=DT_IDS)
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_gpu_kernels_match_host(op: ReduceOp, dtype: np.dtype[Any]) -> None:
    navg = 5
    stream = cp.cuda.Stream(non_blocking=True)
    for n in SIZES:
        for name, oo, oa, ob, inplace in _layouts(n, dtype.itemsize):
            a, b = make_pair(dtype, n, seed=3 * n + int(op), avg=op == ReduceOp.AVG)
            want = host_result(a, b, op, navg)
            with stream:  # everything on one stream: no cross-stream ordering needed
                ra, pa = _dev_buffer(a, oa)
                _rb, pb = _dev_buffer(b, ob)
                ro, po = (ra, pa) if inplace else _dev_buffer(np.zeros_like(a), oo)
                K.launch_reduce(po, pa, pb, n, op, dtype, stream)
                if op == ReduceOp.AVG:
                    K.launch_finish_avg(po, n, navg, dtype, stream)
                stream.synchronize()
                got = _dev_read(ro, po, n, dtype)
            assert_same(got, want, f"{op.name} {DTYPE_NAMES[dtype]} n={n} {name}")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_gpu_array_api(dtype: str) -> None:
    """reduce_into/finish_avg on CuPy arrays; bfloat16 carried in a uint16 array."""
    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    a, b = make_pair(dt, 4099, seed=11)
    store = np.uint16 if dt == BFLOAT16 else dt
    da, db = cp.asarray(a.view(store)), cp.asarray(b.view(store))
    out = cp.empty_like(da)
    kw = {"dtype": "bfloat16"} if dt == BFLOAT16 else {}
    K.reduce_into(out, da, db, "sum", **kw)
    K.finish_avg(out, 2, **kw)
    K.reduce_into(da, da, db, ReduceOp.MAX, **kw)  # in place
    assert_same(cp.asnumpy(out).view(dt), host_result(a, b, ReduceOp.AVG, 2), "avg")
    assert_same(cp.asnumpy(da).view(dt), host_result(a, b, ReduceOp.MAX, 1), "max")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", FLOATS, ids=[DTYPE_NAMES[d] for d in FLOATS])
def test_gpu_scale_matches_host(dtype: np.dtype[Any]) -> None:
    """AVG's input scaling on the device (launch_scale, and scale_into on CuPy arrays)."""
    store = np.uint16 if dtype == BFLOAT16 else dtype
    kw = {"dtype": "bfloat16"} if dtype == BFLOAT16 else {}
    for n in SIZES:
        a, _ = make_pair(dtype, n, seed=n + 9)
        for ranks in (1, 3, 8):
            da = cp.asarray(a.view(store))
            out = cp.zeros_like(da)
            K.scale_into(out, da, ranks, **kw)
            K.scale_into(da, da, ranks, **kw)  # in place
            want = host_scaled(a, ranks)
            assert_same(cp.asnumpy(out).view(dtype), want, f"scale n={n} ranks={ranks}")
            assert_same(cp.asnumpy(da).view(dtype), want, f"in place n={n} ranks={ranks}")
    with pytest.raises(InvalidUsage, match="floating-point"):
        K.scale_into(cp.zeros(4, cp.int32), cp.zeros(4, cp.int32), 2)


@pytest.mark.gpu
@gpu_only
def test_gpu_int64_average_truncates_toward_zero() -> None:
    """C semantics on the GPU for INT64_MIN (the host's abs() wraps there: it gives +2**62)."""
    x = cp.asarray(np.array([INT64_MIN, INT64_MIN + 1, -7, 7], np.int64))
    K.finish_avg(x, 2)
    assert cp.asnumpy(x).tolist() == [-(2 ** 62), -(2 ** 62) + 1, -3, 3]


# ------------------------------------------------------------------------ GPU: completion

METHODS = ["pipe", "hostfunc", "poll", "spin", "thread"]


def _run(coro: Any, use_uvloop: bool = False) -> Any:
    if use_uvloop:
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_wait_returns_after_kernel_and_loop_keeps_running(method: str,
                                                          use_uvloop: bool) -> None:
    from acoll._cuda.completion import wait_stream
    from acoll._cuda.spin import spin

    async def main() -> tuple[bool, int, float, float, int]:
        stream = cp.cuda.Stream(non_blocking=True)
        flag = cp.zeros(1, cp.int32)
        ev = cp.cuda.Event(disable_timing=True)
        ticks, worst, running = 0, 0.0, True
        loop = asyncio.get_running_loop()

        async def ticker() -> None:
            nonlocal ticks, worst
            last = loop.time()
            while running:
                await asyncio.sleep(0.001)
                now = loop.time()
                worst, last, ticks = max(worst, now - last), now, ticks + 1

        spin(0, stream)  # compiles the spin kernel (NVRTC blocks) before the ticker starts
        stream.synchronize()
        gc.collect()  # (earlier tests' garbage closing its descriptors later would skew the
        # count; collected before the ticker starts: a full collection stalls the loop)
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.005)
        fds = len(os.listdir("/proc/self/fd"))
        t0 = time.perf_counter()
        spin(0.05, stream, flag)
        ev.record(stream)
        await wait_stream(stream, method=method)
        elapsed = time.perf_counter() - t0
        done = ev.done  # a query, not a sync: False if the wait returned early
        running = False
        await task
        flag_set = int(cp.asnumpy(flag)[0])
        return done and flag_set == 1, ticks, worst, elapsed, len(
            os.listdir("/proc/self/fd")) - fds

    finished, ticks, worst, elapsed, fd_delta = _run(main(), use_uvloop)
    assert finished, "the wait returned before the kernel had finished"
    assert elapsed >= 0.049
    assert ticks >= 20, f"the loop ran only {ticks} 1-ms ticks during a 50 ms wait"
    assert worst < 0.02, f"the loop stalled {worst * 1e3:.1f} ms"
    # a leak shows as more descriptors; fewer is an earlier test's pipe closing meanwhile
    assert fd_delta <= 0, f"{fd_delta} file descriptors leaked"


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("method", METHODS)
def test_wait_deadline_raises_timeout(method: str) -> None:
    from acoll._cuda.completion import wait_event, wait_stream
    from acoll._cuda.spin import spin

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        stream = cp.cuda.Stream(non_blocking=True)
        spin(0.3, stream)
        t0 = loop.time()
        with pytest.raises(AcollTimeoutError, match="timed out waiting for GPU"):
            await wait_stream(stream, deadline=t0 + 0.03, method=method)
        t1 = loop.time() - t0
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        with pytest.raises(AcollTimeoutError, match="timed out waiting for GPU event"):
            await wait_event(ev, deadline=loop.time() + 0.03, method=method)
        await wait_event(ev, method=method)  # the same event, now without a deadline
        return t1, loop.time() - t0

    timed_out_after, total = _run(main())
    assert 0.029 <= timed_out_after < 0.2
    assert total >= 0.29


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("method", METHODS)
def test_wait_cancelled_cleanly_and_many_concurrent_waits(method: str) -> None:
    from acoll._cuda.completion import wait_event, wait_stream
    from acoll._cuda.spin import spin

    async def main() -> int:
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
        gc.collect()  # (earlier tests' garbage closing its descriptors now would skew the count)
        fds = len(os.listdir("/proc/self/fd"))
        spin(0.1, streams[0])
        stuck = asyncio.create_task(wait_stream(streams[0], method=method))
        await asyncio.sleep(0.01)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        events = []
        for i, s in enumerate(streams):
            spin(0.002 * (8 - i), s)
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(s)
            events.append(ev)
        await asyncio.gather(*(wait_event(e, method=method) for e in events),
                             *(wait_stream(s, method=method) for s in streams))
        assert all(e.done for e in events)
        cp.cuda.Device().synchronize()
        await asyncio.sleep(0.01)  # the cancelled wait's host function has run by now
        return len(os.listdir("/proc/self/fd")) - fds

    # None left open (fewer is possible: an earlier test's objects may close theirs)
    assert _run(main()) <= 0
