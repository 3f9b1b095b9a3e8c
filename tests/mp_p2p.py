"""One rank of the cross-process P2P tests (started by acoll-run, device="auto").

``matrix``: the collective matrix in copy mode (CUDA IPC); ``probe``: print whether a
domain formed; ``kill``: rank 1 exits hard while rank 0 waits in an all_reduce, which must
end in RemoteError well before the 60 s timeout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cupy as cp

import acoll
from collective_cases import ALL_DTYPES, ALL_OPS, check_all
from gpu_cases import to_device, to_host


async def main(what: str) -> None:
    comm = await acoll.init_from_env(device="auto", timeout=60)
    dom = comm._p2p
    if what == "probe":
        print(f"rank {comm.rank}: {'no domain' if dom is None else 'domain'}", flush=True)
        await comm.close()
        return
    if what == "matrix":
        print(f"rank {comm.rank}: {'copy mode' if dom and not dom.direct else dom}",
              flush=True)
        dtypes = [d for d in ALL_DTYPES if d.name in ("int8", "uint64", "float16", "bfloat16",
                                                      "float32", "float64")]
        async with comm:
            n = await check_all(comm, [0, 1, 7, 1000, 100003], dtypes, ALL_OPS,
                                dev=to_device(comm.device or 0), host=to_host)
        print(f"rank {comm.rank}: {n} checks passed", flush=True)
        return
    # kill
    with cp.cuda.Device(comm.device):
        x = cp.ones(1 << 20, cp.float32)
    await comm.all_reduce(x)
    if comm.rank == 1:
        await asyncio.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    try:
        await comm.all_reduce(x)
    except acoll.RemoteError as exc:
        print(f"survivor: RemoteError after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
        comm.abort()
        return
    except acoll.AcollError as exc:
        print(f"survivor: {type(exc).__name__}: {exc}", flush=True)
        comm.abort()
        raise SystemExit(1) from None
    print("survivor: no error", flush=True)
    raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
