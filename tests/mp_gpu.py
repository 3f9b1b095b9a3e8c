"""One rank of the cross-process GPU collective test (started by acoll-run): device
``local_rank % ngpus``, every collective over the dtypes, exact results."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import acoll
from collective_cases import ALL_DTYPES, ALL_OPS, check_all
from gpu_cases import to_device, to_host


async def main() -> None:
    comm = await acoll.init_from_env(device="auto", timeout=60)
    assert comm.device is not None
    async with comm:
        dtypes = [d for d in ALL_DTYPES if d.name in ("int8", "uint64", "float16", "bfloat16",
                                                      "float32", "float64")]
        n = await check_all(comm, [0, 1, 7, 1000, 100003], dtypes, ALL_OPS,
                            dev=to_device(comm.device), host=to_host)
    print(f"rank {comm.rank}: device {comm.device}: {n} checks passed")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
