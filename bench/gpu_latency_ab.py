"""Awaited latency of a small all_reduce on GPU buffers against host buffers, interleaved.

    python -m acoll.run -n 2 -- python bench/gpu_latency_ab.py [--bytes 8] [--rounds 20]

Each rank forms two communicators over the same transports, one on its GPU
(``device="auto"``) and one host-only, then alternates blocks of ``--ops`` single awaited
all_reduces (float32 sum) on each, the order of the two swapped every round, so that drift
of the machine (clocks, placement) lands on both alike. Rank 0 prints, per round, the
median op time of each and the difference, then the median over rounds; with ``--json``
it also writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

import acoll


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text + "\n")


async def block(comm: acoll.Communicator, x: Any, ops: int) -> float:
    await comm.barrier()
    times = []
    for _ in range(ops):
        t0 = time.perf_counter()
        await comm.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--json")
    args = p.parse_args()
    import cupy as cp

    gpu = await acoll.init_from_env(device="auto")
    host = await acoll.init_from_env()
    n = max(args.bytes // 4, 1)
    with cp.cuda.Device(gpu.device):
        xg = cp.ones(n, cp.float32)
    xh = np.ones(n, np.float32)
    for _ in range(300):  # warm-up: plans, pools, connections
        await gpu.all_reduce(xg)
        await host.all_reduce(xh)
    rows = []
    for r in range(args.rounds):
        pair = [(gpu, xg), (host, xh)] if r % 2 == 0 else [(host, xh), (gpu, xg)]
        res = {}
        for comm, x in pair:
            res["gpu" if comm is gpu else "host"] = await block(comm, x, args.ops)
        rows.append((res["gpu"], res["host"]))
    await gpu.close()
    await host.close()
    if gpu.rank == 0:
        print(f"# {args.bytes} B all_reduce, {gpu.size} ranks, awaited, median of {args.ops} "
              f"ops per block, {args.rounds} rounds; transport {gpu.transport_name(1)}")
        print(f"{'round':>5} {'gpu us':>9} {'host us':>9} {'delta us':>9}")
        for i, (g, h) in enumerate(rows):
            print(f"{i:>5} {g:>9.1f} {h:>9.1f} {g - h:>+9.1f}")
        deltas = sorted(g - h for g, h in rows)
        summary = {"gpu_us": statistics.median(g for g, _ in rows),
                   "host_us": statistics.median(h for _, h in rows),
                   "delta_us": statistics.median(deltas),
                   "delta_min_us": deltas[0], "delta_max_us": deltas[-1],
                   "bytes": args.bytes, "ranks": gpu.size, "rounds": rows}
        print(f"median over rounds: gpu {summary['gpu_us']:.1f} us, host "
              f"{summary['host_us']:.1f} us, delta {summary['delta_us']:+.1f} us "
              f"(rounds {deltas[0]:+.1f} to {deltas[-1]:+.1f})")
        if args.json:
            _write(args.json, json.dumps(summary, indent=1))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
