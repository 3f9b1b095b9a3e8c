"""The seed article's MPI + NCCL program ("several devices per process"), ported to acoll.

Run it under MPI (needs Open MPI or MPICH and ``pip install 'acoll[mpi]'``)::

    mpirun -np 2 python examples/seed_program.py
    mpirun -np 2 python examples/seed_program.py --per-process 2 --count 1048576
    mpirun -np 2 python examples/seed_program.py --gpus     # as the original: CuPy buffers

(as root Open MPI also wants ``--allow-run-as-root``; with more ranks than cores,
``--oversubscribe``).

What it does, step by step as the original:

1. MPI gives each process its rank and the number of processes.
2. The *local rank* (index among the processes on this host) comes from host-name hashes:
   DJB2a over the name cut at the first '.', all-gathered with ``MPI_Allgather``.
3. Process 0 makes the unique id (``acoll.get_unique_id()``) and ``MPI_Bcast``'s its 128
   bytes; the others rebuild it with ``acoll.UniqueId.from_bytes``. No pickle: the id
   travels as a raw byte buffer.
4. Each process drives ``D`` communicator ranks ("devices"), ranks ``rank * D + i`` of
   ``nprocs * D``, initialised together (``ncclGroupStart``/``ncclCommInitRank``/
   ``ncclGroupEnd`` in the original; here ``asyncio.gather`` in one event loop).
5. Each rank all-reduces a buffer of ones (SUM), one call per device inside
   ``async with acoll.group():`` (``ncclGroupStart``/``ncclGroupEnd`` in the original), and
   checks every element equals the number of ranks; then the communicators are closed
   (``ncclCommDestroy``).

Devices: with ``--gpus`` (or ``USE_GPUS = True``), as in the original, ``D`` is the
number of visible GPUs, slot ``i`` of local rank ``l`` uses GPU ``(l * D + i) % ngpus``
(``init_rank(..., device=...)``) and the buffers are CuPy arrays. Without it each "device"
is a host buffer, ``--per-process`` of them (default 1).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from typing import Any

import numpy as np

import acoll

#: Use GPUs (CuPy buffers) without --gpus; see the module doc.
USE_GPUS = False


def host_hash(name: str) -> int:
    """DJB2a over the host name up to the first '.' (64-bit, as the original's uint64_t)."""
    h = 5381
    for ch in name.split(".")[0].encode():
        h = ((h << 5) + h) ^ ch
        h &= 0xFFFFFFFFFFFFFFFF
    return h


def local_rank_of(mpi_comm: Any) -> int:
    """This process's index among the processes on its host, via MPI_Allgather of hashes."""
    rank, nprocs = mpi_comm.Get_rank(), mpi_comm.Get_size()
    hashes = np.zeros(nprocs, dtype=np.uint64)
    mine = np.array([host_hash(socket.gethostname())], dtype=np.uint64)
    mpi_comm.Allgather(mine, hashes)
    return int(np.count_nonzero(hashes[:rank] == mine[0]))


def share_unique_id(mpi_comm: Any) -> acoll.UniqueId:
    """Process 0 makes the id; MPI_Bcast carries its 128 bytes to everyone."""
    buf = np.zeros(128, dtype=np.uint8)
    if mpi_comm.Get_rank() == 0:
        buf[:] = np.frombuffer(bytes(acoll.get_unique_id()), dtype=np.uint8)
    mpi_comm.Bcast(buf, root=0)
    return acoll.UniqueId.from_bytes(buf.tobytes())


def gpu_count() -> int:
    import cupy  # only with GPUs

    count = int(cupy.cuda.runtime.getDeviceCount())
    if count < 1:
        raise SystemExit("--gpus: no GPU is visible")
    return count


def devices_per_process(requested: int, use_gpus: bool) -> int:
    return gpu_count() if use_gpus else requested


async def run_process(uid: acoll.UniqueId, rank: int, nprocs: int, local_rank: int,
                      ndev: int, count: int, use_gpus: bool = False) -> bool:
    """Initialise this process's ``ndev`` ranks together, all-reduce, check, close."""
    nranks = nprocs * ndev
    ngpus = gpu_count() if use_gpus else 0

    async def init(i: int) -> acoll.Communicator:
        device = (local_rank * ndev + i) % ngpus if use_gpus else None
        return await acoll.init_rank(nranks, uid, rank * ndev + i, device=device)

    def alloc(comm: acoll.Communicator, value: float) -> Any:
        if comm.device is None:
            return np.full(count, value, dtype=np.float32)
        import cupy

        with cupy.cuda.Device(comm.device):
            return cupy.full(count, value, dtype=cupy.float32)

    comms = await asyncio.gather(*(init(i) for i in range(ndev)))
    try:
        sends = [alloc(c, 1) for c in comms]
        recvs = [alloc(c, 0) for c in comms]
        async with acoll.group():  # ncclGroupStart ... ncclGroupEnd
            for c, s, r in zip(comms, sends, recvs, strict=True):
                await c.all_reduce(s, r, op=acoll.SUM)
        ok = [bool((r == nranks).all()) for r in recvs]
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await asyncio.gather(*(c.close() for c in comms))
    for i, good in enumerate(ok):
        print(f"rank {rank * ndev + i} of {nranks} (process {rank}, local rank {local_rank}, "
              f"device {i}): all_reduce of {count} floats {'ok' if good else 'WRONG'}",
              flush=True)
    return all(ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-process", type=int, default=1, metavar="D",
                        help="host 'devices' (communicator ranks) per process (default 1)")
    parser.add_argument("--gpus", action="store_true", default=USE_GPUS,
                        help="one rank per visible GPU, CuPy buffers (as the original)")
    parser.add_argument("--count", type=int, default=32 * 1024 * 1024,
                        help="floats per buffer (default 32M, as the original)")
    args = parser.parse_args(argv)
    try:
        from mpi4py import MPI
    except ImportError:
        print("seed_program.py needs mpi4py: pip install 'acoll[mpi]' (and an MPI library)",
              file=sys.stderr)
        return 2
    world = MPI.COMM_WORLD
    rank, nprocs = world.Get_rank(), world.Get_size()
    local_rank = local_rank_of(world)
    uid = share_unique_id(world)
    ndev = devices_per_process(args.per_process, args.gpus)
    ok = asyncio.run(run_process(uid, rank, nprocs, local_rank, ndev, args.count, args.gpus))
    # Every process learns whether all succeeded (MPI_Allreduce of a flag, LAND).
    flags = np.array([1 if ok else 0], dtype=np.int32)
    world.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)
    if rank == 0:
        print(f"{'success' if flags[0] else 'FAILED'}: {nprocs} processes x {ndev} devices",
              flush=True)
    return 0 if flags[0] else 1


if __name__ == "__main__":
    sys.exit(main())
