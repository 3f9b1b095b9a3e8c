"""``torch.distributed``: gloo on CPU tensors, nccl on CUDA tensors (``--vs``).

torch's ops block until done, so the awaitables run them synchronously; with nccl,
:meth:`TorchBackend.sync` waits for the GPU. Out-of-place all_reduce and reduce are
``copy_`` plus the in-place op (torch has no other form).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from ..._dtypes import ReduceOp
from ..buffers import TorchAllocator
from ..colls import Coll
from .base import Backend, Op, OpArgs

__all__ = ["TorchBackend"]

#: Reductions torch does in place only: out of place is ``out.copy_(inp)``, then ``out``.
_COPY_FIRST = ("all_reduce", "reduce")


class TorchBackend(Backend):
    """``backend`` (``gloo`` or ``nccl``) of ``torch.distributed``, as rank ``rank`` of ``size``.

    :meth:`open` joins the process group at ``init_method`` (a ``tcp://`` address);
    :meth:`close` destroys it. With nccl, rank ``local_rank`` takes GPU
    ``local_rank % device_count``.
    """

    def __init__(self, backend: str, init_method: str, rank: int, size: int,
                 local_rank: int, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        super().__init__(TorchAllocator(self.device))
        self.name = backend
        self.rank, self.size = rank, size
        self._init = init_method, datetime.timedelta(seconds=timeout)
        self.info = {"backend": f"torch.distributed {backend} (torch {torch.__version__})",
                     "net": backend, "loop": "-", "chunk": "-"}
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PROD: dist.ReduceOp.PRODUCT,
                     ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.AVG: dist.ReduceOp.AVG}

    async def open(self) -> None:
        init_method, timeout = self._init
        self.dist.init_process_group(self.name, init_method=init_method, rank=self.rank,
                                     world_size=self.size, timeout=timeout)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        dist, rop = self.dist, self._ops[args.op]
        inp, out, root = args.inp, args.out, args.root
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def sendrecv() -> None:
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt),
                                               dist.P2POp(dist.irecv, out, prv)]):
                req.wait()

        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(out, op=rop),
            "broadcast": lambda: dist.broadcast(out, src=root),
            "reduce": lambda: dist.reduce(out, dst=root, op=rop),
            "all_gather": lambda: ag(out, inp),
            "reduce_scatter": lambda: rs(out, inp, op=rop),
            "all_to_all": lambda: dist.all_to_all_single(out, inp),
            "sendrecv": sendrecv,
            "barrier": dist.barrier,
        }
        call = calls[coll.name]
        if coll.name in _COPY_FIRST and not args.inplace:
            reduce_out = call

            def copy_then_reduce() -> object:
                out.copy_(inp)
                return reduce_out()
            call = copy_then_reduce

        async def run() -> None:
            call()
        return run

    def unsupported(self, exc: BaseException) -> bool:
        return isinstance(exc, (RuntimeError, ValueError, TypeError, NotImplementedError))

    async def barrier(self) -> None:
        self.dist.barrier()

    async def all_reduce_scalar(self, value: float, op: ReduceOp) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self._ops[op])
        return float(t.item())

    async def broadcast_scalar(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.broadcast(t, src=0)
        return float(t.item())

    async def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
