"""Run under mpirun by test_mpi.py: init_from_env, one all_reduce, print what was used."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import acoll
from acoll._env import ranks_from_env


async def main() -> None:
    info = ranks_from_env()
    async with await acoll.init_from_env() as comm:
        x = np.full(1000, comm.rank + 1, dtype=np.float32)
        await comm.all_reduce(x)
        total = float(x[0])
        secret = os.environ.get("ACOLL_COMM_SECRET", "")
        print(json.dumps({"rank": comm.rank, "source": info.source, "from": info.comm_id_from,
                          "comm_id": info.comm_id, "sum": total, "secret": len(secret)}),
              flush=True)


if __name__ == "__main__":
    asyncio.run(main())
