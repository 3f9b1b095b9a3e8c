"""GPU all_reduce over sockets through the host, 1 to 64 MiB: the paths side by side (issue 9).

    python -m acoll.run -n 2 -- python bench/via_host_paths.py [--mib 1 4 16 64] [--ops 10]
        [--variants gpu gpu-counters ...]

Each rank forms a GPU communicator (``device="auto"``) and a host-only one. Per size and
mode (in place / out of place) it times, in alternating blocks of ``--ops`` awaited
float32 sums (the order reversed every round):

- ``host``: the host communicator on NumPy buffers;
- ``gpu``: the GPU one as it is (back-to-back calls take the direct path: a pooled block,
  copies on the caller's stream; where the communicator has the native ring, the ring is
  ``ring.c`` with its copies pipelined through copy counters from 512 KiB, as
  ``ACOLL_GPU_VIA_HOST_COUNTERS`` says (both ways by default since session 46), else the
  Python ring with its copies pipelined), its stages timed by a patched copy of
  ``DirectLarge.run`` (on the counters' path "algorithm" is the whole C call, copies
  included, and "finish" is empty);
- ``gpu-counters``, ``gpu-counters-down``, ``gpu-counters-up`` (only with ``--variants``):
  the native ring with its copies pipelined through copy counters, both ways, the
  downloads only, the uploads only (``ACOLL_GPU_VIA_HOST_COUNTERS`` at 1, down, up);
- ``gpu-piece-256K``, ``-512K``, ``-1M`` (only with ``--variants``): the counters both
  ways with that copy piece (``ACOLL_GPU_VIA_HOST_PIECE``) instead of the automatic one;
- ``gpu-whole``: the native ring on one whole copy each way (session 44's way, the
  default until session 46; ``ACOLL_GPU_VIA_HOST_PIPELINE=0``);
- ``gpu-ordered``: the ordered path (copies on acoll's stream after events): the direct
  path refused by a pool that reports no block;
- ``gpu-python``: the direct path on the Python ring (the native ring hidden), copies
  pipelined with it (the default before session 44);
- ``gpu-python-whole``: the same with one copy each way (``ACOLL_GPU_VIA_HOST_PIPELINE=0``).

(In ``results/session21_h200x2/`` before ``check2/``, the pipelined copies were not yet
the default: there ``gpu`` is one copy each way and ``gpu-pipe`` the pipelined variant;
in ``paths/`` ``gpu`` was pipelined, with the hooks' old per-call cost.)

Rank 0 prints per variant the median op time, the ratio host / variant, and the median of
each stage of ``gpu`` (microseconds). ``--per-proc K``: as in via_host_breakdown.py;
``--switch S``: ``sys.setswitchinterval(S)`` first (how long a thread holds the GIL
against another that wants it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from via_host_breakdown import block, communicators, marks

from acoll import _communicator
from acoll._comm import via_host
from acoll._config import parse_size
from acoll._memory.base import Staging

clock = time.perf_counter_ns

STAGES = ("call to run (downloads enqueued)", "algorithm (with ready waits)",
          "finish (uploads enqueued)", "upload waited", "release and return")


async def timed_run(self: Any) -> None:
    """``DirectLarge.run`` with clock reads between its stages."""
    m = marks[-1] if marks else []
    m.append(clock())
    self.started = True
    deadline = asyncio.get_running_loop().time() + self.timeout
    ctx, data, stage = self.ctx, self.data, self.stage
    ctx.mem = self.host
    waited = False
    try:
        if self.copies is not None:  # (the native ring, its copies pipelined by counters)
            await self.run_copies(deadline)
            m.append(clock())
        elif stage is None:
            await self.last.wait(deadline)
            if self.native is not None:
                await self.native.run()
            else:
                await self.cls(ctx, data, data, self.op).run()
            m.append(clock())
            self._last = self.staging.upload_on(self.stream, self.recv, self.view, own=True)
        else:
            stage.deadline = deadline
            ctx.stage = stage
            await self.cls(ctx, data, data, self.op).run()
            m.append(clock())
            stage.finish()
        m.append(clock())
        fence = self.last
        if self.settle:
            await fence.wait(deadline)
            waited = True
        m.append(clock())
    finally:
        self.staging.release(self.block, None if waited else self.last)


#: time (ns) and calls in RingStaging.ready / .final, and ready calls over 5 us
hooks = {"ready_ns": 0, "ready_calls": 0, "ready_slow": 0, "final_ns": 0, "final_calls": 0}
_ready, _final = via_host.RingStaging.ready, via_host.RingStaging.final


async def timed_ready(self: Any, *args: Any) -> None:
    t = clock()
    await _ready(self, *args)
    d = clock() - t
    hooks["ready_ns"] += d
    hooks["ready_calls"] += 1
    hooks["ready_slow"] += d > 5000


def timed_final(self: Any, *args: Any) -> None:
    t = clock()
    _final(self, *args)
    hooks["final_ns"] += clock() - t
    hooks["final_calls"] += 1


sync_ns: list[int] = []  # per direct call: the synchronous part (lease, downloads)
stage_ns: list[int] = []  # of it: RingStaging's construction (the downloads enqueued)


def timed_sync(real: Any) -> Any:
    def wrapper(*args: Any) -> Any:
        t = clock()
        res = real(*args)
        sync_ns.append(clock() - t)
        return res
    return wrapper


def timed_stage(real: Any) -> Any:
    def wrapper(*args: Any) -> None:
        t = clock()
        real(*args)
        stage_ns.append(clock() - t)
    return wrapper


#: ``--detail``: time (ns) per call of the synchronous pieces of a direct call, by name
detail: dict[str, list[int]] = {}


def timed_piece(name: str, real: Any) -> Any:
    def wrapper(*args: Any, **kw: Any) -> Any:
        t = clock()
        res = real(*args, **kw)
        detail.setdefault(name, []).append(clock() - t)
        return res
    return wrapper


def patch_detail() -> None:
    """Time the pieces of a direct call's synchronous part (``--detail``)."""
    from acoll._memory import cuda

    for cls, names in ((Staging, ("lease_now",)),
                       (cuda.CudaStaging, ("signals", "download_pieces_on",
                                           "upload_pieces_on", "caller_stream",
                                           "download_on", "upload_on")),
                       (via_host.NativeCopies, ("__init__", "start_uploads", "finish")),
                       (_communicator.Communicator, ("_via_native",))):
        for name in names:
            setattr(cls, name, timed_piece(f"{cls.__name__}.{name}", getattr(cls, name)))
    for cls, names in ((cuda._StreamMemOps, ("write", "wait")),
                       (cuda.CudaSpace, ("take_event", "give_event"))):
        for name in names:
            setattr(cls, name, timed_piece(f"{cls.__name__}.{name}", getattr(cls, name)))
    import cupy

    runtime = cupy.cuda.runtime
    runtime.memcpyAsync = timed_piece("runtime.memcpyAsync", runtime.memcpyAsync)
    runtime.getDevice = timed_piece("runtime.getDevice", runtime.getDevice)


