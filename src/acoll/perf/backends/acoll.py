"""acoll itself: a :class:`~acoll.Communicator` the caller made (and closes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from ..._communicator import Communicator
from ..._dtypes import ReduceOp
from ..._version import __version__
from ...errors import InvalidUsage
from ..buffers import Allocator, Buffer, host_buffer
from ..colls import Coll
from ..report import human
from .base import Backend, Op, OpArgs

__all__ = ["AcollBackend"]

_Call = Callable[[Communicator, OpArgs], Awaitable[Any]]


async def _sendrecv(c: Communicator, a: OpArgs) -> None:
    async with c.group():  # to the ring successor, from the predecessor
        await c.send(a.inp, (c.rank + 1) % c.size)
        await c.recv(a.out, (c.rank - 1) % c.size)


# In place, acoll takes ``None`` as the output of all_reduce, reduce and all_to_all and
# finds the other in-place forms by aliasing (all_gather, reduce_scatter, one-buffer broadcast).
_CALLS: dict[str, _Call] = {
    "all_reduce": lambda c, a: c.all_reduce(a.inp, None if a.inplace else a.out, a.op),
    "broadcast": lambda c, a: c.broadcast(a.out, a.root),
    "reduce": lambda c, a: c.reduce(a.inp, None if a.inplace else a.out, a.op, a.root),
    "all_gather": lambda c, a: c.all_gather(a.inp, a.out),
    "reduce_scatter": lambda c, a: c.reduce_scatter(a.inp, a.out, a.op),
    "all_to_all": lambda c, a: c.all_to_all(a.inp, None if a.inplace else a.out),
    "sendrecv": _sendrecv,
    "barrier": lambda c, a: c.barrier(),
}


class AcollBackend(Backend):
    """Collectives of ``comm``; the test memory comes from ``allocator``."""

    def __init__(self, comm: Communicator, allocator: Allocator = host_buffer,
                 register: bool = False) -> None:
        super().__init__(allocator)
        self.comm = comm
        self.name = "acoll"
        self._register = register
        self.rank, self.size = comm.rank, comm.size
        # the transports carrying this rank's traffic (one per peer; usually one kind)
        nets = sorted({str(comm.transport_name(p)) for p in range(comm.size) if p != comm.rank})
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        where = "" if comm.device is None else f" (cuda:{comm.device} buffers)"
        self.info = {
            "backend": f"acoll {__version__}{where}",
            "net": "+".join(nets) if self.size > 1 else "none",
            "loop": "uvloop" if loop == "uvloop" else "asyncio",
            "chunk": human(int(getattr(comm, "chunk_bytes", 0))),
        }
        if register:
            self.info["backend"] += " registered"

    async def prepare(self, bufs: Sequence[Buffer]) -> str | None:
        """With ``register``: register the sweep's buffers (collective). A buffer that
        could not be registered (the handle's index is -1: the ranks are not processes of
        one host, say) is measured as it is, and the results say so."""
        if not self._register:
            return None
        for buf in bufs:
            reg = await self.comm.register(buf.obj)
            if reg.index < 0:
                return ("-R 1: registering the buffers had no effect here (see "
                        "Communicator.register); they were measured unregistered")
        return None

    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        call, comm = _CALLS[coll.name], self.comm

        async def run() -> None:
            await call(comm, args)
        return run

    def unsupported(self, exc: BaseException) -> bool:
        # Refused before any message moved: local, the same on every rank, comm still usable.
        return isinstance(exc, InvalidUsage) and self.comm.error is None

    async def barrier(self) -> None:
        await self.comm.barrier()

    async def sync(self) -> None:
        await self.comm.mem.settle()

    def _scalar(self, value: float) -> tuple[Any, Callable[[Any], float]]:
        """A one-element float64 buffer in the communicator's memory, and its reader."""
        device = self.comm.device
        if device is None:
            return np.array([value], np.float64), lambda a: float(a[0])
        from ..._cuda import import_cupy

        cp = import_cupy()
        with cp.cuda.Device(device):
            arr = cp.array([value], cp.float64)
        return arr, lambda a: float(a.get()[0])

    async def all_reduce_scalar(self, value: float, op: ReduceOp) -> float:
        arr, read = self._scalar(value)
        await self.comm.all_reduce(arr, None, op)
        return read(arr)

    async def broadcast_scalar(self, value: float) -> float:
        arr, read = self._scalar(value)
        await self.comm.broadcast(arr, 0)
        return read(arr)
