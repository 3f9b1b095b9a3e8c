"""GPU reduction kernels and completion waits, measured on one GPU.

1. Kernel bandwidth: acoll's SUM kernel (``out = a + b``; GB/s counts 3 streams of bytes:
   two reads and a write) for float32 and bfloat16 from 1 KiB to 1 GiB, against CuPy's
   elementwise ``cp.add(a, b, out=out)`` (float32; float16 stands in for the 2-byte type,
   CuPy has no bfloat16 arithmetic) and a device-to-device copy of the same bytes (counted
   as 2 streams). The misaligned column forces the scalar (non-vectorised) kernel.
   Times are CUDA-event times of back-to-back launches, so small sizes show launch rate.
2. Completion waits (``acoll._cuda.completion``): a kernel spinning ``D`` µs is launched and
   awaited, many times. Latency = launch to the awaiting coroutine resuming (p50/p99);
   "added" subtracts the p50 of a busy ``Stream.done`` loop that never yields (the earliest
   the host can see completion); CPU = process CPU time (all threads, the CUDA driver's
   too) per launch+wait.
3. Cold NVRTC compile time of a few kernels (fresh CuPy cache directory).

Usage: ``python bench/gpu_kernels.py RESULTS.txt [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from acoll._cuda import kernels as K
from acoll._cuda.completion import METHODS, wait_stream
from acoll._cuda.spin import spin
from acoll._dtypes import BFLOAT16

cp: Any = None
out_file: Any = None


def emit(line: str = "") -> None:
    """Print a line and append it to the results file at once (a run cut short keeps it)."""
    print(line, flush=True)
    if out_file is not None:
        out_file.write(line + "\n")
        out_file.flush()


def fmt_size(n: int) -> str:
    for unit, sh in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << sh:
            return f"{n >> sh} {unit}"
    return f"{n} B"


def time_gpu(fn: Callable[[], None], nbytes: int, stream: Any) -> float:
    """Seconds per call of ``fn`` (enqueued on ``stream``), by CUDA events."""
    iters = int(min(2000, max(5, 4e9 / max(nbytes, 1) / 3)))
    for _ in range(3):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(3):
        start.record(stream)
        for _ in range(iters):
            fn()
        end.record(stream)
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) * 1e-3 / iters)
    return best


def bandwidth(quick: bool) -> None:
    emit("## Kernel bandwidth: out = a + b (GB/s = 3 x bytes / time; copy: 2 x bytes / time)")
    emit("L2 is 50 MB on H200: sizes up to ~16 MiB x 3 buffers stay (partly) in L2.")
    stream = cp.cuda.Stream(non_blocking=True)
    sizes = [1 << s for s in range(10, 31, 2)]
    if quick:
        sizes = [1 << 10, 1 << 20, 1 << 24]
    for dname, dt, base_dt in (("float32", np.dtype(np.float32), cp.float32),
                               ("bfloat16", BFLOAT16, cp.float16)):
        emit()
        base = "cp.add" if dname == "float32" else "cp.add fp16"
        emit(f"### {dname} SUM")
        emit(f"{'size':>8} | {'acoll us':>9} {'GB/s':>7} | {base + ' us':>14} {'GB/s':>7} | "
             f"{'acoll/base':>10} | {'copy us':>8} {'GB/s':>7} | {'misaligned GB/s':>15}")
        for nb in sizes:
            ta, tb, tc, tm = measure_size(nb, dt, base_dt, stream)
            gb = 3 * nb / 1e9
            emit(f"{fmt_size(nb):>8} | {ta * 1e6:9.2f} {gb / ta:7.1f} | {tb * 1e6:14.2f} "
                 f"{gb / tb:7.1f} | {tb / ta:10.2f} | {tc * 1e6:8.2f} {2 * nb / 1e9 / tc:7.1f} | "
                 f"{gb / tm:15.1f}")


def measure_size(nb: int, dt: np.dtype[Any], base_dt: Any, stream: Any
                 ) -> tuple[float, float, float, float]:
    """Seconds per op: acoll SUM, CuPy add, D2D copy, acoll SUM misaligned (scalar)."""
    n = nb // dt.itemsize
    raw = cp.zeros(3 * nb + 64, cp.uint8)
    pa, pb, po = (raw.data.ptr + i * nb for i in range(3))
    with stream:
        ta = time_gpu(lambda: K.launch_reduce(po, pa, pb, n, "sum", dt, stream), nb, stream)
        a, b, o = cp.ones(n, base_dt), cp.ones(n, base_dt), cp.empty(n, base_dt)
        tb = time_gpu(lambda: cp.add(a, b, out=o), nb, stream)
        tc = time_gpu(lambda: cp.cuda.runtime.memcpyAsync(
            po, pa, nb, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr), nb, stream)
        # offsets 4/8/0 bytes mod 16: no shared 16-byte boundary -> the scalar kernel
        tm = time_gpu(lambda: K.launch_reduce(po + 4, pa + 8, pb, n - 16, "sum", dt, stream),
                      nb, stream)
    return ta, tb, tc, tm


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


async def wait_bench(method: str, dur: float, iters: int) -> tuple[list[float], float]:
    stream = cp.cuda.Stream(non_blocking=True)
    lat: list[float] = []
    for i in range(iters + 20):
        if i == 20:
            c0 = time.process_time()
        t0 = time.perf_counter()
        spin(dur, stream)
        if method == "busy":
            while not stream.done:
                pass
        elif method == "synchronize":
            stream.synchronize()
        else:
            await wait_stream(stream, method=method)
        if i >= 20:
            lat.append(time.perf_counter() - t0)
    return lat, (time.process_time() - c0) / iters


def run_loop(coro: Coroutine[Any, Any, Any], loop_name: str) -> Any:
    if loop_name == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


def completion(quick: bool) -> None:
    emit()
    emit("## Completion waits: launch a spin kernel of D us, await it (latency from launch)")
    emit("'busy' never yields to the loop and 'synchronize' blocks it: references only.")
    loops = ["asyncio", "uvloop"]
    for dur, iters in ((20e-6, 300 if quick else 2000), (2e-3, 30 if quick else 300)):
        for loop_name in loops:
            emit()
            emit(f"### D = {dur * 1e6:.0f} us, {loop_name} loop, {iters} waits")
            emit(f"{'method':>12} | {'p50 us':>8} {'p99 us':>8} | {'added p50':>9} "
                 f"{'added p99':>9} | {'CPU us/wait':>11}")
            res = {m: run_loop(wait_bench(m, dur, iters), loop_name)
                   for m in ("busy", "synchronize", *METHODS)}
            ref = pct(res["busy"][0], 50)
            for m, (lat, cpu) in res.items():
                emit(f"{m:>12} | {pct(lat, 50) * 1e6:8.1f} {pct(lat, 99) * 1e6:8.1f} | "
                     f"{(pct(lat, 50) - ref) * 1e6:9.1f} {(pct(lat, 99) - ref) * 1e6:9.1f} | "
                     f"{cpu * 1e6:11.1f}")


def compile_times() -> None:
    emit()
    emit("## Cold NVRTC compile (fresh CUPY_CACHE_DIR), one kernel each")
    old = os.environ.get("CUPY_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUPY_CACHE_DIR"] = tmp
        try:
            for op, dt, vec in (("max", "float16", True), ("min", "bfloat16", False),
                                ("prod", "int8", True), ("min", "float64", True)):
                src = K.reduce_source(op, dt, vec)
                t0 = time.perf_counter()
                K.get_kernel(src)
                emit(f"{src.name:>24}: {(time.perf_counter() - t0) * 1e3:7.1f} ms")
        finally:
            if old is None:
                del os.environ["CUPY_CACHE_DIR"]
            else:
                os.environ["CUPY_CACHE_DIR"] = old


def main() -> None:
    global cp, out_file
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="file to write the tables to")
    ap.add_argument("--quick", action="store_true", help="few sizes and waits")
    ap.add_argument("--only", choices=["bandwidth", "completion", "compile"], action="append")
    args = ap.parse_args()
    import cupy
    cp = cupy
    out_file = open(args.results, "w")  # noqa: SIM115 - kept open for the whole run
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    emit("# acoll GPU kernels and completion waits")
    emit(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    emit(f"gpu: {name}, {props['multiProcessorCount']} SMs; driver "
         f"{cp.cuda.runtime.driverGetVersion()}, runtime {cp.cuda.runtime.runtimeGetVersion()}"
         f"; CuPy {cp.__version__}; NumPy {np.__version__}")
    emit(f"host: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
         f"Python {platform.python_version()}")
    emit(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    only = set(args.only or ["compile", "bandwidth", "completion"])
    if "compile" in only:
        compile_times()
    if "bandwidth" in only:
        emit()
        bandwidth(args.quick)
    if "completion" in only:
        completion(args.quick)
    out_file.close()


if __name__ == "__main__":
    main()
