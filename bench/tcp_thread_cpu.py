"""Per-thread CPU of one rank in a host all_reduce loop: acoll or Gloo (issue 11 part 2).

Run under ``acoll-run`` (it sets ``ACOLL_RANK``/``ACOLL_WORLD_SIZE``)::

    python -m acoll.run -n 8 -- python bench/tcp_thread_cpu.py acoll 64M 20
    GLOO_PORT=29533 python -m acoll.run -n 8 -- python bench/tcp_thread_cpu.py gloo 64M 20

Prints, per rank, the time per op, busbw and each thread's CPU share of the timed window
(from ``/proc/self/task/*/stat``), busiest first: which thread saturates tells whether a
library is limited by one core's copies or by waiting.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

from acoll._config import parse_size

_TICK = os.sysconf("SC_CLK_TCK")


def _threads() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _report(rank: int, size: int, nbytes: int, per: float, wall: float,
            before: dict[int, tuple[str, float]], lib: str) -> None:
    after = _threads()
    shares = []
    for tid, (name, cpu) in after.items():
        start = before.get(tid, (name, 0.0))[1]
        share = (cpu - start) / wall * 100
        if share >= 1:
            shares.append((share, f"{name}:{share:.0f}%"))
    shares.sort(reverse=True)
    busbw = 2 * (size - 1) / size * nbytes / per / 1e9
    print(f"{lib} rank {rank}/{size} {nbytes >> 20} MiB: {per * 1e3:.2f} ms/op busbw "
          f"{busbw:.2f} GB/s | threads " + " ".join(s for _, s in shares), flush=True)


def _experiments() -> None:
    """Transport variants under test, from the environment (not settings of acoll)."""
    from acoll._transport import matching

    if os.environ.get("OFFLOAD_RECEIVING") == "1":  # send threads on 2-rank connections too
        matching.Matcher.receiving = property(lambda self: False)  # type: ignore[assignment]


async def _acoll(nbytes: int, iters: int) -> None:
    import acoll

    _experiments()

    async with await acoll.init_from_env() as comm:
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            await comm.all_reduce(x)
        await comm.barrier()
        before = _threads()
        t0 = time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(x)
        wall = time.perf_counter() - t0
        _report(comm.rank, comm.size, nbytes, wall / iters, wall, before, "acoll")
        await comm.barrier()


def _gloo(nbytes: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["ACOLL_RANK"]), int(os.environ["ACOLL_WORLD_SIZE"])
    port = os.environ.get("GLOO_PORT", "29533")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    before = _threads()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    wall = time.perf_counter() - t0
    _report(rank, size, nbytes, wall / iters, wall, before, "gloo")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    lib, nbytes, iters = sys.argv[1], parse_size(sys.argv[2]), int(sys.argv[3])
    if lib == "gloo":
        _gloo(nbytes, iters)
        return
    if os.environ.get("LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
    asyncio.run(_acoll(nbytes, iters))


if __name__ == "__main__":
    main()
