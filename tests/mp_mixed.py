"""Several ranks of one communicator in this process (one event loop), the others in
another process: ``python mp_mixed.py UID_HEX NRANKS RANK[,RANK...]``.

Ranks here talk in process (unless ``ACOLL_INPROC_DISABLE=1``), ranks in the other
process over TCP. Prints, per rank, the transport it uses to each peer and the number of
checks passed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import acoll
from collective_cases import ALL_OPS, COUNTS, check_all

DTYPES = ["int8", "float32", "float64", "bfloat16"]


async def rank_main(uid: bytes, nranks: int, rank: int) -> str:
    comm = await acoll.init_rank(nranks, uid, rank, timeout=60)
    async with comm:
        from acoll._dtypes import parse_dtype

        n = await check_all(comm, COUNTS, [parse_dtype(d) for d in DTYPES], ALL_OPS)
        names = ",".join(str(comm.transport_name(p)) for p in range(nranks))
    return f"rank {rank}: via {names}: {n} checks passed"


async def main() -> None:
    uid, nranks = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
    ranks = [int(r) for r in sys.argv[3].split(",")]
    for line in await asyncio.gather(*(rank_main(uid, nranks, r) for r in ranks)):
        print(line, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
