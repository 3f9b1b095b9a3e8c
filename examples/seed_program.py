"""The seed article's program, ported to acoll.

The original (NCCL + MPI): every process computes its *local rank* by hashing host names
(DJB2a over the name cut at the first '.') and all-gathering the hashes; rank 0 makes the
unique id and MPI_Bcast's it; every rank calls ncclCommInitRank, all-reduces a float
buffer, synchronises and destroys the communicator.

Here the processes come from ``acoll-run -n N -- python examples/seed_program.py`` and the
id travels out of band through a file (any channel works: it is 128 opaque bytes).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import acoll


def host_hash(name: str) -> int:
    """DJB2a over the host name up to the first '.'."""
    h = 5381
    for ch in name.split(".")[0].encode():
        h = ((h << 5) + h) ^ ch
        h &= 0xFFFFFFFFFFFFFFFF
    return h


def id_path(job: str) -> Path:
    """Where rank 0 publishes the unique id for this job."""
    return Path(tempfile.gettempdir()) / f"acoll-seed-{job}.id"


def share_id_out_of_band(rank: int, job: str) -> acoll.UniqueId:
    """Rank 0 makes the id and writes it; the others read it (our stand-in for MPI_Bcast)."""
    path = id_path(job)
    if rank == 0:
        uid = acoll.get_unique_id()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(bytes(uid))
        tmp.rename(path)
        return uid
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 never published the unique id")
        time.sleep(0.01)
    return acoll.UniqueId.from_bytes(path.read_bytes())


async def main() -> int:
    rank = int(os.environ["ACOLL_RANK"])
    nranks = int(os.environ["ACOLL_WORLD_SIZE"])
    # The id is made by get_unique_id below; ACOLL_COMM_ID (set by acoll-run) would
    # replace it, so drop it to follow the article's path.
    job = os.environ.pop("ACOLL_COMM_ID").replace(":", "_").replace(".", "_")
    uid = share_id_out_of_band(rank, job)
    comm = await acoll.init_rank(nranks, uid, rank)
    # Local rank from host hashes, exactly as the article's MPI program does.
    hashes = np.zeros(nranks, dtype=np.uint64)
    mine = np.array([host_hash(socket.gethostname())], dtype=np.uint64)
    await comm.all_gather(mine, hashes)
    local_rank = int(np.sum(hashes[:rank] == mine[0]))
    size = 32 * 1024 * 1024 // 4
    send = np.ones(size, dtype=np.float32)
    recv = np.zeros(size, dtype=np.float32)
    await comm.all_reduce(send, recv, op=acoll.SUM)
    ok = bool(np.all(recv == nranks))
    print(f"rank {rank} (local rank {local_rank}): all_reduce of {size} floats "
          f"{'ok' if ok else 'WRONG'}")
    await comm.close()
    if rank == 0:
        await asyncio.to_thread(id_path(job).unlink, missing_ok=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
