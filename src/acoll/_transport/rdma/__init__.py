"""InfiniBand / RoCE transport through pyverbs (``ACOLL_NET=ib``).

Sans-IO parts, tested with plain values: :mod:`.discovery` (ports, HCA filter, GID
choice), :mod:`.qp` (queue-pair info record and state transitions), :mod:`.wire` (frames),
:mod:`.flow` (receive credits, rendezvous tables), :mod:`.regcache` (registration cache),
:mod:`.failures` (what verbs errors mean), and the GPUDirect RDMA rules of :mod:`.gdr`
(topology, support, flush; its CUDA driver calls behind one seam). :mod:`.verbs` is the
thin adapter over pyverbs (imported lazily: acoll imports without it), and
:mod:`.transport` the transport itself.
"""

from __future__ import annotations

from .transport import RdmaConnection, RdmaListener, RdmaTransport, make_rdma, rdma_ports
from .verbs import provided, set_provider

__all__ = ["RdmaConnection", "RdmaListener", "RdmaTransport", "make_rdma", "provided",
           "rdma_ports", "set_provider"]
