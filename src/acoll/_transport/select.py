"""Choosing transports: this rank's ordered list, and the network in ``initNet`` order.

A communicator serves several transports at once and picks one per peer (see
:mod:`acoll._comm.peers`); :func:`select_transports` returns this rank's list in
preference order: the in-process transport (unless ``ACOLL_INPROC_DISABLE=1``), shared
memory for ranks in other processes of this host (unless ``ACOLL_SHM_DISABLE=1``), then the
one data network, which carries every other pair (ranks on other hosts). The network is
chosen in NCCL's ``initNet`` order:

1. A network plugin: any installed package exposing an ``acoll.net`` entry point, whose
   object is called as ``factory(sockaddr, family, timeout, key=key)`` and returns a
   :class:`~.base.Transport`, or ``None`` when it cannot run here. ``key`` is the job's
   authentication key: the plugin must admit only connections that prove it (see
   :mod:`acoll._auth`).
2. InfiniBand/RoCE through pyverbs (``ib``, :mod:`.rdma`), unless ``ACOLL_IB_DISABLE=1``:
   used when pyverbs imports and an active InfiniBand or RoCE port matches
   ``ACOLL_IB_HCA``; otherwise one INFO line says why not.
3. TCP sockets (``socket``), always available.

``ACOLL_NET`` names one of them and makes its absence an error instead of a fallback
(:class:`~acoll.errors.TransportError` for ``ib``).
"""

from __future__ import annotations

import functools
import socket
from importlib.metadata import entry_points
from typing import Any

from .._config import Setting, get_logger, parse_bool
from ..errors import InvalidUsage, TransportError
from .base import Transport
from .inproc import make_inproc
from .rdma import make_rdma, rdma_ports
from .shm import make_shm
from .tcp import TcpTransport

__all__ = ["NET", "ib_devices", "plugins", "select_transport", "select_transports"]

log = get_logger("NET")

NET = Setting("NET", str, "", "Force the data network: socket, ib, or a plugin's name.",
              "NET")
IB_DISABLE = Setting("IB_DISABLE", parse_bool, False, "Never use InfiniBand/RoCE.", "NET")
IB_HCA = Setting("IB_HCA", str, "",
                 "RDMA devices/ports to use: [^][=]dev[:port],... (NCCL_IB_HCA rules).", "NET")


def ib_devices(hca_spec: str = "") -> tuple[list[tuple[str, int]], str]:
    """Active RDMA ``(device, port)`` pairs matching ``hca_spec``, and why none if empty.

    Uses pyverbs when it is installed; never raises for a missing stack.
    """
    found, why = rdma_ports(hca_spec)
    return [(port.device, port.port) for port, _gid in found], why


@functools.cache
def plugins() -> tuple[tuple[str, Any], ...]:
    """The installed ``acoll.net`` entry points, scanned once per process (reading every
    installed distribution's metadata takes milliseconds, tens of them in large
    environments: formation calls this on a worker thread first, see
    ``Communicator._form``)."""
    return tuple((ep.name, ep) for ep in entry_points(group="acoll.net"))


def select_transport(sockaddr: tuple[Any, ...], family: socket.AddressFamily, *,
                     timeout: float, key: bytes, net: str | None = None) -> Transport:
    """Return the data transport for this rank (see the module docstring)."""
    forced = NET.resolve(net).strip().lower()
    for name, ep in plugins():
        if forced and forced != name.lower():
            continue
        try:
            transport = ep.load()(sockaddr, family, timeout, key=key)
        except Exception as exc:
            log.warning("net plugin %s failed to load: %s", name, exc)
            transport = None
        if transport is not None:
            log.info("NET/Plugin: using %s", name)
            return transport  # type: ignore[no-any-return]
        if forced:
            raise InvalidUsage(f"ACOLL_NET={forced}: the plugin cannot run here")
    if forced not in ("", "ib", "socket"):
        raise InvalidUsage(f"ACOLL_NET={forced!r}: no such network (socket, ib, or an "
                           "installed acoll.net plugin)")
    if forced in ("", "ib"):
        if IB_DISABLE.resolve():
            if forced == "ib":
                raise TransportError("ACOLL_NET=ib: InfiniBand/RoCE is disabled by "
                                     "ACOLL_IB_DISABLE")
            log.info("NET/IB: not used (disabled by ACOLL_IB_DISABLE); using sockets")
        else:
            rdma, why = make_rdma(sockaddr, family, timeout=timeout, key=key,
                                  hca=IB_HCA.resolve())
            if rdma is not None:
                return rdma
            if forced == "ib":
                raise TransportError(f"ACOLL_NET=ib: RDMA is not possible here: {why}")
            log.info("NET/IB: not used (%s); using sockets", why)
    transport = TcpTransport(sockaddr, family, timeout=timeout, key=key)
    log.info("NET/Socket: using TCP on %s with %d socket(s) per peer", sockaddr[0],
             transport.nsocks)
    return transport


def select_transports(sockaddr: tuple[Any, ...], family: socket.AddressFamily, *,
                      timeout: float, key: bytes, net: str | None = None, nranks: int = 0
                      ) -> list[Transport]:
    """This rank's transports in preference order (see the module docstring); ``nranks``
    is the size of the communicator they serve (0: unknown)."""
    out: list[Transport] = []
    for make in _LOCAL:
        transport = make(timeout=timeout, key=key, nranks=nranks)
        if transport is not None:
            out.append(transport)
    out.append(select_transport(sockaddr, family, timeout=timeout, key=key, net=net))
    return out


#: Transports for peers on this host or in this process, tried before the network, in
#: order. Each is called as ``make(timeout=..., key=..., nranks=...)`` and returns ``None`` when it
#: is turned off or cannot run here (and logs why at INFO).
_LOCAL: list[Any] = [make_inproc, make_shm]
