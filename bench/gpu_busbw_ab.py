"""all_reduce busbw of GPU against host buffers, paired in the same processes.

    python -m acoll.run -n 2 -- python bench/gpu_busbw_ab.py [--mib 1 4 16 64] [--rounds 4]

Each rank forms a GPU communicator (``device="auto"``) and a host-only one over the same
transports; per size and mode (in place, out of place), it alternates blocks of ``--ops``
timed all_reduces (float32 sum; the order of the two swapped every round), so that the
machine's drift and the processes' placement land on both alike. Rank 0 prints per size and
mode the busbw of each (median over rounds) and the ratio GPU / host per round.
``--no-pipe`` adds the GPU communicator with the ring's copies not pipelined (the whole
input down, the algorithm, the whole result up), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

import acoll
from acoll import _communicator


async def block(comm: acoll.Communicator, x: Any, out: Any, ops: int) -> float:
    """Seconds per op over ``ops`` back-to-back all_reduces (after a barrier)."""
    await comm.barrier()
    t0 = time.perf_counter()
    for _ in range(ops):
        await comm.all_reduce(x, out)
    return (time.perf_counter() - t0) / ops


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", type=int, default=6)
    p.add_argument("--no-pipe", action="store_true")
    args = p.parse_args()
    pipelines = _communicator.pipelines
    import cupy as cp

    gpu = await acoll.init_from_env(device="auto")
    host = await acoll.init_from_env()
    factor = 2 * (gpu.size - 1) / gpu.size
    lines = []
    for mib in args.mib:
        n = mib << 18
        with cp.cuda.Device(gpu.device):
            xg, og = cp.ones(n, cp.float32), cp.zeros(n, cp.float32)
        xh, oh = np.ones(n, np.float32), np.zeros(n, np.float32)
        for mode in ("out", "in"):
            bufs = {"gpu": (gpu, xg, og if mode == "out" else None),
                    "host": (host, xh, oh if mode == "out" else None)}
            if args.no_pipe:
                bufs["gpu-nopipe"] = bufs["gpu"]
            for comm, x, out in bufs.values():
                await comm.all_reduce(x, out)  # warm-up: pools, connections
            res: dict[str, list[float]] = {name: [] for name in bufs}
            for r in range(args.rounds):
                names = list(bufs) if r % 2 == 0 else list(reversed(bufs))
                for name in names:
                    comm, x, out = bufs[name]
                    _communicator.pipelines = (  # type: ignore[attr-defined]
                        (lambda cls, nbytes: False) if name == "gpu-nopipe" else pipelines)
                    res[name].append(factor * n * 4 / await block(comm, x, out, args.ops) / 1e9)
            _communicator.pipelines = pipelines  # type: ignore[attr-defined]
            h = statistics.median(res["host"])
            for name in (k for k in res if k != "host"):
                g = statistics.median(res[name])
                ratios = " ".join(f"{a / b:.2f}" for a, b in zip(res[name], res["host"],
                                                                  strict=True))
                lines.append(f"{mib:>4} MiB {mode:<3} {name:<10} {g:6.2f}  host {h:6.2f} "
                             f"GB/s  ratio {g / h:.2f}  (per round {ratios})")
        del xg, og
    await gpu.close()
    await host.close()
    if gpu.rank == 0:
        print(f"# all_reduce busbw, {gpu.size} ranks, float32 sum, transport "
              f"{gpu.transport_name(1)}, {args.rounds} rounds of {args.ops} ops (median)")
        print("\n".join(lines))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
