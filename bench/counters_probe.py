"""Where acoll's copy counters break the CUDA context (session 45): CudaStaging's
piecewise copies driven by hand (no ring), one step at a time, the context checked after
each (a CuPy op and an event sync). Run on a GPU host:

    python bench/counters_probe.py
"""

from __future__ import annotations

import asyncio
import traceback

import numpy as np


def ok(cp: object, what: str) -> None:
    import cupy

    a = cupy.ones(8, cupy.float32) + 1
    e = cupy.cuda.Event()
    e.record()
    e.synchronize()
    print(f"ok after {what}: {float(a.sum())}", flush=True)


async def main() -> None:
    import cupy as cp

    from acoll._memory.cuda import CudaSpace

    space = CudaSpace(0)
    staging = space.staging()
    n = 1 << 20
    x = cp.arange(n // 4, dtype=cp.float32)
    y = cp.zeros(n // 4, cp.float32)
    src = space.adopt(x, "x")
    dst = space.adopt(y, "y", writable=True)
    stream = space.resolve_stream(None)
    view, block = staging.lease(n)
    sig = staging.signals(block)
    print("signals", sig is not None, staging._signals_work, flush=True)
    ok(cp, "signals (probe)")
    pieces = [(a, min(a + n // 4, n)) for a in range(0, n, n // 4)]
    sig.begin(len(pieces))
    f = staging.download_pieces_on(stream, view, src, pieces, sig)
    await f.wait()
    print("ready", int(sig.words[0]) - sig.ready_base, "landed",
          bool((view.array.view(np.float32) == np.arange(n // 4)).all()), flush=True)
    ok(cp, "downloads")
    sig.words[sig.FINAL] = sig.final_value(len(pieces) - 1)  # (all final already)
    up = staging.upload_pieces_on(stream, dst, view, pieces, sig)
    await up.wait()
    ok(cp, "uploads, counter met before")
    sig.begin(len(pieces))
    up = staging.upload_pieces_on(stream, dst, view, pieces, sig)
    await asyncio.sleep(0.01)
    print("upload done before the counter moved?", up.done(), flush=True)
    for i in range(len(pieces)):
        sig.words[sig.FINAL] = sig.final_value(i)
        await asyncio.sleep(0.002)
    await up.wait()
    ok(cp, "uploads, counter moved after")
    staging.join_on(stream, up)
    stream.synchronize()
    ok(cp, "join_on")
    print("result", bool((y == x).all()), flush=True)
    staging.release(block, up)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception:
        traceback.print_exc()
