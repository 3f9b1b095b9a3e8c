"""Does page-locked memory slow the host algorithm? (issue 9's in-place gap)

    python -m acoll.run -n 2 -- python bench/pinned_host_probe.py

A host communicator all-reduces (in place, float32 sum, over whatever transport the
environment selects) buffers of three kinds, interleaved over rounds: NumPy memory
(``np.ones``), CuPy page-locked memory (``cupy.cuda.alloc_pinned_memory``, what staging
uses), and NumPy memory page-locked with ``cudaHostRegister``. Rank 0 prints the median ms
per op of each kind and size, and the process's AnonHugePages.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import numpy as np

import acoll


async def main() -> None:
    import cupy as cp

    comm = await acoll.init_from_env()
    out: dict[str, list[float]] = {}
    for mib in (16, 64):
        n = mib << 18
        numpy_buf = np.ones(n, np.float32)
        pinned = cp.cuda.alloc_pinned_memory(n * 4)
        pinned_buf = np.frombuffer(pinned, np.float32, n)
        pinned_buf[...] = 1
        reg_buf = np.ones(n, np.float32)
        cp.cuda.runtime.hostRegister(reg_buf.ctypes.data, reg_buf.nbytes, 0)
        kinds = {"numpy": numpy_buf, "pinned": pinned_buf, "registered": reg_buf}
        for x in kinds.values():
            await comm.all_reduce(x)
        for r in range(4):
            for name, x in (kinds.items() if r % 2 == 0 else reversed(kinds.items())):
                await comm.barrier()
                t0 = time.perf_counter()
                for _ in range(4):
                    await comm.all_reduce(x)
                out.setdefault(f"{mib} MiB {name}", []).append(
                    (time.perf_counter() - t0) / 4 * 1e3)
        cp.cuda.runtime.hostUnregister(reg_buf.ctypes.data)
    if comm.rank == 0:
        for key, ms in out.items():
            print(f"{key:<22} median {statistics.median(ms):7.2f} ms  rounds "
                  + " ".join(f"{v:.1f}" for v in ms))
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:  # noqa: ASYNC230
            print([line for line in f if "AnonHuge" in line])
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main())
