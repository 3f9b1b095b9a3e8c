"""The intra-host GPU path against NCCL, side by side in one run (issue 10).

    python bench/p2p_bench.py inproc [--sizes ...] [--colls ...]   # 2 ranks, 1 process
    python bench/p2p_bench.py procs  [--sizes ...] [--colls ...]   # 2 ranks, 2 processes

Sizes follow nccl-tests: the larger buffer of the call (all_gather: the output,
reduce_scatter: the input), float32 sum. For every size and collective it prints:

- ``pipe``: time per op with ``stream=`` (the await returns once the op is ordered on the
  stream; the timer stops after the stream drained), as nccl-tests measures NCCL; busbw
  from it (nccl-tests' factors: all_reduce 2(n-1)/n, the others (n-1)/n);
- ``await``: time per op awaited without ``stream=`` (the await returns with the result
  readable), against NCCL plus a stream synchronize after each op;
- in one process, one task calls both ranks inside ``acoll.group()`` (``--drive group``,
  the default: NCCL's group calls) or as two tasks (``--drive gather``);
- NCCL's numbers the same two ways: ``cupy.cuda.nccl`` in one process (group calls over the
  two GPUs), ``torch.distributed`` with the nccl backend across processes.

Every rank checks the result of the last op of each size. Output: a table on stdout and
``--json FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

COLLS = ("all_reduce", "all_gather", "reduce_scatter")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n}


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1:], 1)
        out.append(int(part[:-1] if mult > 1 else part) * mult)
    return out


def _iters(nbytes: int, base: int) -> int:
    return max(5, min(base, int(base * (4 << 20) / max(nbytes, 1)) or 5))


# ------------------------------------------------------------------------------ acoll

def _buffers(cp: Any, coll: str, nbytes: int, n: int, rank: int, device: int
             ) -> tuple[Any, Any, float]:
    """(send, recv, expected value of recv) for float32 sum; send = rank + 1."""
    count = max(nbytes // 4, n)
    count -= count % n
    with cp.cuda.Device(device):
        if coll == "all_reduce":
            send = cp.full(count, rank + 1, cp.float32)
            return send, cp.empty_like(send), n * (n + 1) / 2
        if coll == "all_gather":
            send = cp.full(count // n, rank + 1, cp.float32)
            return send, cp.empty(count, cp.float32), -1.0
        send = cp.full(count, rank + 1, cp.float32)
        return send, cp.empty(count // n, cp.float32), n * (n + 1) / 2


def _call(comm: Any, coll: str, send: Any, recv: Any, stream: Any) -> Any:
    fn = getattr(comm, coll)
    return fn(send, recv, stream=stream)


async def _acoll_rank_sizes(comms: list[Any], args: argparse.Namespace, cp: Any,
                            emit: Any) -> None:
    """Time every (coll, size) on the given ranks (all in this loop)."""
    import acoll

    n = comms[0].size
    for coll in args.colls:
        for nbytes in args.sizes:
            bufs = [_buffers(cp, coll, nbytes, n, c.rank, c.device) for c in comms]
            streams = []
            for c in comms:
                with cp.cuda.Device(c.device):
                    streams.append(cp.cuda.Stream(non_blocking=True))
            iters = _iters(nbytes, args.iters)
            regs = []
            if args.register:
                for c, (s, r, _) in zip(comms, bufs, strict=True):
                    regs.append((c, await c.register(s), await c.register(r)))

            async def once(pipe: bool, bufs: list[Any] = bufs,
                           streams: list[Any] = streams, coll: str = coll) -> None:
                if len(comms) == 1:  # one rank per process: no task per call (gather's)
                    (s, r, _), st = bufs[0], streams[0]
                    await _call(comms[0], coll, s, r, st if pipe else None)
                    return
                if args.drive == "group":  # one task calls every rank (ncclGroupStart/End)
                    async with acoll.group():
                        for c, (s, r, _), st in zip(comms, bufs, streams, strict=True):
                            await _call(c, coll, s, r, st if pipe else None)
                    return
                await asyncio.gather(*(_call(c, coll, s, r, st if pipe else None)
                                       for c, (s, r, _), st in zip(comms, bufs, streams,
                                                                   strict=True)))

            async def drain(streams: list[Any] = streams) -> None:
                for c, st in zip(comms, streams, strict=True):
                    with cp.cuda.Device(c.device):
                        ev = cp.cuda.Event(block=False, disable_timing=True)
                        ev.record(st)
                    while not ev.done:
                        await asyncio.sleep(0)

            for _ in range(args.warmup):
                await once(True)
            await drain()
            await asyncio.gather(*(c.barrier() for c in comms))
            t0 = time.perf_counter()
            for _ in range(iters):
                await once(True)
            await drain()
            pipe = (time.perf_counter() - t0) / iters
            await asyncio.gather(*(c.barrier() for c in comms))
            t0 = time.perf_counter()
            for _ in range(iters):
                await once(False)
            awaited = (time.perf_counter() - t0) / iters
            ok = True
            for c, (s, r, want) in zip(comms, bufs, strict=True):
                with cp.cuda.Device(c.device):
                    got = cp.asnumpy(r)
                if want < 0:  # all_gather: block q holds q + 1
                    want_arr = np.repeat(np.arange(1, n + 1, dtype=np.float32), s.size)
                    ok = ok and bool(np.array_equal(got, want_arr))
                else:
                    ok = ok and bool((got == want).all())
            for c, rs, rr in regs:
                await c.deregister(rs)
                await c.deregister(rr)
            if comms[0].rank == 0:
                emit({"lib": "acoll", "coll": coll, "bytes": nbytes, "pipe_s": pipe,
                      "await_s": awaited, "ok": ok, "n": n,
                      "drive": args.drive if len(comms) > 1 else "one rank",
                      "mode": "direct" if comms[0]._p2p and comms[0]._p2p.direct else
                      ("registered" if args.register else "copy") if comms[0]._p2p
                      else "staged"})


async def _acoll_inproc(args: argparse.Namespace, emit: Any) -> None:
    import cupy as cp

    import acoll

    uid = acoll.get_unique_id(ifname="=lo")
    devs = [r % cp.cuda.runtime.getDeviceCount() for r in range(args.nranks)]
    comms = await asyncio.gather(*(acoll.init_rank(args.nranks, uid, r, device=d,
                                                   ifname="=lo", timeout=120)
                                   for r, d in enumerate(devs)))
    try:
        await _acoll_rank_sizes(list(comms), args, cp, emit)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def _acoll_proc(rank: int, uid: bytes, args: argparse.Namespace, q: Any) -> None:
    import cupy as cp

    import acoll

    async def main() -> None:
        dev = rank % cp.cuda.runtime.getDeviceCount()
        comm = await acoll.init_rank(args.nranks, uid, rank, device=dev, ifname="=lo",
                                     timeout=120)
        try:
            await _acoll_rank_sizes([comm], args, cp, q.put)
        finally:
            await comm.close()

    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# ------------------------------------------------------------------------------- NCCL

def _nccl_inproc(args: argparse.Namespace, emit: Any) -> None:
    import cupy as cp
    from cupy.cuda import nccl

    n = args.nranks
    devs = [r % cp.cuda.runtime.getDeviceCount() for r in range(n)]
    comms = nccl.NcclCommunicator.initAll(devs)
    for coll in args.colls:
        for nbytes in args.sizes:
            bufs, streams = [], []
            for r, d in enumerate(devs):
                bufs.append(_buffers(cp, coll, nbytes, n, r, d))
                with cp.cuda.Device(d):
                    streams.append(cp.cuda.Stream(non_blocking=True))

            def once(sync: bool, bufs: list[Any] = bufs, streams: list[Any] = streams,
                     coll: str = coll) -> None:
                nccl.groupStart()
                for c, (s, r, _), st in zip(comms, bufs, streams, strict=True):
                    if coll == "all_reduce":
                        c.allReduce(s.data.ptr, r.data.ptr, s.size, nccl.NCCL_FLOAT32,
                                    nccl.NCCL_SUM, st.ptr)
                    elif coll == "all_gather":
                        c.allGather(s.data.ptr, r.data.ptr, s.size, nccl.NCCL_FLOAT32, st.ptr)
                    else:
                        c.reduceScatter(s.data.ptr, r.data.ptr, r.size, nccl.NCCL_FLOAT32,
                                        nccl.NCCL_SUM, st.ptr)
                nccl.groupEnd()
                if sync:
                    for st in streams:
                        st.synchronize()

            iters = _iters(nbytes, args.iters)
            for _ in range(args.warmup):
                once(False)
            for st in streams:
                st.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                once(False)
            for st in streams:
                st.synchronize()
            pipe = (time.perf_counter() - t0) / iters
            t0 = time.perf_counter()
            for _ in range(iters):
                once(True)
            emit({"lib": "nccl", "coll": coll, "bytes": nbytes, "pipe_s": pipe,
                  "await_s": (time.perf_counter() - t0) / iters, "ok": True, "n": n,
                  "mode": "cupy.nccl"})


def _torch_proc(rank: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    n = args.nranks
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=dev)
    try:
        for coll in args.colls:
            for nbytes in args.sizes:
                count = max(nbytes // 4, n)
                count -= count % n
                if coll == "all_reduce":
                    s = torch.full((count,), rank + 1.0, device=dev)

                    def op(s: Any = s) -> None:
                        dist.all_reduce(s)
                elif coll == "all_gather":
                    s = torch.full((count // n,), rank + 1.0, device=dev)
                    r = torch.empty(count, device=dev)

                    def op(s: Any = s, r: Any = r) -> None:
                        dist.all_gather_into_tensor(r, s)
                else:
                    s = torch.full((count,), rank + 1.0, device=dev)
                    r = torch.empty(count // n, device=dev)

                    def op(s: Any = s, r: Any = r) -> None:
                        dist.reduce_scatter_tensor(r, s)
                iters = _iters(nbytes, args.iters)
                for _ in range(args.warmup):
                    op()
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                torch.cuda.synchronize()
                pipe = (time.perf_counter() - t0) / iters
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                    torch.cuda.synchronize()
                awaited = (time.perf_counter() - t0) / iters
                if rank == 0:
                    q.put({"lib": "nccl", "coll": coll, "bytes": nbytes, "pipe_s": pipe,
                           "await_s": awaited, "ok": True, "n": n, "mode": "torch"})
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ driver

def _spawn(target: Any, extra: list[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *extra, args, q)) for r in range(args.nranks)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + args.limit
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=0.5))
        except Exception:
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    while not q.empty():
        out.append(q.get())
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    by = {(r["lib"], r["coll"], r["bytes"]): r for r in rows}
    lines = [f"{'coll':<15}{'bytes':>12} {'acoll pipe us':>14}{'nccl pipe us':>13}"
             f"{'busbw acoll':>12}{'busbw nccl':>11}{'ratio':>7} {'acoll await us':>15}"
             f"{'nccl+sync us':>13}{'ratio':>7}  ok"]
    for (lib, coll, nbytes), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if lib != "acoll":
            continue
        nc = by.get(("nccl", coll, nbytes))
        f = FACTOR[coll](r["n"])
        bw = nbytes / r["pipe_s"] * f / 1e9
        if nc:
            nbw = nbytes / nc["pipe_s"] * f / 1e9
            lines.append(
                f"{coll:<15}{nbytes:>12} {r['pipe_s'] * 1e6:>14.1f}{nc['pipe_s'] * 1e6:>13.1f}"
                f"{bw:>12.1f}{nbw:>11.1f}{bw / nbw:>7.2f} {r['await_s'] * 1e6:>15.1f}"
                f"{nc['await_s'] * 1e6:>13.1f}{nc['await_s'] / r['await_s']:>7.2f}  {r['ok']}")
        else:
            lines.append(f"{coll:<15}{nbytes:>12} {r['pipe_s'] * 1e6:>14.1f}{'-':>13}"
                         f"{bw:>12.1f}{'-':>11}{'-':>7} {r['await_s'] * 1e6:>15.1f}"
                         f"{'-':>13}{'-':>7}  {r['ok']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("where", choices=["inproc", "procs"])
    ap.add_argument("--sizes", type=_sizes, default=_sizes(
        "8,1K,32K,256K,1M,2M,16M,64M,128M,256M,1G"))
    ap.add_argument("--colls", type=lambda s: s.split(","), default=list(COLLS))
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--limit", type=float, default=280, help="seconds per library")
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--register", action="store_true",
                    help="register the buffers (procs: peers read them in place)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default=None,
                    help="event loop of the one-process run (default: uvloop when "
                         "installed, as acoll-run and the processes here use)")
    ap.add_argument("--drive", choices=["group", "gather"], default="group",
                    help="inproc: how one thread calls its ranks: inside acoll.group() "
                         "(as NCCL's group calls) or as tasks through asyncio.gather")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.loop is None:
        try:
            import uvloop
            args.loop = "uvloop"
        except ImportError:
            args.loop = "asyncio"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    if args.where == "inproc":
        if args.loop == "uvloop":
            import uvloop
            uvloop.run(_acoll_inproc(args, rows.append))
        else:
            asyncio.run(_acoll_inproc(args, rows.append))
        if not args.no_nccl:
            try:
                _nccl_inproc(args, rows.append)
            except Exception as exc:
                print(f"NCCL in-process (cupy.cuda.nccl) unavailable: {exc}", file=sys.stderr)
    else:
        import acoll

        uid = acoll.get_unique_id(ifname="=lo")
        rows += _spawn(_acoll_proc, [bytes(uid)], args)
        if not args.no_nccl:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            rows += _spawn(_torch_proc, [port], args)
    print(f"# {args.where}, {args.nranks} ranks, float32 sum, {time.time() - t0:.0f} s; "
          f"modes: {sorted({r['mode'] for r in rows})}; loop: "
          + (args.loop if args.where == "inproc" else "uvloop")
          + (f"; ranks driven by {args.drive}" if args.where == "inproc" else ""))
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
