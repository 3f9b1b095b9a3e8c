"""Where a small GPU all_reduce's time goes on the direct via-host path (issue 9).

    python -m acoll.run -n 2 -- python bench/via_host_stages.py [--ops 3000]

Each rank forms a GPU communicator (``device="auto"``) and runs ``--ops`` awaited 8 B
all_reduces with the stages of ``acoll._comm.via_host.DirectCall.run`` timed (a copy of it
with clock reads between the stages, patched in for this run), and the time from the call
to the run's start (which includes enqueueing the download) and from its end to the
return. Rank 0 prints the median of each stage in microseconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import acoll
from acoll._comm import via_host

STAGES = ("call to run (download enqueued)", "download waited", "host algorithm",
          "upload enqueued", "upload waited", "run to return")
marks: list[list[int]] = []
clock = time.perf_counter_ns


async def timed_run(self: Any) -> None:
    m = marks[-1]
    m.append(clock())
    deadline = asyncio.get_running_loop().time() + self.timeout
    plan = self.plan
    await self.download.wait_soon(deadline)
    m.append(clock())
    self.ctx.mem = self.host
    await plan.cls(self.ctx, plan.data, plan.data, plan.op).run()
    m.append(clock())
    plan.last = fence = plan.staging.upload_on(self.stream, self.recv, plan.view)
    m.append(clock())
    if self.settle:
        await fence.wait_soon(deadline)
    m.append(clock())


async def main() -> None:
    import argparse

    import cupy as cp

    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=3000)
    args = p.parse_args()
    via_host.DirectCall.run = timed_run  # type: ignore[method-assign]
    comm = await acoll.init_from_env(device="auto")
    with cp.cuda.Device(comm.device):
        x = cp.ones(2, cp.float32)
    for i in range(args.ops + 300):
        if i == 300:
            marks.clear()
            await comm.barrier()
        marks.append([clock()])
        await comm.all_reduce(x)
        marks[-1].append(clock())
    await comm.close()
    if comm.rank == 0:
        full = [m for m in marks if len(m) == 7]
        print(f"# {len(full)} awaited 8 B all_reduces on cuda:{comm.device}, {comm.size} ranks"
              f" (median us per stage)")
        for k, name in enumerate(STAGES):
            print(f"{name:<32} {statistics.median(m[k + 1] - m[k] for m in full) / 1e3:8.1f}")
        print(f"{'total':<32} {statistics.median(m[-1] - m[0] for m in full) / 1e3:8.1f}")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
