"""The libraries ``acoll-perf`` measures, one module each, behind :class:`Backend`.

``acoll`` (:class:`~.acoll.AcollBackend`), the raw TCP ceiling (:class:`~.tcp.TcpBackend`)
and ``torch.distributed`` gloo/nccl (:class:`~.torch.TorchBackend`). Import a backend's
module only to use it: torch is optional.
"""

from __future__ import annotations

from .base import Backend, Op, OpArgs

__all__ = ["Backend", "Op", "OpArgs"]
