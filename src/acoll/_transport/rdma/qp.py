"""Queue-pair set-up: the info record both ends exchange and the state transitions (sans-IO).

An RC queue pair goes RESET -> INIT -> RTR -> RTS, each transition with the attributes the
verbs specification requires for it (``ibv_modify_qp``):

==============  ===========================================================================
RESET -> INIT   port, P_Key index, access flags (remote write allowed)
INIT -> RTR     address vector (LID on InfiniBand; GRH with the peer's GID and our GID index
                on RoCE), path MTU, peer QP number, receive PSN, responder resources,
                minimum RNR NAK timer
RTR -> RTS      send PSN, ACK timeout, retry count, RNR retry count, initiator resources
==============  ===========================================================================

Both ends learn each other's :class:`QpInfo` (QP number, LID, GID, first PSN, MTU) as a
msgpack map over the authenticated control connection. :class:`Handshake` is the order of
the steps; a step out of order is a :class:`ProtocolError`, so a confused or hostile peer
cannot make this end post sends before the peer's receive side is ready:

    NEW --created--> INIT --sent--> SENT --got(info)--> RTR --rts--> RTS --ready--> READY

``ready`` means the peer reported its queue pair in RTS (so its receives are posted and it
accepts our packets); only then may this end post sends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from ...errors import ProtocolError
from .spec import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    LINK_LAYER_ETHERNET,
    LINK_LAYER_INFINIBAND,
    QPS_INIT,
    QPS_RTR,
    QPS_RTS,
    mtu_bytes,
)

__all__ = ["Handshake", "QpInfo", "QpSettings", "Step", "Transition", "init_transition",
           "path_mtu", "rtr_transition", "rts_transition"]

_VERSION = 1
_U24 = 1 << 24

# enum ibv_qp_attr_mask
MASK = {
    "qp_state": 1 << 0, "qp_access_flags": 1 << 3, "pkey_index": 1 << 4, "port_num": 1 << 5,
    "ah_attr": 1 << 7, "path_mtu": 1 << 8, "timeout": 1 << 9, "retry_cnt": 1 << 10,
    "rnr_retry": 1 << 11, "rq_psn": 1 << 12, "max_rd_atomic": 1 << 13,
    "min_rnr_timer": 1 << 15, "sq_psn": 1 << 16, "max_dest_rd_atomic": 1 << 17,
    "dest_qp_num": 1 << 20,
}


@dataclass(frozen=True)
class QpInfo:
    """What one end tells the other about its queue pair.

    Attributes:
        qpn: queue pair number (24 bits).
        psn: the first packet sequence number it sends with (24 bits).
        lid: the port's LID (InfiniBand; 0 on RoCE).
        gid: the GID its packets come from (16 bytes; routes RoCE traffic).
        mtu: the port's active MTU (``ibv_mtu``).
        link_layer: InfiniBand or Ethernet (``spec.LINK_LAYER_*``).
    """

    qpn: int
    psn: int
    lid: int
    gid: bytes
    mtu: int
    link_layer: int

    def __post_init__(self) -> None:
        if not (0 < self.qpn < _U24 and 0 <= self.psn < _U24 and 0 <= self.lid < 1 << 16):
            raise ValueError(f"QP info out of range: qpn {self.qpn}, psn {self.psn}, "
                             f"lid {self.lid}")
        if len(self.gid) != 16:
            raise ValueError(f"a GID has 16 bytes, not {len(self.gid)}")
        mtu_bytes(self.mtu)
        if self.link_layer not in (LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET):
            raise ValueError(f"unknown link layer {self.link_layer}")

    def pack(self) -> bytes:
        return msgpack.packb({"v": _VERSION, "qpn": self.qpn, "psn": self.psn,
                              "lid": self.lid, "gid": self.gid, "mtu": self.mtu,
                              "ll": self.link_layer})

    @classmethod
    def unpack(cls, data: bytes) -> QpInfo:
        """Parse a peer's record.

        Raises:
            ProtocolError: not a QP info record of this version, or a field out of range.
        """
        try:
            body = msgpack.unpackb(data)
            if not isinstance(body, dict) or body.get("v") != _VERSION:
                raise ValueError("not a version 1 QP info record")
            fields: dict[str, Any] = {k: body[k] for k in ("qpn", "psn", "lid", "gid", "mtu")}
            fields["link_layer"] = body["ll"]
            for name, value in fields.items():
                want = bytes if name == "gid" else int
                if type(value) is not want:
                    raise ValueError(f"{name} is a {type(value).__name__}")
            return cls(**fields)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"bad QP info from the peer: {exc}") from exc


@dataclass(frozen=True)
class QpSettings:
    """Reliability settings of the RC queue pairs (``ibv_qp_attr`` encodings).

    Attributes:
        timeout: local ACK timeout, 4.096 us * 2**timeout (0 = infinite; 1..31).
        retry_cnt: retransmissions without an ACK before the send fails (0..7).
        rnr_retry: retries after "receiver not ready" (0..6; 7 = forever).
        min_rnr_timer: the RNR NAK delay this end asks of senders (0..31, 12 = 0.64 ms).
        sl: service level (InfiniBand), traffic_class: IP traffic class (RoCE),
        hop_limit: GRH hop limit (RoCE), pkey_index: P_Key table index,
        rd_atomic: outstanding RDMA reads/atomics (unused by the data path, >= 1).
        mtu: largest path MTU to use (``ibv_mtu``; 0 = the ports' own).
    """

    timeout: int = 18
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12
    sl: int = 0
    traffic_class: int = 0
    hop_limit: int = 64
    pkey_index: int = 0
    rd_atomic: int = 1
    mtu: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (("timeout", 0, 31), ("retry_cnt", 0, 7), ("rnr_retry", 0, 7),
                                ("min_rnr_timer", 0, 31), ("sl", 0, 15),
                                ("traffic_class", 0, 255), ("hop_limit", 1, 255),
                                ("pkey_index", 0, 0xFFFF), ("rd_atomic", 1, 16)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"QP setting {name}={value} is outside {low}..{high}")
        if self.mtu:
            mtu_bytes(self.mtu)

    @property
    def ack_timeout_s(self) -> float:
        """Seconds before an unacknowledged send is retried (``inf`` for timeout 0)."""
        return float("inf") if self.timeout == 0 else 4.096e-6 * 2 ** self.timeout


@dataclass(frozen=True)
class Transition:
    """One ``ibv_modify_qp``: the target state, the attributes and their mask."""

    state: int
    attrs: dict[str, Any]

    @property
    def mask(self) -> int:
        return sum(MASK[name] for name in self.attrs) | MASK["qp_state"]


def init_transition(port: int, settings: QpSettings, *, remote_read: bool = False
                    ) -> Transition:
    """RESET -> INIT: the port, P_Key index and access (peers may write our memory; with
    ``remote_read`` also read it: the loop-back queue pair of GPUDirect flushes)."""
    access = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | (ACCESS_REMOTE_READ if remote_read
                                                         else 0)
    return Transition(QPS_INIT, {"port_num": port, "pkey_index": settings.pkey_index,
                                 "qp_access_flags": access})


def path_mtu(local: QpInfo, remote: QpInfo, settings: QpSettings) -> int:
    """The path MTU both ends use: the smaller port MTU, capped by the setting."""
    mtu = min(local.mtu, remote.mtu)
    return min(mtu, settings.mtu) if settings.mtu else mtu


def rtr_transition(local: QpInfo, remote: QpInfo, port: int, gid_index: int,
                   settings: QpSettings) -> Transition:
    """INIT -> RTR towards ``remote``.

    Raises:
        ProtocolError: the ends have different link layers, or the peer gave no address
            this link layer can route (LID 0 on InfiniBand, an empty GID on RoCE).
    """
    if local.link_layer != remote.link_layer:
        raise ProtocolError("the peer's port has another link layer (InfiniBand vs RoCE)")
    if local.link_layer == LINK_LAYER_ETHERNET:
        if not any(remote.gid):
            raise ProtocolError("the peer sent an empty GID (RoCE needs one)")
        ah: dict[str, Any] = {"is_global": 1, "dlid": 0, "sl": settings.sl,
                              "port_num": port, "dgid": remote.gid, "sgid_index": gid_index,
                              "hop_limit": settings.hop_limit,
                              "traffic_class": settings.traffic_class}
    else:
        if remote.lid == 0:
            raise ProtocolError("the peer sent LID 0 (its port has no LID assigned)")
        ah = {"is_global": 0, "dlid": remote.lid, "sl": settings.sl, "port_num": port}
    return Transition(QPS_RTR, {
        "ah_attr": ah, "path_mtu": path_mtu(local, remote, settings),
        "dest_qp_num": remote.qpn, "rq_psn": remote.psn,
        "max_dest_rd_atomic": settings.rd_atomic, "min_rnr_timer": settings.min_rnr_timer})


def rts_transition(local: QpInfo, settings: QpSettings) -> Transition:
    """RTR -> RTS: our send PSN and the retry/timeout settings."""
    return Transition(QPS_RTS, {
        "sq_psn": local.psn, "timeout": settings.timeout, "retry_cnt": settings.retry_cnt,
        "rnr_retry": settings.rnr_retry, "max_rd_atomic": settings.rd_atomic})


class Step(enum.Enum):
    NEW = "new"
    INIT = "init"
    SENT = "info sent"
    RTR = "rtr"
    RTS = "rts"
    READY = "ready"
    FAILED = "failed"


# input -> (state it is allowed in, state it leads to)
_TABLE: dict[str, tuple[Step, Step]] = {
    "created": (Step.NEW, Step.INIT),
    "sent": (Step.INIT, Step.SENT),
    "got": (Step.SENT, Step.RTR),
    "rts": (Step.RTR, Step.RTS),
    "ready": (Step.RTS, Step.READY),
}


class Handshake:
    """The order of one end's set-up steps (see the module doc)."""

    def __init__(self, local: QpInfo | None = None) -> None:
        self.step = Step.NEW
        self.local = local
        self.remote: QpInfo | None = None

    def _advance(self, event: str) -> None:
        allowed, target = _TABLE[event]
        if self.step is not allowed:
            was = self.step
            self.step = Step.FAILED
            raise ProtocolError(f"QP set-up: {event!r} in state {was.value!r}")
        self.step = target

    def created(self, local: QpInfo) -> bytes:
        """Our queue pair is in INIT with its receives posted: returns the record to send."""
        self._advance("created")
        self.local = local
        return local.pack()

    def sent(self) -> None:
        self._advance("sent")

    def got(self, data: bytes) -> QpInfo:
        """The peer's record arrived (parsed and checked); go to RTR with it next."""
        self._advance("got")
        try:
            self.remote = QpInfo.unpack(data)
        except ProtocolError:
            self.step = Step.FAILED
            raise
        return self.remote

    def rts(self) -> None:
        self._advance("rts")

    def ready(self) -> None:
        """The peer reported RTS: sends may be posted from now on."""
        self._advance("ready")

    def fail(self) -> None:
        self.step = Step.FAILED

    @property
    def can_send(self) -> bool:
        return self.step is Step.READY
