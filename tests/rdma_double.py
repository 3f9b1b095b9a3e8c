"""Building RDMA transports over the verbs test double (``verbs_double``), for tests.

Each event loop gets its own fabrics (the deferred fabric schedules work on that loop);
:func:`cleanup` closes every transport made and every simulated device context, so no
descriptor outlives its test.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

from acoll._transport.rdma import RdmaTransport, rdma_ports
from acoll._transport.rdma.qp import QpSettings
from verbs_double import E, Fabric, PortSpec, gid_v4, gid_v6

__all__ = ["KEY", "OTHER_KEY", "Config", "cleanup", "fabric_for", "make_transport"]

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

#: Quick failure detection in tests: ACK timeout 4.096 us * 2**12 = 17 ms, 3 retries.
FAST = QpSettings(timeout=12, retry_cnt=3, rnr_retry=7, min_rnr_timer=1)


@dataclass(frozen=True)
class Config:
    """One way to build the fabric and the transports on it."""

    name: str
    roce: bool = False
    deferred: bool = True
    eager: int | None = None
    depth: int | None = None
    chunk: int | None = None
    settings: QpSettings = FAST


_state: dict[int, tuple[asyncio.AbstractEventLoop, dict[str, Fabric], list[RdmaTransport]]] = {}


def _build(config: Config, loop: asyncio.AbstractEventLoop) -> Fabric:
    schedule = (lambda delay, fn: loop.call_later(delay, fn)) if config.deferred else None
    fab = Fabric(schedule=schedule)
    if config.roce:
        fab.add_device("roce0", [PortSpec(
            link_layer=E.IBV_LINK_LAYER_ETHERNET, active_mtu=E.IBV_MTU_1024,
            gids=[(gid_v6("fe80::1"), E.IBV_GID_TYPE_ROCE_V1),
                  (gid_v6("fe80::1"), E.IBV_GID_TYPE_ROCE_V2),
                  (gid_v4("192.0.2.7"), E.IBV_GID_TYPE_ROCE_V1),
                  (gid_v4("192.0.2.7"), E.IBV_GID_TYPE_ROCE_V2)])])
    else:
        fab.add_device("ib0")
    return fab


def fabric_for(config: Config) -> Fabric:
    """The running loop's fabric for ``config`` (made on first use)."""
    loop = asyncio.get_running_loop()
    entry = _state.get(id(loop))
    if entry is None or entry[0] is not loop:
        entry = _state[id(loop)] = (loop, {}, [])
    fabrics = entry[1]
    if config.name not in fabrics:
        fabrics[config.name] = _build(config, loop)
    return fabrics[config.name]


def make_transport(config: Config, key: bytes = KEY, **overrides: Any) -> RdmaTransport:
    """A transport on the running loop's fabric for ``config``."""
    fab = fabric_for(config)
    [(port, gid)], why = rdma_ports("", fab.lib)
    assert not why
    kw: dict[str, Any] = {"eager": config.eager, "depth": config.depth,
                          "chunk": config.chunk, "settings": config.settings}
    kw.update(overrides)
    transport = RdmaTransport(("127.0.0.1", 0), socket.AF_INET, key=key, port=port, gid=gid,
                              lib=fab.lib, timeout=5.0, **kw)
    _state[id(asyncio.get_running_loop())][2].append(transport)
    return transport


def cleanup() -> None:
    """Close every transport and device context made on the running loop."""
    loop = asyncio.get_running_loop()
    entry = _state.pop(id(loop), None)
    if entry is None or entry[0] is not loop:
        return
    _loop, fabrics, transports = entry
    for transport in transports:
        for conn in list(transport.conns.values()):
            conn.abort()
        transport.close()
    for fab in fabrics.values():
        fab.close()
