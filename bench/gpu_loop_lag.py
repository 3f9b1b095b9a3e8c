"""One rank of the GPU loop-lag and latency measurement (run under acoll-run).

    python -m acoll.run -n 2 -- python bench/gpu_loop_lag.py [--json FILE]

Each rank joins with ``device="auto"``. A ticker task (``await asyncio.sleep(0)`` in a
loop) records the longest wall-clock gap between its resumptions while the rank runs a
stream of 64 MiB all_reduces, first on GPU buffers (CuPy), then on host buffers (NumPy)
for comparison; then the awaited latency of 8 B all_reduces (median and p99 of single
ops) on both. Rank 0 prints one JSON document (and writes it to ``--json``).

``--gc collect|freeze`` collects (and freezes) the heap before each stream;
``--host-first`` swaps the two streams; ``--diagnose`` records Python's garbage
collections over 0.5 ms and the stacks of stalls over ``--dump-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import acoll

#: Whether a stream of ops is being timed (the slow-step log keeps only those steps).
STREAMING = False


class GcLog:
    """Python's garbage collections longer than 0.5 ms (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.passes: list[dict[str, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        if ms > 0.5:
            self.passes.append({"generation": info["generation"], "ms": round(ms, 2),
                                "collected": info["collected"]})


class Ticker:
    """Records the loop's gaps; with ``dump`` (a file), arms faulthandler at every tick
    so that a gap longer than ``dump_after_s`` writes every thread's stack there (from
    faulthandler's own thread: it needs no GIL, so it also catches C calls holding it)."""

    def __init__(self, dump: Any = None, dump_after_s: float = 0.004) -> None:
        self.gaps: list[float] = []
        #: (gap, the loop thread's CPU time within it), for gaps over 1 ms: a gap the
        #: loop's own code makes is on its CPU; one spent waiting (for the GIL, for a
        #: CPU) is not.
        self.long: list[tuple[float, float]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dump, self._after = dump, dump_after_s

    async def _run(self) -> None:
        last = time.perf_counter()
        cpu = time.thread_time()
        while not self._stop.is_set():
            if self._dump is not None:
                faulthandler.dump_traceback_later(self._after, file=self._dump)
            await asyncio.sleep(0)
            now = time.perf_counter()
            now_cpu = time.thread_time()
            gap = now - last
            self.gaps.append(gap)
            if gap > 1e-3:
                self.long.append((gap, now_cpu - cpu))
            last, cpu = now, now_cpu
        if self._dump is not None:
            faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> Ticker:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    async def done(self) -> dict[str, float]:
        assert self._task is not None
        await self._task
        g = sorted(self.gaps)
        top = sorted(self.long, reverse=True)[:5]
        return {"worst_ms": g[-1] * 1e3, "p99_ms": g[int(0.99 * (len(g) - 1))] * 1e3,
                "ticks": len(g), "over_1ms": len(self.long),
                "over_2ms": sum(1 for gap, _ in self.long if gap > 2e-3),
                "longest_ms_and_loop_cpu_ms": [[round(gap * 1e3, 3), round(c * 1e3, 3)]
                                               for gap, c in top]}


async def lag(comm: acoll.Communicator, x: Any, iters: int, diagnose: bool = False,
              gc_mode: str = "asis", dump_ms: float = 4.0) -> dict[str, Any]:
    await comm.all_reduce(x)  # warm-up: pools, kernels
    if gc_mode != "asis":
        gc.collect()
    if gc_mode == "freeze":
        gc.freeze()
    await comm.barrier()
    gclog = GcLog()
    dump = tempfile.TemporaryFile("w+") if diagnose else None  # noqa: SIM115
    if diagnose:
        gc.callbacks.append(gclog)
    t0 = time.perf_counter()
    global STREAMING
    STREAMING = True
    try:
        with Ticker(dump, dump_ms / 1e3) as ticker:
            for _ in range(iters):
                await comm.all_reduce(x)
        res: dict[str, Any] = dict(await ticker.done())
    finally:
        STREAMING = False
        if diagnose:
            gc.callbacks.remove(gclog)
    res["op_ms"] = (time.perf_counter() - t0) / iters * 1e3
    if gc_mode == "freeze":
        gc.unfreeze()
    if diagnose and dump is not None:
        dump.seek(0)
        res["gc_passes_over_0.5ms"] = gclog.passes
        res["stall_stacks"] = dump.read()[-200000:]
        dump.close()
    return res


async def latency(comm: acoll.Communicator, x: Any, iters: int) -> dict[str, float]:
    for _ in range(20):
        await comm.all_reduce(x)
    await comm.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await comm.all_reduce(x)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_us": statistics.median(times) * 1e6,
            "p99_us": times[int(0.99 * (len(times) - 1))] * 1e6}


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--diagnose", action="store_true",
                   help="record garbage collections and the stacks of stalls over 4 ms")
    p.add_argument("--gc", choices=["asis", "collect", "freeze"], default="asis",
                   help="before each stream: nothing; gc.collect(); or gc.collect() then "
                        "gc.freeze() (what serving systems do after start-up)")
    p.add_argument("--host-first", action="store_true",
                   help="run the host buffers' stream first (the GPU's second)")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument("--slow-ms", type=float,
                   help="asyncio's debug mode with this slow-callback bound: the steps "
                        "over it are logged (which task, where), kept in the JSON")
    p.add_argument("--dump-ms", type=float, default=4.0,
                   help="with --diagnose: stacks of stalls longer than this")
    args = p.parse_args()
    import cupy as cp

    slow: list[str] = []
    if args.slow_ms is not None:
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = args.slow_ms / 1e3

        import asyncio.base_events as base_events

        plain = base_events._format_handle  # type: ignore[attr-defined]

        def described(handle: Any) -> str:
            """The slow step's handle, with the chain of awaits its task waits on after
            the step (the step ran from the wait before it to this one)."""
            text = plain(handle)
            task = getattr(getattr(handle, "_callback", None), "__self__", None)
            chain = []
            coro = task.get_coro() if isinstance(task, asyncio.Task) else None
            while coro is not None and hasattr(coro, "cr_frame"):
                frame = coro.cr_frame
                if frame is not None:
                    chain.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:"
                                 f"{frame.f_lineno} {frame.f_code.co_name}")
                coro = coro.cr_await
            return " < ".join(chain) if chain else text[:300]

        base_events._format_handle = described  # type: ignore[attr-defined]

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                msg = record.getMessage()
                if "took" in msg and STREAMING:
                    slow.append(msg[len("Executing "):])

        logging.getLogger("asyncio").addHandler(_Keep())

    out: dict[str, Any] = {}
    count = args.mib << 18  # float32
    rank = size = device = -1

    async def on_gpu() -> None:
        nonlocal rank, size, device
        gpu = await acoll.init_from_env(device="auto")
        async with gpu:
            with cp.cuda.Device(gpu.device):
                x = cp.ones(count, cp.float32)
                small = cp.ones(2, cp.float32)
            out["gpu_lag"] = await lag(gpu, x, args.iters, args.diagnose, args.gc,
                                       args.dump_ms)
            out["gpu_latency_8B"] = await latency(gpu, small, 300)
            rank, size, device = gpu.rank, gpu.size, gpu.device

    async def on_host() -> None:
        host = await acoll.init_from_env()
        async with host:
            out["host_lag"] = await lag(host, np.ones(count, np.float32), args.iters,
                                        args.diagnose, args.gc, args.dump_ms)
            out["host_latency_8B"] = await latency(host, np.ones(2, np.float32), 300)

    for phase in ((on_host, on_gpu) if args.host_first else (on_gpu, on_host)):
        await phase()
    out["latency_delta_us"] = (out["gpu_latency_8B"]["median_us"]
                               - out["host_latency_8B"]["median_us"])
    if args.slow_ms is not None:
        out["slow_steps"] = slow[-200:]
        out["slow_steps_total"] = len(slow)
    out.update(rank=rank, nranks=size, device=device, mib=args.mib, gc=args.gc,
               host_first=args.host_first,
               loop=type(asyncio.get_running_loop()).__module__)
    if rank == 0:
        text = json.dumps(out, indent=1)
        print(text, flush=True)
        if args.json:
            _write(args.json, text + "\n")


if __name__ == "__main__":
    if "--loop" in sys.argv and sys.argv[sys.argv.index("--loop") + 1] == "asyncio":
        asyncio.run(main())
    else:
        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
