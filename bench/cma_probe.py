"""How fast one process reads another's memory with ``process_vm_readv`` (Linux CMA, the
single copy Open MPI's shared-memory transport uses for large messages) against a memcpy
inside one process, best of 20 calls per size: ``python bench/cma_probe.py``.

A single CMA copy replaces the two copies of acoll's mailboxes (into shared memory, out of
it); it pays only if it runs at more than half a memcpy's speed.
"""

import ctypes
import multiprocessing as mp
import os
import time

import numpy as np

libc = ctypes.CDLL(None, use_errno=True)


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def child(q, ev):  # type: ignore[no-untyped-def]
    a = np.arange(4 << 20, dtype=np.float32)
    q.put((os.getpid(), a.ctypes.data))
    ev.wait(30)


def main() -> None:
    ctx = mp.get_context("spawn")
    q, ev = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, ev))
    p.start()
    pid, addr = q.get(timeout=20)
    for size in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
        dst = np.empty(size // 4, np.float32)
        src = np.ones(size // 4, np.float32)
        local, remote = Iovec(dst.ctypes.data, size), Iovec(addr, size)
        cma = copy = 1e9
        for _ in range(20):
            t = time.perf_counter()
            n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            cma = min(cma, time.perf_counter() - t)
            if n != size:
                raise OSError(ctypes.get_errno(), "process_vm_readv")
            t = time.perf_counter()
            np.copyto(dst, src)
            copy = min(copy, time.perf_counter() - t)
        print(f"{size >> 10:6d} KiB: process_vm_readv {size / cma / 1e9:5.2f} GB/s, "
              f"memcpy {size / copy / 1e9:5.2f} GB/s", flush=True)
    ev.set()
    p.join()


if __name__ == "__main__":
    main()
