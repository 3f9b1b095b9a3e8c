"""Which RDMA ports to use and how to address them, as in NCCL's ``ncclIbInit`` (sans-IO).

The adapter (:mod:`.verbs`) reads every device's ports into :class:`PortInfo` records;
everything here works on those plain records:

- :func:`usable_ports`: the active ports whose link layer is InfiniBand or Ethernet (RoCE),
  filtered by ``ACOLL_IB_HCA`` (``[^][=]dev[:port],...``, the rules of ``NCCL_IB_HCA``),
  that have an address to use; with the reason when none is left.
- :func:`choose_gid`: the GID a port's queue pairs use. ``ACOLL_IB_GID_INDEX`` picks an
  index; automatic (``-1``) takes, on Ethernet, a RoCE v2 GID holding an IPv4-mapped
  address (``::ffff:a.b.c.d``), else a RoCE v2 IPv6 GID that is not link-local, else any
  RoCE v2 GID, else RoCE v1 (in that order); on InfiniBand, index 0 (the port GID; LIDs
  route inside a subnet).
- :func:`link_gbps` and :meth:`PortInfo.describe`: the port's speed, MTU and limits for the
  INFO log.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..._net.interfaces import match_hca, parse_hca_spec
from .spec import (
    GID_TYPE_IB,
    GID_TYPE_ROCE_V1,
    GID_TYPE_ROCE_V2,
    LINK_LAYER_ETHERNET,
    LINK_LAYER_INFINIBAND,
    PORT_ACTIVE,
    mtu_bytes,
)

__all__ = ["GidEntry", "PortInfo", "choose_gid", "link_gbps", "usable_ports"]

_GID_TYPES = {GID_TYPE_IB: "IB", GID_TYPE_ROCE_V1: "RoCEv1", GID_TYPE_ROCE_V2: "RoCEv2"}
# ibv_port_attr.active_speed bits -> Gb/s per lane (SDR, DDR, QDR, FDR10, FDR, EDR, HDR, NDR)
_LANE_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.3125, 16: 14.0625, 32: 25.78125, 64: 53.125,
              128: 106.25}
_XDR_GBPS = 212.5  # active_speed_ex 256
# ibv_port_attr.active_width -> lanes
_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}


@dataclass(frozen=True)
class GidEntry:
    """One entry of a port's GID table."""

    index: int
    gid: bytes  # 16 bytes, network order
    gid_type: int  # spec.GID_TYPE_*

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError(f"a GID has 16 bytes, not {len(self.gid)}")

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @property
    def ipv4(self) -> ipaddress.IPv4Address | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else ``None``."""
        return self.address.ipv4_mapped

    @property
    def empty(self) -> bool:
        return not any(self.gid)

    def __str__(self) -> str:
        kind = _GID_TYPES.get(self.gid_type, f"type{self.gid_type}")
        return f"GID[{self.index}] {self.address} ({kind})"


@dataclass(frozen=True)
class PortInfo:
    """One port of one RDMA device, with the device limits that matter here.

    ``active_mtu`` is an ``ibv_mtu`` value (``5`` = 4096 bytes); ``speed``/``width`` are
    ``ibv_port_attr.active_speed``/``active_width`` (``speed_ex``: ``active_speed_ex``).
    """

    device: str
    port: int
    state: int
    link_layer: int
    active_mtu: int
    lid: int = 0
    speed: int = 0
    width: int = 0
    speed_ex: int = 0
    max_msg_sz: int = 1 << 31
    gids: tuple[GidEntry, ...] = ()
    max_qp_wr: int = 0
    max_sge: int = 0
    max_cqe: int = 0
    max_mr_size: int = 0
    max_qp: int = 0
    max_mr: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def roce(self) -> bool:
        return self.link_layer == LINK_LAYER_ETHERNET

    def describe(self, gid: GidEntry | None = None) -> str:
        """One line for the INFO log: speed, MTU, link layer, address and limits."""
        layer = "RoCE" if self.roce else "IB"
        where = f"{gid}" if gid is not None else f"LID {self.lid:#x}"
        if not self.roce and gid is not None:
            where = f"LID {self.lid:#x}, {gid}"
        try:
            mtu = f"{mtu_bytes(self.active_mtu)}"
        except ValueError:
            mtu = f"?({self.active_mtu})"
        gbps = link_gbps(self.speed, self.width, self.speed_ex)
        speed = f"{gbps:g} Gb/s" if gbps else "speed unknown"
        return (f"{self.name} {layer} {speed}, MTU {mtu}, {where}; limits: max_qp_wr "
                f"{self.max_qp_wr}, max_sge {self.max_sge}, max_cqe {self.max_cqe}, "
                f"max_mr_size {self.max_mr_size:#x}, max_msg_sz {self.max_msg_sz:#x}")


def link_gbps(speed: int, width: int, speed_ex: int = 0) -> float:
    """Link bandwidth in Gb/s from ``active_speed``/``active_width`` (0 when unknown)."""
    lanes = _LANES.get(width, 0)
    if speed_ex == 256:
        return _XDR_GBPS * lanes
    per = _LANE_GBPS.get(speed, 0.0)
    return per * lanes


def choose_gid(port: PortInfo, index: int = -1) -> GidEntry | None:
    """The GID ``port``'s queue pairs use (see the module doc); ``None`` when there is none.

    Raises:
        ValueError: ``index`` (>= 0, from ``ACOLL_IB_GID_INDEX``) is not a populated entry
            of the port's GID table.
    """
    table = [g for g in port.gids if not g.empty]
    if index >= 0:
        for gid in table:
            if gid.index == index:
                return gid
        raise ValueError(f"ACOLL_IB_GID_INDEX={index}: {port.name} has no GID at that index "
                         f"(populated: {[g.index for g in table]})")
    if not port.roce:
        return next((g for g in table if g.index == 0), table[0] if table else None)

    def rank(g: GidEntry) -> tuple[int, int]:
        v2 = g.gid_type == GID_TYPE_ROCE_V2
        if v2 and g.ipv4 is not None:
            order = 0
        elif v2 and not g.address.is_link_local:
            order = 1
        elif v2:
            order = 2
        elif g.gid_type == GID_TYPE_ROCE_V1 and g.ipv4 is not None:
            order = 3
        else:
            order = 4
        return order, g.index

    roce = [g for g in table if g.gid_type in (GID_TYPE_ROCE_V1, GID_TYPE_ROCE_V2)]
    return min(roce, key=rank) if roce else None


def usable_ports(ports: Iterable[PortInfo], hca_spec: str = "", gid_index: int = -1
                 ) -> tuple[list[tuple[PortInfo, GidEntry | None]], str]:
    """The ports to use with the GID of each, in listing order, and why none if empty.

    Raises:
        ValueError: ``hca_spec`` does not parse, or ``gid_index`` names a missing entry on
            a port that would otherwise be used.
    """
    spec = parse_hca_spec(hca_spec) if hca_spec.strip() else None
    found: list[tuple[PortInfo, GidEntry | None]] = []
    seen = inactive = layer = filtered = no_gid = 0
    for port in ports:
        seen += 1
        if port.state != PORT_ACTIVE:
            inactive += 1
            continue
        if port.link_layer not in (LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET):
            layer += 1
            continue
        if spec is not None and not match_hca(port.device, port.port, spec):
            filtered += 1
            continue
        gid = choose_gid(port, gid_index)
        if port.roce and gid is None:
            no_gid += 1
            continue
        if not port.roce and port.lid == 0 and gid_index < 0:
            no_gid += 1  # an IB port without a LID has not been configured by a subnet manager
            continue
        found.append((port, gid))
    if found:
        return found, ""
    if not seen:
        return [], "no RDMA device"
    why = [f"{seen} port(s) found"]
    for count, what in ((inactive, "not active"), (layer, "of an unknown link layer"),
                        (filtered, "excluded by ACOLL_IB_HCA"),
                        (no_gid, "without a usable address (no LID / RoCE GID)")):
        if count:
            why.append(f"{count} {what}")
    return [], "no usable RDMA port: " + ", ".join(why)