def variant(name: str, comms: list[Any]) -> Callable[[], None]:
    """Set the patches of variant ``name`` (and undo every other's)."""
    lease_now = Staging.lease_now
    natives = [comm._native for comm in comms]
    counters = [comm._via_counters for comm in comms]  # (as the settings resolved them)
    piece = comms[0]._via_piece
    pipeline_min = via_host.NATIVE_PIPELINE_MIN

    def apply() -> None:
        via_host.NATIVE_PIPELINE_MIN = (256 << 10 if name == "gpu-counters-small"
                                        else pipeline_min)
        Staging.lease_now = (  # type: ignore[method-assign]
            (lambda self, nbytes: None) if name == "gpu-ordered" else lease_now)
        for comm, native, default in zip(comms, natives, counters, strict=True):
            comm._via_pipe = name not in ("gpu-python-whole", "gpu-whole")
            comm._native = None if name.startswith("gpu-python") else native
            comm._via_counters = COUNTERS.get(name, default if name == "gpu" else "")
            comm._via_piece = parse_size(PIECES[name]) if name in PIECES else piece
            if name in PIECES:
                comm._via_counters = "both"

    return apply


#: variants on the native ring with copy counters (ACOLL_GPU_VIA_HOST_COUNTERS)
COUNTERS = {"gpu-counters": "both", "gpu-counters-down": "down", "gpu-counters-up": "up",
            "gpu-counters-small": "both"}
#: gpu-counters-small: the counters also below NATIVE_PIPELINE_MIN (from 256 KiB a rank)
#: the counters both ways with a fixed copy piece (ACOLL_GPU_VIA_HOST_PIECE; auto: an
#: eighth of the call, 256 KiB to 4 MiB)
PIECES = {"gpu-piece-256K": "256K", "gpu-piece-512K": "512K", "gpu-piece-1M": "1M",
          "gpu-piece-2M": "2M", "gpu-piece-4M": "4M", "gpu-piece-8M": "8M",
          "gpu-eighth": "0"}
#: gpu-eighth: the automatic piece before session 47 (an eighth of the call, 256 KiB to
#: 4 MiB), set per size in main()


