"""Stream memory operations under load, without acoll (session 46): does the driver keep
working through thousands of ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` on a CuPy
page-locked word, between 1 MiB copies, with events recorded and polled as acoll does?

    python bench/memops_stress.py MODE [ITERS]   # one process
    python bench/memops_stress.py --procs P MODE [ITERS]   # P processes at once

MODE: ``write`` (D2H copy, then a write of the iteration number), ``wait`` (the host
stores the number first, the stream waits for it, then an H2D copy), ``late`` (as
``wait``, but the host stores the number only after the enqueue: the stream is held in
the wait meanwhile), ``none`` (the copies and events alone).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time


def run(mode: str, iters: int) -> None:
    import cupy as cp
    import numpy as np

    cp.cuda.Device(0).use()
    lib = ctypes.CDLL("libcuda.so.1")
    dp = lib.cuMemHostGetDevicePointer_v2
    dp.restype = ctypes.c_int
    dp.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    wr, wt = lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2
    for fn in (wr, wt):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    page = cp.cuda.alloc_pinned_memory(4096)
    words = np.frombuffer(page, np.uint32, 1024)
    words[...] = 0
    dev = ctypes.c_uint64(0)
    assert dp(ctypes.byref(dev), int(words.ctypes.data), 0) == 0
    n = 1 << 20
    block = cp.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(block, np.uint8, n)
    gpu = cp.zeros(n, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(4)]
    t0 = time.perf_counter()
    for i in range(1, iters + 1):
        if mode == "write":
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, gpu.data.ptr, n, 2, s.ptr)
            rc = wr(s.ptr, dev.value, i, 0)
        elif mode in ("wait", "late"):
            if mode == "wait":
                words[0] = i
            rc = wt(s.ptr, dev.value, i, 0)
            cp.cuda.runtime.memcpyAsync(gpu.data.ptr, host.ctypes.data, n, 1, s.ptr)
            if mode == "late":
                time.sleep(0.0002)
                words[0] = i
        else:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, gpu.data.ptr, n, 2, s.ptr)
            rc = 0
        if rc:
            print(f"iteration {i}: CUresult {rc}", flush=True)
            sys.exit(1)
        e = events[i % 4]
        e.record(s)
        while not e.done:
            pass
        if i % 500 == 0:
            print(f"{mode}: {i} iterations, word {int(words[0])}, "
                  f"{(time.perf_counter() - t0) / i * 1e6:.1f} us each", flush=True)
    (gpu + 1).sum()
    print(f"{mode}: done, {iters} iterations, CuPy works", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--procs":
        procs, args = int(args[1]), args[2:]
        ps = [subprocess.Popen([sys.executable, __file__, *args]) for _ in range(procs)]
        codes = [p.wait(timeout=300) for p in ps]
        print(f"--procs {procs} {' '.join(args)}: exit codes {codes}", flush=True)
    else:
        run(args[0], int(args[1]) if len(args) > 1 else 4000)
