"""Where acoll's copy counters break the CUDA context (session 45). Each case runs in a
fresh process (a crash hides nothing else):

- ``staging``: CudaStaging's piecewise copies driven by hand (no ring), one step at a
  time, the context checked after each (a CuPy op and an event sync);
- ``ring-down``, ``ring-up``, ``ring-both``: two ranks of one process over TCP, 1 MiB and
  12 MiB float32 all_reduces with ``ACOLL_GPU_VIA_HOST_COUNTERS`` at that value, checked
  after each call.

Run on a GPU host:

    python bench/counters_probe.py [CASE]
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


async def ring(mode: str) -> None:
    import os

    import cupy as cp

    import acoll
    from acoll.testing import run_ranks

    for name in ("ACOLL_P2P_DISABLE", "ACOLL_SHM_DISABLE", "ACOLL_INPROC_DISABLE"):
        os.environ[name] = "1"
    os.environ["ACOLL_GPU_VIA_HOST_COUNTERS"] = mode

    async def fn(comm: acoll.Communicator) -> None:
        for n in ((1 << 18) + 7, 3_000_001, 3_000_001):
            with cp.cuda.Device(0):
                x = cp.ones(n, cp.float32)
            await comm.all_reduce(x)
            ok(cp, f"rank {comm.rank}, {n} floats: {float(x.get()[-1])} (2 expected), "
               f"counters {len(comm.mem.staging()._signals)}")

    await run_ranks(2, fn, device=0)


if __name__ == "__main__":
    import subprocess
    import sys

    cases = ["staging", "ring-down", "ring-up", "ring-both"]
    if len(sys.argv) == 1:
        for case in cases:
            r = subprocess.run([sys.executable, __file__, case], capture_output=True,
                               text=True, timeout=120)
            print(f"## {case}: exit {r.returncode}", *(r.stdout + r.stderr).splitlines()[-12:],
                  sep="\n  ", flush=True)
    else:
        try:
            asyncio.run(main() if sys.argv[1] == "staging" else ring(sys.argv[1][5:]))
        except Exception:
            traceback.print_exc()
            sys.exit(1)
