"""Paired, interleaved comparison of TCP variants of acoll and Gloo in the same processes.

Run under ``acoll-run`` with the network path forced::

    ACOLL_SHM_DISABLE=1 ACOLL_NET=socket python -m acoll.run -n 4 -- \\
        python bench/tcp_ab.py 64M --iters 6 --rounds 5 --variants chunks=8 chunks=0 gloo

Every rank holds an acoll communicator and a Gloo process group (torch.distributed) at once;
each round runs every variant once (the order rotates from round to round), ``--iters``
in-place float32 sum all-reduces each after one warm-up, with a barrier between variants.
The machines this runs on change speed from minute to minute; pairing the variants in the
same processes and rounds is what makes their ratios comparable. Variants:

- ``gloo``: ``torch.distributed.all_reduce`` on a CPU tensor.
- ``chunks=K``: acoll with ``ACOLL_RING_CHUNKS=K`` (set on the communicator per round).
- ``chunk=SIZE``: acoll with ``ACOLL_CHUNK_SIZE=SIZE`` (likewise).
- ``offload=SIZE``: acoll with the send thread taking a socket's queue from SIZE bytes
  queued (``_OFFLOAD_MIN``, 512 KiB).
- ``algo=NAME``: acoll with ``ACOLL_ALGO=all_reduce:NAME`` (e.g. ``direct``, ``hd``).
- ``hdchunks=K``: acoll with ``ACOLL_HD_CHUNKS=K``.
- ``switch=S``: acoll with ``sys.setswitchinterval(S)`` (how long a thread that wants the
  GIL waits before the holder is asked to drop it; 0.005 by default).
- ``A+B``: both settings (e.g. ``algo=hd+hdchunks=4``).
- ``recvoff``: acoll with its receive threads idle (``_RECV_OFFLOAD_MIN`` out of reach:
  the loop thread reads every payload, as before receive threads).
- ``native``: acoll as it is (the native ring where it is on); ``python``: acoll with the
  native ring off for the round (the Python ring on the loop and socket threads).
- ``inline=SIZE``: the native ring with ``ACOLL_NATIVE_INLINE=SIZE`` (calls sending at
  most SIZE bytes per rank run on the worker thread alone; -1: always the helper thread).
- ``headrule``: acoll with the send thread's old rule (a socket's queue went to the thread
  only when its head frame's unsent rest was at least 512 KiB).

Settings fixed at connection time (``ACOLL_SOCKET_SPLIT``, ``ACOLL_SOCKET_NSOCKS``) are
compared across runs, each paired with Gloo in its own run.

Rank 0 prints, per variant, the median busbw over rounds (time per op: the slowest rank's)
and the median of the per-round ratios to the first variant.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import deque
from typing import Any

import numpy as np

import acoll
from acoll._config import parse_size
from acoll._transport import tcp


def _head_rule(queue: deque[list[Any]], nbytes: int) -> bool:
    item = queue[0]
    return len(item[0]) + item[1].nbytes - item[2] >= nbytes


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("size")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=["chunks=8", "chunks=0", "gloo"])
    ap.add_argument("--port", default=os.environ.get("GLOO_PORT", "29533"))
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    variants: list[str] = args.variants
    queued_rule = tcp._queued_at_least
    offload_min = tcp._OFFLOAD_MIN
    recv_min = tcp._RECV_OFFLOAD_MIN
    async with await acoll.init_from_env() as comm:
        n, rank = comm.size, comm.rank
        x = np.ones(nbytes // 4, np.float32)
        dist = torch = None
        if "gloo" in variants:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                    rank=rank, world_size=n)
            t = torch.from_numpy(np.ones(nbytes // 4, np.float32))
        default_chunks, default_chunk = comm.ring_chunks, comm.chunk_bytes
        default_algo = comm._algo
        default_hd = comm.hd_chunks
        default_switch = sys.getswitchinterval()
        native = comm._native
        default_inline = native.inline_max if native is not None else 0
        if rank == 0:
            print(f"native ring: {'on' if native is not None else 'off'}", flush=True)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for rnd in range(args.rounds):
            k = rnd % len(variants)
            for v in variants[k:] + variants[:k]:
                comm.ring_chunks, comm.chunk_bytes = default_chunks, default_chunk
                comm.hd_chunks = default_hd
                comm._algo = default_algo
                tcp._queued_at_least = queued_rule  # type: ignore[assignment]
                tcp._OFFLOAD_MIN = offload_min
                tcp._RECV_OFFLOAD_MIN = recv_min
                sys.setswitchinterval(default_switch)
                comm._native = native
                if native is not None:
                    native.inline_max = default_inline
                for part in v.split("+"):
                    if part.startswith("algo="):
                        comm._algo = "all_reduce:" + part.split("=")[1]
                    elif part == "recvoff":
                        tcp._RECV_OFFLOAD_MIN = 1 << 62
                    elif part.startswith("chunk="):
                        comm.chunk_bytes = parse_size(part.split("=")[1])
                    elif part.startswith("offload="):
                        tcp._OFFLOAD_MIN = parse_size(part.split("=")[1])
                    elif part.startswith("chunks="):
                        comm.ring_chunks = int(part.split("=")[1])
                    elif part.startswith("hdchunks="):
                        comm.hd_chunks = int(part.split("=")[1])
                    elif part.startswith("switch="):
                        sys.setswitchinterval(float(part.split("=")[1]))
                    elif part.startswith("inline=") and native is not None:
                        native.inline_max = parse_size(part.split("=")[1])
                    elif part == "python":
                        comm._native = None
                    elif part == "headrule":
                        tcp._queued_at_least = _head_rule  # type: ignore[assignment]
                    elif part not in ("gloo", "native"):
                        raise SystemExit(f"unknown variant {part!r}")
                await comm.barrier()
                if v == "gloo":
                    assert dist is not None
                    dist.all_reduce(t)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        dist.all_reduce(t)
                else:
                    await comm.all_reduce(x)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        await comm.all_reduce(x)
                times[v].append((time.perf_counter() - t0) / args.iters)
        comm.ring_chunks, comm.chunk_bytes = default_chunks, default_chunk
        comm._algo = default_algo
        comm.hd_chunks = default_hd
        comm._native = native
        sys.setswitchinterval(default_switch)
        tcp._queued_at_least = queued_rule  # type: ignore[assignment]
        tcp._OFFLOAD_MIN = offload_min
        tcp._RECV_OFFLOAD_MIN = recv_min
        flat = np.array([times[v][i] for v in variants for i in range(args.rounds)])
        await comm.all_reduce(flat, op=acoll.MAX)
        if dist is not None:
            dist.destroy_process_group()
    if rank != 0:
        return
    per = {v: flat[i * args.rounds:(i + 1) * args.rounds] for i, v in enumerate(variants)}
    factor = 2 * (n - 1) / n * nbytes / 1e9
    base = variants[0]
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    print(f"# {n} ranks, {size}, {args.rounds} rounds x {args.iters} ops, "
          f"busbw GB/s (median, min..max); ratio: busbw / {base}'s, median of rounds")
    for v in variants:
        bw = [factor / s for s in per[v]]
        ratios = [b / s for b, s in zip(per[base], per[v], strict=True)]
        print(f"{n} ranks {size:>8}  {v:<10} {statistics.median(bw):5.2f} "
              f"({min(bw):.2f}..{max(bw):.2f})  ratio {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f})", flush=True)


if os.environ.get("LOOP", "uvloop") == "uvloop":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
asyncio.run(main())
