"""Where a 1 to 64 MiB GPU all_reduce's time goes on the via-host paths (issue 9).

The record of ``results/session21_h200x2/probe/``: its timed copy of ``ViaHost.run``
follows the code at a8563b4 and does not run against later code; ``via_host_paths.py``
replaces it.

    python -m acoll.run -n 2 -- python bench/via_host_breakdown.py [--mib 1 4 64] [--ops 20]

Each rank forms a GPU communicator (``device="auto"``) and a host-only one. Per size and
mode (in place / out of place) it times, in alternating blocks of ``--ops`` awaited
float32 sums: the host communicator; the GPU one on its ordered path
(:class:`acoll._comm.via_host.ViaHost`, copies pipelined with the ring), with its stages
timed by a patched copy of ``ViaHost.run``; and, when ``--direct`` is given, the GPU one
with the direct path's limit raised to every size (both copies on the caller's stream,
whole). Rank 0 prints per variant the median op time and, for the ordered path, the
median of each stage (microseconds).

``--per-proc K`` runs K ranks in each process (one event loop, over sockets between them:
set ``ACOLL_INPROC_DISABLE=1``), all on the process's GPU (process index modulo the GPUs):
ranks sharing a GPU then share its CUDA context instead of time-slicing two; stages are
not timed then.
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
from acoll._coll.algorithms import _chunk_items
from acoll._comm import via_host

clock = time.perf_counter_ns
marks: list[list[int]] = []
ready_wait = [0, 0]  # ns awaiting downloads in RingStaging.ready, waits that slept
STAGES = ("call to run", "lease", "downloads enqueued", "algorithm (with ready waits)",
          "finish (last upload enqueued)", "upload waited", "release and return")

_ready = via_host.RingStaging.ready


async def timed_ready(self: Any, *args: Any) -> None:
    t = clock()
    await _ready(self, *args)
    d = clock() - t
    ready_wait[0] += d
    ready_wait[1] += d > 5000


async def timed_run(self: Any) -> None:
    m = marks[-1] if marks else []
    m.append(clock())
    deadline = asyncio.get_running_loop().time() + self.timeout
    staging = self.mem.staging()
    order, ctx = self.order, self.ctx
    view, block = await staging.lease_async(self.send.nbytes)
    m.append(clock())
    data = self.host.wrap(view.array.view(self.send.dtype))
    ctx.mem = self.host
    fence = None
    try:
        if self.ring and self.send.count > _chunk_items(ctx, self.send.itemsize):
            stage = via_host.RingStaging(staging, order, self.send, self.recv, data, ctx,
                                         deadline)
            ctx.stage = stage
            m.append(clock())
            try:
                await self.make(ctx, data, data).run()
            finally:
                fence = stage.last
            m.append(clock())
            fence = stage.finish()
        else:
            fence = staging.download_first(order, view, self.send)
            m.append(clock())
            await fence.wait(deadline)
            await self.make(ctx, data, data).run()
            m.append(clock())
            fence = staging.upload_last(order, self.recv, view)
        m.append(clock())
        if order.settle:
            await fence.wait(deadline)
        m.append(clock())
    finally:
        staging.release(block, fence)


async def block(comms: list[acoll.Communicator], xs: list[Any], outs: list[Any], ops: int,
                timed: bool) -> float:
    await asyncio.gather(*(c.barrier() for c in comms))
    t0 = time.perf_counter()
    if len(comms) == 1:
        comm, x, out = comms[0], xs[0], outs[0]
        for _ in range(ops):
            if timed:
                marks.append([clock()])
            await comm.all_reduce(x, out)
            if timed:
                marks[-1].append(clock())
    else:
        for _ in range(ops):
            await asyncio.gather(*(c.all_reduce(x, o)
                                   for c, x, o in zip(comms, xs, outs, strict=True)))
    return (time.perf_counter() - t0) / ops


async def communicators(per_proc: int, device: bool) -> list[acoll.Communicator]:
    if per_proc == 1:
        return [await acoll.init_from_env(device="auto" if device else None)]
    from acoll._env import _gpu_count, ranks_from_env

    info = ranks_from_env()
    uid = acoll.UniqueId.from_address(info.comm_id)
    dev = info.rank % _gpu_count() if device else None
    return list(await asyncio.gather(*(
        acoll.init_rank(info.world_size * per_proc, uid, info.rank * per_proc + i,
                        device=dev) for i in range(per_proc))))


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, nargs="+", default=[1, 4, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", type=int, default=10)
    p.add_argument("--direct", action="store_true")
    p.add_argument("--per-proc", type=int, default=1)
    args = p.parse_args()
    import cupy as cp

    if args.per_proc == 1:
        via_host.ViaHost.run = timed_run  # type: ignore[method-assign]
        via_host.RingStaging.ready = timed_ready  # type: ignore[method-assign]
    direct_max = _communicator._VIA_DIRECT_MAX
    gpus = await communicators(args.per_proc, True)
    hosts = await communicators(args.per_proc, False)
    gpu, k = gpus[0], len(gpus)
    out_lines: list[str] = []
    for mib in args.mib:
        n = int(mib * (1 << 18))
        with cp.cuda.Device(gpu.device):
            xg = [cp.ones(n, cp.float32) for _ in range(k)]
            og = [cp.zeros(n, cp.float32) for _ in range(k)]
        xh = [np.ones(n, np.float32) for _ in range(k)]
        oh = [np.zeros(n, np.float32) for _ in range(k)]
        for mode in ("out", "in"):
            variants: dict[str, tuple[Any, Any, Any]] = {
                "host": (hosts, xh, oh if mode == "out" else [None] * k),
                "gpu": (gpus, xg, og if mode == "out" else [None] * k)}
            if args.direct:
                variants["gpu-direct"] = variants["gpu"]
            for name, (comm, x, out) in variants.items():
                _communicator._VIA_DIRECT_MAX = (  # type: ignore[attr-defined]
                    1 << 40 if name == "gpu-direct" else direct_max)
                await block(comm, x, out, 1, False)  # warm-up: pools, plans
            times: dict[str, list[float]] = {k: [] for k in variants}
            stage_rows: list[list[int]] = []
            ready_wait[:] = [0, 0]
            for r in range(args.rounds):
                names = list(variants) if r % 2 == 0 else list(reversed(variants))
                for name in names:
                    comm, x, out = variants[name]
                    _communicator._VIA_DIRECT_MAX = (  # type: ignore[attr-defined]
                        1 << 40 if name == "gpu-direct" else direct_max)
                    marks.clear()
                    timed = name == "gpu"
                    times[name].append(await block(comm, x, out, args.ops, timed))
                    if timed:
                        stage_rows += [m for m in marks if len(m) == len(STAGES) + 1]
            _communicator._VIA_DIRECT_MAX = direct_max  # type: ignore[attr-defined]
            h = statistics.median(times["host"])
            out_lines.append(f"## {mib:g} MiB {mode}: host {h * 1e6:9.1f} us")
            for name in variants:
                if name != "host":
                    g = statistics.median(times[name])
                    out_lines.append(f"   {name:<11} {g * 1e6:9.1f} us  ratio host/gpu "
                                     f"{h / g:.2f}")
            if stage_rows:
                for k, stage in enumerate(STAGES):
                    med = statistics.median(m[k + 1] - m[k] for m in stage_rows) / 1e3
                    out_lines.append(f"     {stage:<34} {med:9.1f}")
                ops = len(stage_rows)
                out_lines.append(f"     {'ready waits (per op)':<34} "
                                 f"{ready_wait[0] / ops / 1e3:9.1f}  "
                                 f"({ready_wait[1] / ops:.1f} waits > 5 us per op)")
        del xg, og
    await asyncio.gather(*(c.close() for c in gpus + hosts))
    if gpu.rank == 0:
        print(f"# via-host breakdown, {gpu.size} ranks ({k} per process), float32 sum, "
              f"transport {gpu.transport_name(1)}, {args.rounds} rounds of {args.ops} ops "
              f"(median)")
        print("\n".join(out_lines))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
