"""One rank of the cross-process collective test (started by acoll-run)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import acoll
from collective_cases import ALL_DTYPES, ALL_OPS, check_all


async def main() -> None:
    comm = await acoll.init_from_env(timeout=60)
    async with comm:
        n = await check_all(comm, [0, 1, 7, 1000, 100003], ALL_DTYPES, ALL_OPS)
        names = ",".join(str(comm.transport_name(p)) for p in range(comm.size))
    print(f"rank {comm.rank} via {names}: {n} checks passed")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
