"""One rank of a P2P latency loop, for py-spy (issue 10's per-call CPU breakdown).

    python -m acoll.run -n 2 -- bash bench/spy_rank0.sh python bench/p2p_spy.py [N]

Each rank (one per GPU) runs N pipelined 8 B all_reduces on a stream, then N awaited
ones, and prints the time per op; with SPY_OUT set, rank 0 runs under py-spy.
"""

from __future__ import annotations

import asyncio
import sys
import time

import cupy as cp

import acoll

N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000


async def main() -> None:
    async with await acoll.init_from_env(device="auto") as comm:
        with cp.cuda.Device(comm.device):
            x = cp.ones(2, cp.float32)
            st = cp.cuda.Stream(non_blocking=True)
        for _ in range(200):
            await comm.all_reduce(x, stream=st)
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(N):
            await comm.all_reduce(x, stream=st)
        st.synchronize()
        pipe = (time.perf_counter() - t0) / N
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(N):
            await comm.all_reduce(x)
        awaited = (time.perf_counter() - t0) / N
        print(f"rank {comm.rank}: pipelined {pipe * 1e6:.1f} us/op, awaited {awaited * 1e6:.1f}"
              f" us/op, p2p={comm._p2p is not None}", flush=True)


try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
