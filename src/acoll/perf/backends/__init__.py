"""The libraries ``acoll-perf`` measures, one module each, behind :class:`Backend`.

``acoll`` (:class:`~.acoll.AcollBackend`), the raw TCP ceiling (:class:`~.tcp.TcpBackend`),
``torch.distributed`` gloo/nccl (:class:`~.torch.TorchBackend`) and MPI through mpi4py
(:class:`~.mpi.MpiBackend`). Import a backend's module only to use it: torch is optional
(the MPI module imports mpi4py only when a backend is made).
"""

from __future__ import annotations

from .base import Backend, Op, OpArgs

__all__ = ["Backend", "Op", "OpArgs"]
