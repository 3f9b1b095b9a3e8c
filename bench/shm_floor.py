"""The floor of a two-copy shared-memory ring all_reduce on this machine, without acoll.

Two processes (fork) share one memfd with a ring per direction of 512 KiB slots (2 MiB,
acoll's defaults); each runs the 2-rank ring all_reduce on float32 in place: send a chunk
(copy into the ring), receive a chunk (copy out into scratch), ``np.add``; then the
all-gather's copies. Waits busy-poll. This is what acoll's SHM path does per byte, minus
everything else (Python call overhead, the event loop, wake-ups):

    python bench/shm_floor.py [SIZE ...]     (default: 1M 2M 8M 32M)
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np

CHUNK = 512 << 10
CAPACITY = 2 << 20
SLOTS = CAPACITY // CHUNK


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def run(size: int, iters: int = 20) -> None:
    fd = os.memfd_create("floor")
    total = 8192 + 2 * CAPACITY
    os.ftruncate(fd, total)
    mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    ctl = memoryview(mm)[:8192].cast("Q")  # ring r: head at word 16r, tail at 16r + 8
    rings = [memoryview(mm)[8192 + r * CAPACITY:8192 + (r + 1) * CAPACITY] for r in (0, 1)]
    pid = os.fork()
    me = 0 if pid else 1
    tx, rx = rings[me], rings[1 - me]
    x = np.ones(size // 4, np.float32)
    scratch = np.empty(size // 8, np.float32)
    xb, sb = memoryview(x).cast("B"), memoryview(scratch).cast("B")
    pos = {"head": 0, "tail": 0}

    def send(view: memoryview) -> None:
        while pos["head"] - ctl[16 * me + 8] >= SLOTS:
            pass
        s = (pos["head"] % SLOTS) * CHUNK
        tx[s:s + view.nbytes] = view
        pos["head"] += 1
        ctl[16 * me] = pos["head"]

    def recv(view: memoryview) -> None:
        while ctl[16 * (1 - me)] == pos["tail"]:
            pass
        s = (pos["tail"] % SLOTS) * CHUNK
        view[:] = rx[s:s + view.nbytes]
        pos["tail"] += 1
        ctl[16 * (1 - me) + 8] = pos["tail"]

    half = size // 2
    mine, other = me * half, (1 - me) * half

    def all_reduce() -> None:
        for off in range(0, half, CHUNK):  # reduce-scatter: my half comes back reduced
            send(xb[other + off:other + off + CHUNK])
            recv(sb[off:off + CHUNK])
            o = x[(mine + off) // 4:(mine + off + CHUNK) // 4]
            np.add(o, scratch[off // 4:(off + CHUNK) // 4], out=o)
        for off in range(0, half, CHUNK):  # all-gather
            send(xb[mine + off:mine + off + CHUNK])
            recv(xb[other + off:other + off + CHUNK])

    for _ in range(3):
        all_reduce()
    t0 = time.perf_counter()
    for _ in range(iters):
        all_reduce()
    elapsed = (time.perf_counter() - t0) / iters
    if pid:
        os.waitpid(pid, 0)
        print(f"bare two-copy ring, {size >> 10:6d} KiB: {elapsed * 1e6:8.0f} us/op, "
              f"busbw {size / elapsed / 1e9:.2f} GB/s", flush=True)
    else:
        os._exit(0)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["1M", "2M", "8M", "32M"]:
        run(_size(arg))
