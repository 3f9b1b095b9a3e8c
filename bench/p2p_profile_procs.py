"""Per-op CPU cost of the P2P path with one rank per process (copy mode), and the bare
cost of a kernel launch through ctypes vs CuPy (issue 10's latency breakdown).

    python bench/p2p_profile_procs.py [N]
"""

from __future__ import annotations

import asyncio
import cProfile
import ctypes
import io
import multiprocessing as mp
import pstats
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000


def rank_main(rank: int, uid: bytes, q: object) -> None:
    import cupy as cp

    import acoll

    async def main() -> None:
        comm = await acoll.init_rank(2, uid, rank, device=rank % cp.cuda.runtime.getDeviceCount(),
                                     ifname="=lo")
        with cp.cuda.Device(comm.device):
            x = cp.ones(2, cp.float32)
            out = cp.empty(4, cp.float32)
            st = cp.cuda.Stream(non_blocking=True)
        lines = []
        for name, fn in (("all_reduce pipelined", lambda: comm.all_reduce(x, stream=st)),
                         ("all_gather pipelined", lambda: comm.all_gather(x, out, stream=st)),
                         ("all_reduce awaited", lambda: comm.all_reduce(x)),
                         ("barrier (TCP, host)", lambda: comm.barrier())):
            for _ in range(100):
                await fn()
            await comm.mem.settle()
            await comm.barrier()
            prof = cProfile.Profile() if rank == 0 and "awaited" not in name else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            for _ in range(N):
                await fn()
            if prof:
                prof.disable()
            await comm.mem.settle()
            wall = (time.perf_counter() - t0) / N
            lines.append(f"rank {rank} {name}: {wall * 1e6:.1f} us/op"
                         f"{' (under cProfile)' if prof else ''}")
            if prof and "all_reduce" in name:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                lines.append(s.getvalue())
        # unprofiled again for the clean number
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(N):
            await comm.all_reduce(x, stream=st)
        await comm.mem.settle()
        lines.append(f"rank {rank} all_reduce pipelined, no profiler: "
                     f"{(time.perf_counter() - t0) / N * 1e6:.1f} us/op")
        await comm.close()
        q.put("\n".join(lines))

    asyncio.run(main())


def launch_costs() -> str:
    import cupy as cp
    src = 'extern "C" __global__ void k(unsigned long long a, unsigned long long b, int c) {}'
    kern = cp.RawKernel(src, "k")
    st = cp.cuda.Stream(non_blocking=True)
    import numpy as np
    args = (np.uint64(1), np.uint64(2), np.int32(3))
    kern((1,), (32,), args, stream=st)
    st.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        kern((1,), (32,), args, stream=st)
    t1 = time.perf_counter()
    st.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int

    class A(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64), ("c", ctypes.c_int32)]
    a = A(1, 2, 3)
    base = ctypes.addressof(a)
    params = (ctypes.c_void_p * 3)(base + A.a.offset, base + A.b.offset, base + A.c.offset)
    f = int(kern.kernel.ptr)
    t2 = time.perf_counter()
    for _ in range(N):
        fn(f, 1, 1, 1, 32, 1, 1, 0, st.ptr, params, None)
    t3 = time.perf_counter()
    st.synchronize()
    e = cp.cuda.Event(block=False, disable_timing=True)
    t4 = time.perf_counter()
    for _ in range(N):
        e.record(st)
        _ = e.done
    t5 = time.perf_counter()
    return (f"empty kernel launch: CuPy {(t1 - t0) / N * 1e6:.2f} us, ctypes cuLaunchKernel "
            f"{(t3 - t2) / N * 1e6:.2f} us; event record+query {(t5 - t4) / N * 1e6:.2f} us")


if __name__ == "__main__":
    import acoll
    print(launch_costs(), flush=True)
    uid = bytes(acoll.get_unique_id(ifname="=lo"))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, uid, q)) for r in range(2)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=240) for _ in ps]
    for p in ps:
        p.join(10)
    print("\n\n".join(sorted(outs)))