def eighth(nbytes: int) -> str:
    return str(min(4 << 20, max(256 << 10, nbytes // 8)))
VARIANTS = ["host", "gpu", "gpu-whole", "gpu-ordered", "gpu-python", "gpu-python-whole",
            *COUNTERS, *PIECES]


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", choices=VARIANTS[1:],
                   default=["gpu", "gpu-whole", "gpu-ordered", "gpu-python",
                            "gpu-python-whole"],
                   help="GPU variants to time beside host (gpu: the default path)")
    p.add_argument("--mib", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", type=int, default=10)
    p.add_argument("--per-proc", type=int, default=1)
    p.add_argument("--switch", type=float, help="sys.setswitchinterval (seconds)")
    p.add_argument("--detail", action="store_true",
                   help="time the synchronous pieces of the default path's calls")
    args = p.parse_args()
    import cupy as cp

    if args.switch:
        import sys

        sys.setswitchinterval(args.switch)
    if args.per_proc == 1:
        via_host.DirectLarge.run = timed_run  # type: ignore[method-assign]
        _communicator.Communicator._via_host_direct_large = timed_sync(  # type: ignore[method-assign]
            _communicator.Communicator._via_host_direct_large)
        via_host.RingStaging.__init__ = timed_stage(  # type: ignore[method-assign]
            via_host.RingStaging.__init__)
        via_host.RingStaging.ready = timed_ready  # type: ignore[method-assign]
        via_host.RingStaging.final = timed_final  # type: ignore[method-assign]
    if args.detail:
        patch_detail()
    gpus = await communicators(args.per_proc, True)
    hosts = await communicators(args.per_proc, False)
    gpu, per = gpus[0], len(gpus)
    names = ["host", *args.variants]
    patch = {name: variant(name, gpus) for name in names}
    lines: list[str] = []
    for mib in args.mib:
        n = int(mib * (1 << 18))
        PIECES["gpu-eighth"] = eighth(n * 4)
        with cp.cuda.Device(gpu.device):
            xg = [cp.ones(n, cp.float32) for _ in range(per)]
            og = [cp.zeros(n, cp.float32) for _ in range(per)]
        xh = [np.ones(n, np.float32) for _ in range(per)]
        oh = [np.zeros(n, np.float32) for _ in range(per)]
        for mode in ("out", "in"):
            bufs = {name: (hosts, xh, oh if mode == "out" else [None] * per)
                    if name == "host" else (gpus, xg, og if mode == "out" else [None] * per)
                    for name in names}
            for name in names:
                patch[name]()
                await block(*bufs[name], 2, False)  # warm-up: pools, plans
            times: dict[str, list[float]] = {name: [] for name in names}
            hook_sums: dict[str, dict[str, int]] = {name: dict.fromkeys(hooks, 0)
                                                    for name in names}
            rows: list[list[int]] = []
            syncs: list[int] = []
            stages: list[int] = []
            details: dict[str, list[int]] = {}
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    patch[name]()
                    marks.clear()
                    del sync_ns[:], stage_ns[:]
                    detail.clear()
                    timed = name == "gpu" and per == 1
                    before = dict(hooks)
                    times[name].append(await block(*bufs[name], args.ops, timed))
                    for key in hooks:
                        hook_sums[name][key] += hooks[key] - before[key]
                    if timed:
                        for key, ns in detail.items():
                            details.setdefault(key, []).extend(ns)
                        rows += [m for m in marks if len(m) == len(STAGES) + 1]
                        syncs += sync_ns
                        stages += stage_ns
            patch["gpu" if "gpu" in patch else names[1]]()
            h = statistics.median(times["host"])
            lines.append(f"## {mib:g} MiB {mode}: host {h * 1e6:9.1f} us")
            for name in names[1:]:
                g = statistics.median(times[name])
                per_round = " ".join(f"{a / b:.2f}" for a, b in
                                     zip(times["host"], times[name], strict=True))
                lines.append(f"   {name:<12} {g * 1e6:9.1f} us  host/gpu {h / g:.2f}  "
                             f"(rounds {per_round})")
                hs, ops = hook_sums[name], args.rounds * args.ops
                if hs["ready_calls"]:
                    lines.append(
                        f"     per op: ready {hs['ready_ns'] / ops / 1e3:.1f} us in "
                        f"{hs['ready_calls'] / ops:.1f} calls ({hs['ready_slow'] / ops:.1f}"
                        f" over 5 us), final {hs['final_ns'] / ops / 1e3:.1f} us in "
                        f"{hs['final_calls'] / ops:.1f} calls")
            for i, stage in enumerate(STAGES):
                if rows:
                    med = statistics.median(m[i + 1] - m[i] for m in rows) / 1e3
                    lines.append(f"     {stage:<34} {med:9.1f}")
            if syncs:
                lines.append(f"       of which the call's lease and downloads "
                             f"{statistics.median(syncs) / 1e3:9.1f}, the ring's pieces "
                             f"{statistics.median(stages) / 1e3 if stages else 0:9.1f}")
            for key, ns in sorted(details.items()):
                lines.append(f"         {key:<38} {statistics.median(ns) / 1e3:7.1f} us "
                             f"x {len(ns) / (args.rounds * args.ops):.1f} a call")
        del xg, og
    await asyncio.gather(*(c.close() for c in gpus + hosts))
    if gpu.rank == 0:
        print(f"# via-host paths, {gpu.size} ranks ({per} per process), float32 sum, "
              f"transport {gpu.transport_name(1)}, {args.rounds} rounds of {args.ops} ops "
              f"(median); native ring: {'on' if patch and gpu._native else 'off'}")
        print("\n".join(lines))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
