"""A rank that dies (rank 2) or reports how the others' collectives failed."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import acoll


async def main(rank: int, n: int) -> int:
    uid = acoll.get_unique_id()  # ACOLL_COMM_ID is set: rank 0 hosts the root
    comm = await acoll.init_rank(n, uid, rank)
    x = np.ones(1 << 18, np.float32)
    for i in range(1000):
        if rank == 2 and i == 3:
            os._exit(9)
        try:
            await comm.all_reduce(x)
        except acoll.RemoteError as exc:
            print(f"RemoteError on rank {rank} at iteration {i}: {exc} (rank={exc.rank})")
            comm.abort()
            return 0
    print("never failed")
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]))))
