"""A verbs TEST DOUBLE: an in-process stand-in for pyverbs and an RDMA fabric.

This is not RDMA and moves no packets: it lets the RDMA transport run in CI on machines
without RDMA hardware (no NIC, no rxe/siw). It offers the subset of pyverbs' surface that
``acoll._transport.rdma.verbs`` calls (``Context``, ``PD``, ``MR``, ``CompChannel``,
``CQ``, ``QPCap``, ``QPInitAttr``, ``QP``, ``QPAttr``, ``AHAttr``, ``GlobalRoute``,
``GID``, ``SGE``, ``SendWR``, ``RecvWR``, ``get_device_list``, the enums as ``e``, the
``Pyverbs*Error`` classes), with pyverbs' signatures, over a :class:`Fabric` of
simulated devices in this process. Memory is real: registered ranges are real addresses,
and RDMA WRITE and SEND copy bytes between them.

Its rules are those of the verbs specification (InfiniBand Architecture Specification
vol. 1, ch. 10-11, and ``ibv_modify_qp``/``ibv_post_send``/``ibv_poll_cq``), not the
transport's assumptions:

- RC queue pairs go RESET -> INIT -> RTR -> RTS (and any state -> RESET or ERR); each
  transition needs exactly the attribute mask bits the specification requires (extra
  bits only where it allows them), with values in range (port, path MTU not above the
  port's, a GRH on RoCE ports, ...). Sends may be posted in RTS (or ERR, where they are
  flushed); receives in INIT, RTR, RTS (or ERR).
- A work request's local SGE must lie inside a memory region of the queue pair's
  protection domain with that lkey (else ``LOC_PROT_ERR``); a receive buffer's region
  needs local write access.
- An RDMA WRITE must target a range inside a region with that rkey, in the responder's
  protection domain, registered with remote write access, on a queue pair that allows
  remote writes; else the requester completes with ``REM_ACCESS_ERR``, both queue
  pairs enter the error state and the responder's context gets ``QP_ACCESS_ERR``.
- A SEND, or a WRITE with immediate, needs a posted receive at the responder; with none
  the requester retries after the responder's RNR timer, ``rnr_retry`` times (7 =
  forever), then completes with ``RNR_RETRY_EXC_ERR`` and enters the error state. A
  SEND larger than the receive buffer fails both sides (``LOC_LEN_ERR`` at the
  responder, ``REM_INV_REQ_ERR`` at the requester).
- Packets reach the responder only over a connected path: both ports active, the
  address vector resolving to the peer's port (LID on InfiniBand, GID on RoCE, same GID
  type), the peer's QP in RTR or RTS and connected back to this one, equal path MTUs and
  matching PSNs. Otherwise the requester retries every ACK timeout (4.096 us *
  2**timeout), ``retry_cnt`` times, then completes with ``RETRY_EXC_ERR``.
- Work requests of one queue pair execute and complete in order; a blocked one (RNR)
  holds back those behind it. A queue pair in the error state flushes every outstanding
  and later work request with ``WR_FLUSH_ERR``. A work request's queue slot is freed
  when its completion is polled; posting beyond the queue's depth fails (``ENOMEM``).
- A completion queue armed by ``req_notify`` writes one event to its channel's file
  descriptor (a non-blocking pipe) at the next completion; ``get_cq_event`` reads it
  (``EAGAIN`` when there is none); overflowing a completion queue is a ``CQ_ERR``.
- Asynchronous events go to a per-context queue with a pollable descriptor.
- An RDMA READ needs a local region with local write access, a remote region with that
  rkey and remote read access, a responder queue pair that allows remote reads and read
  resources on both ends (``max_rd_atomic``, ``max_dest_rd_atomic``); else
  ``LOC_PROT_ERR`` or ``REM_ACCESS_ERR``/``REM_INV_REQ_ERR`` as for writes. A queue pair
  may be connected to itself (loop-back).
- ``DmaBufMR`` follows pyverbs (``DmaBufMR(pd, length, access, dmabuf=fd, offset=0)``,
  ``ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd, access)``): a device without
  dma-buf support fails with ``EOPNOTSUPP``, a descriptor that is not open with
  ``EBADF``, one that is not a dma-buf (:func:`export_dmabuf` makes those), or a range
  beyond it, with ``EINVAL``; the region's addresses are I/O virtual addresses (offsets
  in the dma-buf), and its access flags are enforced like any region's. With
  ``Fabric(dmabuf_api="object")`` it rejects descriptors as pyverbs v34-v43 does
  (``TypeError``); with ``dmabuf_api=None`` there is no ``DmaBufMR``.
- "Device memory" (ranges :attr:`Fabric.device_memory` claims, a fake GPU's) can be
  registered by address only with ``Fabric(peermem=True)`` (a peer-memory module);
  otherwise ``ibv_reg_mr`` fails with ``EFAULT``, as the kernel cannot pin it.

Two execution modes: *immediate* (work requests run inside ``post_send``; delayed retries
run on threads, under the fabric's lock) and *deferred* (``Fabric(schedule=...)``: every
work request and retry runs later, from the given scheduler, e.g. an event loop's
``call_later``), which makes the hardware asynchronous to the code posting work.

Fault injection: :meth:`Fabric.port_down`, :meth:`Fabric.fail_qp`, :meth:`Fabric.crash`.
Extensions beyond pyverbs (which cannot expose them): ``Context.async_fd`` and
``AsyncEvent.qp_num``/``port_num``.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import itertools
import os
import threading
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["E", "DmaBufMR", "Fabric", "PortSpec", "export_dmabuf", "gid_v4", "gid_v6"]

# ---------------------------------------------------------------------- enums (verbs.h)
E = types.SimpleNamespace(
    IBV_QPT_RC=2, IBV_QPT_UC=3, IBV_QPT_UD=4,
    IBV_QPS_RESET=0, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_SQD=4,
    IBV_QPS_SQE=5, IBV_QPS_ERR=6,
    IBV_QP_STATE=1 << 0, IBV_QP_CUR_STATE=1 << 1, IBV_QP_EN_SQD_ASYNC_NOTIFY=1 << 2,
    IBV_QP_ACCESS_FLAGS=1 << 3, IBV_QP_PKEY_INDEX=1 << 4, IBV_QP_PORT=1 << 5,
    IBV_QP_QKEY=1 << 6, IBV_QP_AV=1 << 7, IBV_QP_PATH_MTU=1 << 8, IBV_QP_TIMEOUT=1 << 9,
    IBV_QP_RETRY_CNT=1 << 10, IBV_QP_RNR_RETRY=1 << 11, IBV_QP_RQ_PSN=1 << 12,
    IBV_QP_MAX_QP_RD_ATOMIC=1 << 13, IBV_QP_ALT_PATH=1 << 14, IBV_QP_MIN_RNR_TIMER=1 << 15,
    IBV_QP_SQ_PSN=1 << 16, IBV_QP_MAX_DEST_RD_ATOMIC=1 << 17, IBV_QP_PATH_MIG_STATE=1 << 18,
    IBV_QP_CAP=1 << 19, IBV_QP_DEST_QPN=1 << 20,
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=1 << 1, IBV_ACCESS_REMOTE_READ=1 << 2,
    IBV_ACCESS_REMOTE_ATOMIC=1 << 3,
    IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WR_SEND=2,
    IBV_WR_SEND_WITH_IMM=3, IBV_WR_RDMA_READ=4,
    IBV_SEND_FENCE=1, IBV_SEND_SIGNALED=1 << 1, IBV_SEND_SOLICITED=1 << 2,
    IBV_SEND_INLINE=1 << 3,
    IBV_WC_SEND=0, IBV_WC_RDMA_WRITE=1, IBV_WC_RDMA_READ=2, IBV_WC_RECV=1 << 7,
    IBV_WC_RECV_RDMA_WITH_IMM=(1 << 7) + 1,
    IBV_WC_SUCCESS=0, IBV_WC_LOC_LEN_ERR=1, IBV_WC_LOC_QP_OP_ERR=2, IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5, IBV_WC_LOC_ACCESS_ERR=8, IBV_WC_REM_INV_REQ_ERR=9,
    IBV_WC_REM_ACCESS_ERR=10, IBV_WC_REM_OP_ERR=11, IBV_WC_RETRY_EXC_ERR=12,
    IBV_WC_RNR_RETRY_EXC_ERR=13, IBV_WC_FATAL_ERR=19, IBV_WC_GENERAL_ERR=21,
    IBV_WC_GRH=1, IBV_WC_WITH_IMM=1 << 1,
    IBV_MTU_256=1, IBV_MTU_512=2, IBV_MTU_1024=3, IBV_MTU_2048=4, IBV_MTU_4096=5,
    IBV_PORT_NOP=0, IBV_PORT_DOWN=1, IBV_PORT_INIT=2, IBV_PORT_ARMED=3, IBV_PORT_ACTIVE=4,
    IBV_LINK_LAYER_UNSPECIFIED=0, IBV_LINK_LAYER_INFINIBAND=1, IBV_LINK_LAYER_ETHERNET=2,
    IBV_GID_TYPE_IB=0, IBV_GID_TYPE_ROCE_V1=1, IBV_GID_TYPE_ROCE_V2=2,
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1=0, IBV_GID_TYPE_SYSFS_ROCE_V2=1,
    IBV_EVENT_CQ_ERR=0, IBV_EVENT_QP_FATAL=1, IBV_EVENT_QP_REQ_ERR=2,
    IBV_EVENT_QP_ACCESS_ERR=3, IBV_EVENT_COMM_EST=4, IBV_EVENT_SQ_DRAINED=5,
    IBV_EVENT_PATH_MIG=6, IBV_EVENT_PATH_MIG_ERR=7, IBV_EVENT_DEVICE_FATAL=8,
    IBV_EVENT_PORT_ACTIVE=9, IBV_EVENT_PORT_ERR=10, IBV_EVENT_LID_CHANGE=11,
    IBV_EVENT_GID_CHANGE=18,
)
_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_U24 = 1 << 24
_PKEY_TABLE = 128

# Attribute mask bits per RC transition: (required, also allowed), IBA table 91 /
# ibv_modify_qp(3).
_S = E
_TRANSITIONS: dict[tuple[int, int], tuple[int, int]] = {
    (_S.IBV_QPS_RESET, _S.IBV_QPS_INIT): (
        _S.IBV_QP_PKEY_INDEX | _S.IBV_QP_PORT | _S.IBV_QP_ACCESS_FLAGS, 0),
    (_S.IBV_QPS_INIT, _S.IBV_QPS_INIT): (
        0, _S.IBV_QP_PKEY_INDEX | _S.IBV_QP_PORT | _S.IBV_QP_ACCESS_FLAGS),
    (_S.IBV_QPS_INIT, _S.IBV_QPS_RTR): (
        _S.IBV_QP_AV | _S.IBV_QP_PATH_MTU | _S.IBV_QP_DEST_QPN | _S.IBV_QP_RQ_PSN
        | _S.IBV_QP_MAX_DEST_RD_ATOMIC | _S.IBV_QP_MIN_RNR_TIMER,
        _S.IBV_QP_ALT_PATH | _S.IBV_QP_ACCESS_FLAGS | _S.IBV_QP_PKEY_INDEX),
    (_S.IBV_QPS_RTR, _S.IBV_QPS_RTS): (
        _S.IBV_QP_SQ_PSN | _S.IBV_QP_TIMEOUT | _S.IBV_QP_RETRY_CNT | _S.IBV_QP_RNR_RETRY
        | _S.IBV_QP_MAX_QP_RD_ATOMIC,
        _S.IBV_QP_CUR_STATE | _S.IBV_QP_ALT_PATH | _S.IBV_QP_ACCESS_FLAGS
        | _S.IBV_QP_MIN_RNR_TIMER | _S.IBV_QP_PATH_MIG_STATE),
    (_S.IBV_QPS_RTS, _S.IBV_QPS_RTS): (
        0, _S.IBV_QP_CUR_STATE | _S.IBV_QP_ACCESS_FLAGS | _S.IBV_QP_ALT_PATH
        | _S.IBV_QP_PATH_MIG_STATE | _S.IBV_QP_MIN_RNR_TIMER),
}

# RNR NAK timer encodings (IBA table 45), seconds
_RNR_TIMER = [655.36e-3, 0.01e-3, 0.02e-3, 0.03e-3, 0.04e-3, 0.06e-3, 0.08e-3, 0.12e-3,
              0.16e-3, 0.24e-3, 0.32e-3, 0.48e-3, 0.64e-3, 0.96e-3, 1.28e-3, 1.92e-3,
              2.56e-3, 3.84e-3, 5.12e-3, 7.68e-3, 10.24e-3, 15.36e-3, 20.48e-3, 30.72e-3,
              40.96e-3, 61.44e-3, 81.92e-3, 122.88e-3, 163.84e-3, 245.76e-3, 327.68e-3,
              491.52e-3]


# ---------------------------------------------------------------------- errors
class PyverbsError(Exception):
    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg, error_code)
        self.error_code = error_code


class PyverbsUserError(PyverbsError):
    pass


def gid_v4(ip: str) -> bytes:
    """The IPv4-mapped GID of ``ip`` (``::ffff:a.b.c.d``), as RoCE v2 ports list them."""
    return ipaddress.IPv6Address(f"::ffff:{ip}").packed


def gid_v6(ip: str) -> bytes:
    return ipaddress.IPv6Address(ip).packed


@dataclass
class PortSpec:
    """One simulated port. ``gids``: ``(gid bytes, gid type)`` by index, where the type is
    ``IBV_GID_TYPE_IB``/``ROCE_V1``/``ROCE_V2`` (``None`` for an empty entry)."""

    link_layer: int = E.IBV_LINK_LAYER_INFINIBAND
    state: int = E.IBV_PORT_ACTIVE
    active_mtu: int = E.IBV_MTU_4096
    lid: int = 0  # 0: assigned by the fabric (InfiniBand)
    gids: list[tuple[bytes, int] | None] = field(default_factory=list)
    active_speed: int = 64  # HDR
    active_width: int = 2  # 4x
    max_msg_sz: int = 1 << 31


@dataclass
class _DeviceSpec:
    name: str
    ports: list[PortSpec]
    max_qp_wr: int = 32768
    max_cqe: int = 4194303
    max_mr_size: int = 1 << 48
    max_qp: int = 1 << 17
    max_mr: int = 1 << 24
    max_sge: int = 30
    dmabuf: bool = True  # the kernel driver registers dma-bufs


class Fabric:
    """Simulated devices, their queue pairs and memory regions (see the module doc).

    Args:
        schedule: ``schedule(delay, fn)`` runs ``fn`` later (deferred mode); ``None``:
            immediate mode.
        legacy_channel: completion channels without ``fd``, as pyverbs before v45.
    """

    def __init__(self, schedule: Callable[[float, Callable[[], None]], Any] | None = None,
                 *, legacy_channel: bool = False, dmabuf_api: str | None = "fd",
                 peermem: bool = False) -> None:
        self.lock = threading.RLock()
        self.legacy_channel = legacy_channel
        self.dmabuf_api = dmabuf_api
        self.peermem = peermem
        #: ``device_memory(addr, length)``: whether the range is a fake GPU's memory
        self.device_memory: Callable[[int, int], bool] | None = None
        self._schedule = schedule
        self.devices: dict[str, _DeviceSpec] = {}
        self._lids = itertools.count(1)
        self._qpns = itertools.count(0x100 + 17)
        self._keys = itertools.count(0x1000)
        self.qps: dict[int, _QP] = {}
        self.contexts: list[_Context] = []
        self.stats = {"send": 0, "write": 0, "read": 0, "bytes": 0, "rnr_naks": 0,
                      "timeouts": 0}
        self.lib = self._make_lib()

    # ------------------------------------------------------------------ set-up
    def add_device(self, name: str, ports: list[PortSpec] | None = None, **limits: int) -> None:
        """Add a device (one active InfiniBand port by default)."""
        ports = ports if ports is not None else [PortSpec()]
        for port in ports:
            if port.link_layer == E.IBV_LINK_LAYER_INFINIBAND and port.lid == 0:
                port.lid = next(self._lids)
            if port.link_layer == E.IBV_LINK_LAYER_INFINIBAND and not port.gids:
                guid = (0x0002C90300000000 + port.lid).to_bytes(8, "big")
                port.gids = [(bytes.fromhex("fe80000000000000") + guid, E.IBV_GID_TYPE_IB)]
        self.devices[name] = _DeviceSpec(name, ports, **limits)

    # ------------------------------------------------------------------ faults
    def port_down(self, device: str, port: int = 1) -> None:
        """Take a port down: its packets are lost; ``PORT_ERR`` on every context."""
        with self.lock:
            self.devices[device].ports[port - 1].state = E.IBV_PORT_DOWN
            for ctx in self.contexts:
                if ctx.name == device and not ctx.closed:
                    ctx.event(E.IBV_EVENT_PORT_ERR, port_num=port)

    def fail_qp(self, qpn: int) -> None:
        """A fatal error on queue pair ``qpn``: ERR state and ``QP_FATAL``."""
        with self.lock:
            qp = self.qps[qpn]
            qp.error()
            qp.pd.ctx.event(E.IBV_EVENT_QP_FATAL, qp_num=qpn)

    def crash(self, ctx: Any) -> None:
        """The process owning ``ctx`` died: its queue pairs and memory regions vanish,
        silently (its descriptors stay open until their owners close them, as the
        transport objects of the "dead" side still live in this process)."""
        with self.lock:
            for pd in list(ctx.pds):
                for qp in list(pd.qps):
                    qp.close()
                for mr in list(pd.mrs.values()):
                    mr.close()
            ctx.dead = True

    def close(self) -> None:
        """Close every context still open (and its descriptors)."""
        with self.lock:
            for ctx in list(self.contexts):
                ctx.destroy()

    # ------------------------------------------------------------------ scheduling
    def later(self, delay: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            with self.lock:
                fn()

        if self._schedule is not None:
            self._schedule(delay, run)
        else:
            timer = threading.Timer(delay, run)
            timer.daemon = True
            timer.start()

    @property
    def deferred(self) -> bool:
        return self._schedule is not None

    # ------------------------------------------------------------------ routing
    def port(self, device: str, num: int) -> PortSpec:
        return self.devices[device].ports[num - 1]

    def route(self, src: _QP) -> tuple[_QP | None, str]:
        """The queue pair ``src``'s packets reach, or ``None`` and why not."""
        sport = self.port(src.device, src.port)
        if sport.state != E.IBV_PORT_ACTIVE:
            return None, "local port down"
        ah = src.ah
        target: tuple[str, int] | None = None
        for dev in self.devices.values():
            for num, port in enumerate(dev.ports, 1):
                if port.link_layer != sport.link_layer:
                    continue
                if sport.link_layer == E.IBV_LINK_LAYER_ETHERNET:
                    if any(g is not None and g[0] == ah.dgid for g in port.gids):
                        target = (dev.name, num)
                elif port.lid == ah.dlid:
                    target = (dev.name, num)
        if target is None:
            return None, "no port at that address"
        if self.port(*target).state != E.IBV_PORT_ACTIVE:
            return None, "remote port down"
        dst = self.qps.get(src.dest_qpn)
        if dst is None or (dst.device, dst.port) != target:
            return None, "no such queue pair there"
        if dst.state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS):
            return None, "remote queue pair not in RTR/RTS"
        if dst.dest_qpn != src.qpn or self._back(dst) != (src.device, src.port):
            return None, "remote queue pair is connected elsewhere"
        if sport.link_layer == E.IBV_LINK_LAYER_ETHERNET:
            stype = sport.gids[src.ah.sgid_index]
            dtype = self.port(*target).gids[dst.ah.sgid_index]
            if stype is None or dtype is None or stype[1] != dtype[1]:
                return None, "GID types differ"
        if src.path_mtu != dst.path_mtu:
            return None, "path MTUs differ"
        return dst, ""

    def _back(self, qp: _QP) -> tuple[str, int] | None:
        port = self.port(qp.device, qp.port)
        for dev in self.devices.values():
            for num, other in enumerate(dev.ports, 1):
                if port.link_layer == E.IBV_LINK_LAYER_ETHERNET:
                    if any(g is not None and g[0] == qp.ah.dgid for g in other.gids):
                        return dev.name, num
                elif other.lid == qp.ah.dlid and other.link_layer == port.link_layer:
                    return dev.name, num
        return None

    # ------------------------------------------------------------------ lib
    def _make_lib(self) -> types.SimpleNamespace:
        fabric = self

        def get_device_list() -> list[types.SimpleNamespace]:
            return [types.SimpleNamespace(name=name.encode()) for name in fabric.devices]

        def context(name: str | None = None, **kwargs: Any) -> _Context:
            if name is None:
                raise PyverbsUserError("Device name must be provided")
            return _Context(fabric, name)

        dmabuf_mr: Any = {"fd": DmaBufMR, "object": _ObjectDmaBufMR}.get(
            self.dmabuf_api or "")
        return types.SimpleNamespace(
            name="verbs test double", get_device_list=get_device_list, Context=context,
            PD=_PD, MR=_MR, DmaBufMR=dmabuf_mr, CompChannel=_CompChannel, CQ=_CQ,
            QPCap=QPCap,
            QPInitAttr=QPInitAttr, QP=_QP, QPAttr=QPAttr, AHAttr=AHAttr,
            GlobalRoute=GlobalRoute, GID=GID, SGE=SGE, SendWR=SendWR, RecvWR=RecvWR, e=E,
            PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError,
            PyverbsUserError=PyverbsUserError, fabric=fabric)


# dma-bufs are the kernel's, shared by every fabric: (st_dev, st_ino) -> (address, size)
_DMABUFS: dict[tuple[int, int], tuple[int, int]] = {}


def export_dmabuf(addr: int, length: int) -> int:
    """A new descriptor standing for a dma-buf of ``length`` bytes of memory at ``addr``
    (a memfd: a real, unique file; the caller closes it). What a fake GPU driver's
    ``cuMemGetHandleForAddressRange`` returns."""
    fd = os.memfd_create("fake-dmabuf", os.MFD_CLOEXEC)
    st = os.fstat(fd)
    _DMABUFS[(st.st_dev, st.st_ino)] = (addr, length)
    return fd


def _dmabuf(fd: int) -> tuple[int, int]:
    try:
        st = os.fstat(fd)
    except (OSError, OverflowError):
        raise PyverbsRDMAError("Failed to register a dma-buf MR", errno.EBADF) from None
    found = _DMABUFS.get((st.st_dev, st.st_ino))
    if found is None:
        raise PyverbsRDMAError("Failed to register a dma-buf MR", errno.EINVAL)
    return found


def _gid_text(raw: bytes) -> str:
    hexs = raw.hex()
    return ":".join(hexs[i:i + 4] for i in range(0, 32, 4))


class GID:
    """pyverbs' GID: set from, and shown as, 8 groups of 4 hex digits."""

    def __init__(self, val: str | None = None) -> None:
        self.raw = bytes(16)
        if val is not None:
            words = val.split(":")
            if len(words) != 8 or any(len(w) != 4 for w in words):
                raise PyverbsUserError(f"Invalid GID value ({words})")
            self.raw = bytes.fromhex("".join(words))

    @property
    def gid(self) -> str:
        return _gid_text(self.raw)


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


class AsyncEvent:
    def __init__(self, event_type: int, qp_num: int | None = None,
                 port_num: int | None = None) -> None:
        self.event_type = event_type
        self.qp_num = qp_num
        self.port_num = port_num
        self.acked = False

    def ack(self) -> None:
        self.acked = True


class _Context:
    def __init__(self, fabric: Fabric, name: str) -> None:
        if name not in fabric.devices:
            raise PyverbsRDMAError(f"Failed to find device {name}")
        self.fabric = fabric
        self.name = name
        self.spec = fabric.devices[name]
        self._events: deque[AsyncEvent] = deque()
        self.async_fd, self._async_w = _pipe()
        self.closed = False
        self.dead = False
        self.pds: list[_PD] = []
        self.cqs: list[_CQ] = []
        self.channels: list[_CompChannel] = []
        with fabric.lock:
            fabric.contexts.append(self)

    def _check(self) -> None:
        if self.closed or self.dead:
            raise PyverbsRDMAError("the context is closed", errno.EBADF)

    def query_device(self) -> types.SimpleNamespace:
        self._check()
        s = self.spec
        return types.SimpleNamespace(
            phys_port_cnt=len(s.ports), max_qp_wr=s.max_qp_wr, max_sge=s.max_sge,
            max_cqe=s.max_cqe, max_mr_size=s.max_mr_size, max_qp=s.max_qp, max_mr=s.max_mr,
            max_qp_rd_atom=16)

    def _port(self, num: int) -> PortSpec:
        self._check()
        if not 1 <= num <= len(self.spec.ports):
            raise PyverbsRDMAError(f"Failed to query port {num}", errno.EINVAL)
        return self.spec.ports[num - 1]

    def query_port(self, num: int) -> types.SimpleNamespace:
        p = self._port(num)
        return types.SimpleNamespace(
            state=p.state, max_mtu=E.IBV_MTU_4096, active_mtu=p.active_mtu,
            gid_tbl_len=max(len(p.gids), 1), lid=p.lid, link_layer=p.link_layer,
            active_speed=p.active_speed, active_width=p.active_width, active_speed_ex=0,
            max_msg_sz=p.max_msg_sz, pkey_tbl_len=_PKEY_TABLE)

    def query_gid(self, num: int, index: int) -> GID:
        p = self._port(num)
        if not 0 <= index < max(len(p.gids), 1):
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {num}")
        gid = GID()
        if index < len(p.gids) and p.gids[index] is not None:
            gid.raw = p.gids[index][0]  # type: ignore[index]
        return gid

    def query_gid_type(self, num: int, index: int) -> int:
        p = self._port(num)
        if index >= len(p.gids) or p.gids[index] is None:
            raise PyverbsRDMAError(f"Failed to query gid type of port {num} and gid index "
                                   f"{index}", errno.ENODATA)
        kind = p.gids[index][1]  # type: ignore[index]
        return E.IBV_GID_TYPE_SYSFS_ROCE_V2 if kind == E.IBV_GID_TYPE_ROCE_V2 else 0

    def event(self, event_type: int, **element: Any) -> None:
        self._events.append(AsyncEvent(event_type, **element))
        try:
            os.write(self._async_w, b"e")
        except OSError:
            pass

    def get_async_event(self) -> AsyncEvent:
        self._check()
        with self.fabric.lock:
            if not self._events:
                raise PyverbsRDMAError("Failed to get async event", errno.EAGAIN)
            try:
                os.read(self.async_fd, 1)
            except BlockingIOError:
                pass
            return self._events.popleft()

    def destroy(self) -> None:
        """Free every resource (closing, or crashing)."""
        if self.closed:
            return
        for pd in list(self.pds):
            pd.close()
        for cq in list(self.cqs):
            cq.close()
        for ch in list(self.channels):
            ch.close()
        self.closed = True
        os.close(self.async_fd)
        os.close(self._async_w)
        if self in self.fabric.contexts:
            self.fabric.contexts.remove(self)

    def close(self) -> None:
        with self.fabric.lock:
            self.destroy()


class _PD:
    def __init__(self, ctx: _Context) -> None:
        ctx._check()
        self.ctx = ctx
        self.fabric = ctx.fabric
        self.mrs: dict[int, _MR] = {}  # lkey -> MR
        self.qps: list[_QP] = []
        ctx.pds.append(self)
        self.closed = False

    def close(self) -> None:
        with self.fabric.lock:
            if self.closed:
                return
            for qp in list(self.qps):
                qp.close()
            for mr in list(self.mrs.values()):
                mr.close()
            self.closed = True
            if self in self.ctx.pds:
                self.ctx.pds.remove(self)

    def find(self, key: int, addr: int, length: int, *, remote: bool) -> _MR | None:
        for mr in self.mrs.values():
            if (mr.rkey if remote else mr.lkey) == key:
                if mr.addr <= addr and addr + length <= mr.addr + mr.length:
                    return mr
                return None
        return None


class _MR:
    def __init__(self, pd: _PD, length: int = 0, access: int = 0, address: int | None = None,
                 **kwargs: Any) -> None:
        if pd.closed:
            raise PyverbsRDMAError("Failed to register a MR: the PD is closed", errno.EINVAL)
        if access & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_ATOMIC) and not (
                access & E.IBV_ACCESS_LOCAL_WRITE):
            raise PyverbsRDMAError("Failed to register a MR: remote write needs local write",
                                   errno.EINVAL)
        if length <= 0 or length > pd.ctx.spec.max_mr_size:
            raise PyverbsRDMAError(f"Failed to register a MR of {length} bytes", errno.EINVAL)
        self._own = None
        if not address:
            self._own = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._own)
        fab = pd.fabric
        if (fab.device_memory is not None and fab.device_memory(address, length)
                and not fab.peermem):
            raise PyverbsRDMAError("Failed to register a MR: GPU memory without a peer "
                                   "memory module", errno.EFAULT)
        self._init(pd, address, length, access, address)

    def _init(self, pd: _PD, addr: int, length: int, access: int, host: int) -> None:
        self.pd = pd
        self.addr = addr  # the I/O virtual address work requests use
        self.host = host  # where that address is in this process
        self.length = length
        self.access = access
        with pd.fabric.lock:
            key = next(pd.fabric._keys)
            self.lkey = key
            self.rkey = key ^ 0x5A5A00  # a different number, as on hardware
            pd.mrs[self.lkey] = self
        self.closed = False

    @property
    def buf(self) -> int:
        return self.addr

    def translate(self, addr: int) -> int:
        """The process address of I/O virtual address ``addr`` of this region."""
        return addr - self.addr + self.host

    def close(self) -> None:
        with self.pd.fabric.lock:
            if not self.closed:
                self.closed = True
                self.pd.mrs.pop(self.lkey, None)


class DmaBufMR(_MR):
    """pyverbs' ``DmaBufMR`` (rdma-core v44 on: ``dmabuf`` may be a descriptor)."""

    def __init__(self, pd: _PD, length: int, access: int, dmabuf: Any = None,
                 offset: int = 0, gpu: int = 0, gtt: int = 0) -> None:
        if dmabuf is None:
            raise PyverbsRDMAError("Failed to allocate a dma-buf: no DRM device in the "
                                   "verbs test double", errno.ENODEV)
        fd = dmabuf.fd if hasattr(dmabuf, "fd") else dmabuf
        if pd.closed:
            raise PyverbsRDMAError("Failed to register a dma-buf MR: the PD is closed",
                                   errno.EINVAL)
        if not pd.ctx.spec.dmabuf:
            raise PyverbsRDMAError("Failed to register a dma-buf MR", errno.EOPNOTSUPP)
        base, size = _dmabuf(int(fd))
        if length <= 0 or offset < 0 or offset + length > size:
            raise PyverbsRDMAError(f"Failed to register a dma-buf MR of {length} bytes at "
                                   f"offset {offset} of a dma-buf of {size}", errno.EINVAL)
        if access & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_ATOMIC) and not (
                access & E.IBV_ACCESS_LOCAL_WRITE):
            raise PyverbsRDMAError("Failed to register a MR: remote write needs local write",
                                   errno.EINVAL)
        self._own = None
        self.offset = offset
        self._init(pd, offset, length, access, base + offset)  # iova = offset


class _ObjectDmaBufMR(DmaBufMR):
    """``DmaBufMR`` of rdma-core v34-v43: ``dmabuf`` must be a pyverbs ``DmaBuf``."""

    def __init__(self, pd: _PD, length: int, access: int, dmabuf: Any = None,
                 offset: int = 0, unit: int = 0, gtt: int = 0) -> None:
        if dmabuf is not None and not hasattr(dmabuf, "fd"):
            raise TypeError("Argument 'dmabuf' has incorrect type (expected "
                            f"pyverbs.dmabuf.DmaBuf, got {type(dmabuf).__name__})")
        super().__init__(pd, length, access, dmabuf, offset)


class _CompChannel:
    """A completion channel: a non-blocking pipe; or, as pyverbs before rdma-core v45
    (``Fabric(legacy_channel=True)``), an eventfd the object does not expose as ``fd``
    (one event per write, read back one at a time: a semaphore eventfd)."""

    def __init__(self, ctx: _Context) -> None:
        ctx._check()
        self.ctx = ctx
        self._legacy = ctx.fabric.legacy_channel
        if self._legacy:
            self._fd = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_SEMAPHORE)
        else:
            self._fd, self._w = _pipe()
        self.closed = False
        ctx.channels.append(self)

    @property
    def fd(self) -> int:
        if self._legacy:
            raise AttributeError("fd")
        return self._fd

    def notify(self) -> None:
        try:
            if self._legacy:
                os.eventfd_write(self._w, 1)
            else:
                os.write(self._w, b"c")
        except OSError:
            pass

    def get_cq_event(self, expected_cq: _CQ) -> None:
        try:
            data = os.read(self._fd, 8 if self._legacy else 1)
        except BlockingIOError:
            raise PyverbsRDMAError("Failed to get CQ event", errno.EAGAIN) from None
        if not data:
            raise PyverbsRDMAError("Failed to get CQ event", errno.EIO)
        expected_cq.num_events += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
            if self._w != self._fd:
                os.close(self._w)
            if self in self.ctx.channels:
                self.ctx.channels.remove(self)


class WC:
    def __init__(self, wr_id: int, status: int, opcode: int, byte_len: int = 0,
                 qp_num: int = 0, imm_data: int = 0, wc_flags: int = 0,
                 vendor_err: int = 0) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.imm_data = imm_data
        self.wc_flags = wc_flags
        self.vendor_err = vendor_err
        self.src_qp = 0


class _CQ:
    def __init__(self, ctx: _Context, cqe: int, cq_context: Any = None,
                 channel: _CompChannel | None = None, comp_vector: int = 0) -> None:
        ctx._check()
        if not 1 <= cqe <= ctx.spec.max_cqe:
            raise PyverbsRDMAError(f"Failed to create a CQ of {cqe} entries", errno.EINVAL)
        self.ctx = ctx
        self.fabric = ctx.fabric
        self.cqe = cqe
        self.channel = channel
        self.entries: deque[tuple[WC, _QP | None, str]] = deque()
        self.armed = False
        self.num_events = 0
        self.broken = False
        self.closed = False
        ctx.cqs.append(self)

    def push(self, wc: WC, qp: _QP | None, queue: str) -> None:
        if self.closed or self.broken:
            return
        if len(self.entries) >= self.cqe:
            self.broken = True  # overflow: the CQ and its queue pairs are unusable
            self.ctx.event(E.IBV_EVENT_CQ_ERR)
            for other in list(self.fabric.qps.values()):
                if other.scq is self or other.rcq is self:
                    other.error(flush=False)
            return
        self.entries.append((wc, qp, queue))
        if self.armed and self.channel is not None:
            self.armed = False
            self.channel.notify()

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        with self.fabric.lock:
            if self.closed:
                raise PyverbsRDMAError("Failed to poll CQ", errno.EINVAL)
            out: list[WC] = []
            while self.entries and len(out) < num_entries:
                wc, qp, queue = self.entries.popleft()
                if qp is not None:
                    qp.polled(queue)
                out.append(wc)
            return len(out), out

    def req_notify(self, solicited_only: bool = False) -> None:
        with self.fabric.lock:
            if self.closed:
                raise PyverbsRDMAError("Request notify CQ failed", errno.EINVAL)
            self.armed = True

    def ack_events(self, num_events: int) -> None:
        self.num_events -= num_events

    def close(self) -> None:
        with self.fabric.lock:
            if not self.closed:
                self.closed = True
                if self in self.ctx.cqs:
                    self.ctx.cqs.remove(self)


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr
        self.max_send_sge = max_send_sge
        self.max_recv_sge = max_recv_sge
        self.max_inline_data = max_inline_data


class QPInitAttr:
    def __init__(self, qp_type: int = E.IBV_QPT_UD, qp_context: Any = None, scq: Any = None,
                 rcq: Any = None, srq: Any = None, cap: QPCap | None = None,
                 sq_sig_all: int = 1) -> None:
        self.qp_type = qp_type
        self.send_cq = scq
        self.recv_cq = rcq
        self.srq = srq
        self.cap = cap if cap is not None else QPCap()
        self.sq_sig_all = sq_sig_all


class GlobalRoute:
    def __init__(self, dgid: GID | None = None, flow_label: int = 0, sgid_index: int = 0,
                 hop_limit: int = 1, traffic_class: int = 0) -> None:
        self.dgid = dgid if dgid is not None else GID()
        self.flow_label = flow_label
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class


class AHAttr:
    def __init__(self, dlid: int = 0, sl: int = 0, src_path_bits: int = 0,
                 static_rate: int = 0, is_global: int = 0, port_num: int = 1,
                 gr: GlobalRoute | None = None) -> None:
        self.dlid = dlid
        self.sl = sl
        self.is_global = is_global
        self.port_num = port_num
        self.gr = gr if gr is not None else GlobalRoute()

    @property
    def dgid(self) -> bytes:
        return self.gr.dgid.raw

    @property
    def sgid_index(self) -> int:
        return self.gr.sgid_index


class QPAttr:
    def __init__(self, qp_state: int = E.IBV_QPS_INIT, cur_qp_state: int = E.IBV_QPS_RESET,
                 port_num: int = 1, path_mtu: int = E.IBV_MTU_1024) -> None:
        self.qp_state = qp_state
        self.cur_qp_state = cur_qp_state
        self.port_num = port_num
        self.path_mtu = path_mtu
        self.qp_access_flags = 0
        self.pkey_index = 0
        self.dest_qp_num = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_dest_rd_atomic = 0
        self.max_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ah_attr = AHAttr()


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey


class RecvWR:
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: list[SGE] | None = None,
                 next_wr: Any = None) -> None:
        self.wr_id = wr_id
        self.sg = list(sg or [])[:num_sge]
        self.num_sge = num_sge


class SendWR:
    def __init__(self, wr_id: int = 0, opcode: int = E.IBV_WR_SEND, num_sge: int = 0,
                 imm_data: int = 0, sg: list[SGE] | None = None,
                 send_flags: int = E.IBV_SEND_SIGNALED, next_wr: Any = None) -> None:
        if num_sge < 1 or sg is None:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.wr_id = wr_id
        self.opcode = opcode
        self.num_sge = num_sge
        self.sg = list(sg)[:num_sge]
        self.imm_data = imm_data
        self.send_flags = send_flags
        self.rkey = 0
        self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = rkey
        self.remote_addr = addr


class _Work:
    """A posted send work request and its progress."""

    __slots__ = ("attempts", "rnr_left", "started", "wr")

    def __init__(self, wr: SendWR) -> None:
        self.wr = wr
        self.attempts = 0
        self.rnr_left: int | None = None
        self.started = False


class _QP:
    def __init__(self, pd: _PD, init_attr: QPInitAttr, qp_attr: Any = None) -> None:
        fabric = pd.fabric
        if pd.closed:
            raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
        if init_attr.qp_type != E.IBV_QPT_RC:
            raise PyverbsRDMAError("the verbs test double has RC queue pairs only",
                                   errno.EOPNOTSUPP)
        cap = init_attr.cap
        limit = pd.ctx.spec.max_qp_wr
        if not (1 <= cap.max_send_wr <= limit and 1 <= cap.max_recv_wr <= limit):
            raise PyverbsRDMAError("Failed to create QP: queue depth", errno.EINVAL)
        if init_attr.send_cq is None or init_attr.recv_cq is None:
            raise PyverbsRDMAError("Failed to create QP: a CQ is missing", errno.EINVAL)
        self.fabric = fabric
        self.pd = pd
        self.device = pd.ctx.name
        self.scq: _CQ = init_attr.send_cq
        self.rcq: _CQ = init_attr.recv_cq
        self.sig_all = bool(init_attr.sq_sig_all)
        self.max_send = cap.max_send_wr
        self.max_recv = cap.max_recv_wr
        self.state = E.IBV_QPS_RESET
        self.port = 0
        self.access = 0
        self.path_mtu = 0
        self.dest_qpn = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.min_rnr_timer = 0
        self.max_rd_atomic = 0
        self.max_dest_rd_atomic = 0
        self.ah = AHAttr()
        self.sq: deque[_Work] = deque()  # posted, not executed
        self.rq: deque[RecvWR] = deque()  # posted receives, not consumed
        self.send_slots = 0  # posted send WRs whose completion is not polled yet
        self.recv_slots = 0
        self.running = False
        self.closed = False
        with fabric.lock:
            self.qpn = next(fabric._qpns) % _U24
            fabric.qps[self.qpn] = self
            pd.qps.append(self)

    @property
    def qp_num(self) -> int:
        return self.qpn

    @property
    def qp_state(self) -> int:
        if self.closed:
            raise PyverbsRDMAError("the QP is destroyed", errno.EINVAL)
        return self.state

    # ------------------------------------------------------------------ modify
    def modify(self, attr: QPAttr, comp_mask: int) -> None:
        with self.fabric.lock:
            self._modify(attr, comp_mask)

    def _modify(self, attr: QPAttr, mask: int) -> None:
        if self.closed:
            raise PyverbsRDMAError("Failed to modify QP: destroyed", errno.EINVAL)
        if not mask & E.IBV_QP_STATE:
            raise PyverbsRDMAError("Failed to modify QP: no state in the mask", errno.EINVAL)
        target = attr.qp_state
        if target == E.IBV_QPS_RESET:
            self._reset()
            return
        if target == E.IBV_QPS_ERR:
            self.error()
            return
        rule = _TRANSITIONS.get((self.state, target))
        if rule is None:
            raise PyverbsRDMAError(f"Failed to modify QP: {self.state} -> {target} is not a "
                                   f"valid transition", errno.EINVAL)
        required, allowed = rule
        bits = mask & ~E.IBV_QP_STATE
        if bits & required != required:
            raise PyverbsRDMAError(f"Failed to modify QP: missing attributes "
                                   f"{required & ~bits:#x}", errno.EINVAL)
        if bits & ~(required | allowed):
            raise PyverbsRDMAError(f"Failed to modify QP: attributes "
                                   f"{bits & ~(required | allowed):#x} not allowed here",
                                   errno.EINVAL)
        spec = self.fabric.devices[self.device]
        if bits & E.IBV_QP_PORT and not 1 <= attr.port_num <= len(spec.ports):
            raise PyverbsRDMAError(f"Failed to modify QP: no port {attr.port_num}", errno.EINVAL)
        if bits & E.IBV_QP_PKEY_INDEX and not 0 <= attr.pkey_index < _PKEY_TABLE:
            raise PyverbsRDMAError("Failed to modify QP: bad P_Key index", errno.EINVAL)
        port_num = attr.port_num if bits & E.IBV_QP_PORT else self.port
        if bits & E.IBV_QP_AV:
            self._check_av(attr.ah_attr, port_num)
        if bits & E.IBV_QP_PATH_MTU:
            port = spec.ports[port_num - 1]
            if attr.path_mtu not in _MTU or attr.path_mtu > port.active_mtu:
                raise PyverbsRDMAError(f"Failed to modify QP: path MTU {attr.path_mtu} above "
                                       f"the port's {port.active_mtu}", errno.EINVAL)
        for name, bit, top in (("dest_qp_num", E.IBV_QP_DEST_QPN, _U24 - 1),
                               ("rq_psn", E.IBV_QP_RQ_PSN, _U24 - 1),
                               ("sq_psn", E.IBV_QP_SQ_PSN, _U24 - 1),
                               ("timeout", E.IBV_QP_TIMEOUT, 31),
                               ("retry_cnt", E.IBV_QP_RETRY_CNT, 7),
                               ("rnr_retry", E.IBV_QP_RNR_RETRY, 7),
                               ("min_rnr_timer", E.IBV_QP_MIN_RNR_TIMER, 31)):
            if bits & bit and not 0 <= getattr(attr, name) <= top:
                raise PyverbsRDMAError(f"Failed to modify QP: {name} out of range",
                                       errno.EINVAL)
        # apply
        if bits & E.IBV_QP_PORT:
            self.port = attr.port_num
        if bits & E.IBV_QP_ACCESS_FLAGS:
            self.access = attr.qp_access_flags
        if bits & E.IBV_QP_AV:
            self.ah = attr.ah_attr
        if bits & E.IBV_QP_PATH_MTU:
            self.path_mtu = attr.path_mtu
        if bits & E.IBV_QP_DEST_QPN:
            self.dest_qpn = attr.dest_qp_num
        if bits & E.IBV_QP_RQ_PSN:
            self.rq_psn = attr.rq_psn
        if bits & E.IBV_QP_SQ_PSN:
            self.sq_psn = attr.sq_psn
        if bits & E.IBV_QP_TIMEOUT:
            self.timeout = attr.timeout
        if bits & E.IBV_QP_RETRY_CNT:
            self.retry_cnt = attr.retry_cnt
        if bits & E.IBV_QP_RNR_RETRY:
            self.rnr_retry = attr.rnr_retry
        if bits & E.IBV_QP_MIN_RNR_TIMER:
            self.min_rnr_timer = attr.min_rnr_timer
        if bits & E.IBV_QP_MAX_QP_RD_ATOMIC:
            self.max_rd_atomic = attr.max_rd_atomic
        if bits & E.IBV_QP_MAX_DEST_RD_ATOMIC:
            self.max_dest_rd_atomic = attr.max_dest_rd_atomic
        self.state = target
        if target == E.IBV_QPS_RTS:
            self._kick()

    def _check_av(self, ah: AHAttr, port_num: int) -> None:
        port = self.fabric.devices[self.device].ports[port_num - 1]
        if ah.port_num != port_num:
            raise PyverbsRDMAError("Failed to modify QP: the address vector names another "
                                   "port", errno.EINVAL)
        if port.link_layer == E.IBV_LINK_LAYER_ETHERNET:
            if not ah.is_global:
                raise PyverbsRDMAError("Failed to modify QP: RoCE needs a GRH (is_global)",
                                       errno.EINVAL)
        elif not ah.is_global and ah.dlid == 0:
            raise PyverbsRDMAError("Failed to modify QP: DLID 0", errno.EINVAL)
        if ah.is_global:
            idx = ah.gr.sgid_index
            if not 0 <= idx < len(port.gids) or port.gids[idx] is None:
                raise PyverbsRDMAError(f"Failed to modify QP: no GID at index {idx}",
                                       errno.EINVAL)

    def _reset(self) -> None:
        # back to RESET: queues emptied without completions, attributes forgotten
        self.sq.clear()
        self.rq.clear()
        self.send_slots = self.recv_slots = 0
        self.state = E.IBV_QPS_RESET

    def error(self, flush: bool = True) -> None:
        """Enter the error state and flush every outstanding work request."""
        if self.closed:
            return
        self.state = E.IBV_QPS_ERR
        if not flush:
            return
        while self.sq:
            work = self.sq.popleft()
            self.scq.push(WC(work.wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, _wc_opcode(work.wr.opcode),
                             qp_num=self.qpn), self, "send")
        while self.rq:
            wr = self.rq.popleft()
            self.rcq.push(WC(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, qp_num=self.qpn),
                          self, "recv")

    def polled(self, queue: str) -> None:
        if queue == "send":
            self.send_slots -= 1
        else:
            self.recv_slots -= 1

    # ------------------------------------------------------------------ posting
    def post_recv(self, wr: RecvWR, bad_wr: Any = None) -> None:
        with self.fabric.lock:
            if self.closed or self.state == E.IBV_QPS_RESET:
                raise PyverbsRDMAError("Failed to post recv", errno.EINVAL)
            if self.recv_slots >= self.max_recv:
                raise PyverbsRDMAError("Failed to post recv", errno.ENOMEM)
            self.recv_slots += 1
            if self.state == E.IBV_QPS_ERR:
                self.rcq.push(WC(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV,
                                 qp_num=self.qpn), self, "recv")
                return
            self.rq.append(wr)

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        with self.fabric.lock:
            if self.closed or self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
                raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
            if wr.opcode not in (E.IBV_WR_SEND, E.IBV_WR_RDMA_WRITE,
                                 E.IBV_WR_RDMA_WRITE_WITH_IMM, E.IBV_WR_RDMA_READ):
                raise PyverbsRDMAError("Failed to post send: opcode not supported by the "
                                       "test double", errno.EINVAL)
            if self.send_slots >= self.max_send:
                raise PyverbsRDMAError("Failed to post send", errno.ENOMEM)
            self.send_slots += 1
            if self.state == E.IBV_QPS_ERR:
                self.scq.push(WC(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, _wc_opcode(wr.opcode),
                                 qp_num=self.qpn), self, "send")
                return
            self.sq.append(_Work(wr))
            self._kick()

    # ------------------------------------------------------------------ execution
    def _kick(self) -> None:
        if self.running or not self.sq or self.state != E.IBV_QPS_RTS:
            return
        if self.fabric.deferred:
            self.running = True
            self.fabric.later(0, self._run_one)
        else:
            self._run()

    def _run_one(self) -> None:
        self.running = False
        if self.closed or self.state != E.IBV_QPS_RTS or not self.sq:
            return
        delay = self._execute(self.sq[0])
        if delay is None:
            self._kick()
        else:
            self.running = True
            self.fabric.later(delay, self._retry)

    def _run(self) -> None:
        while self.sq and self.state == E.IBV_QPS_RTS and not self.running:
            delay = self._execute(self.sq[0])
            if delay is not None:
                self.running = True
                self.fabric.later(delay, self._retry)
                return

    def _retry(self) -> None:
        self.running = False
        if self.fabric.deferred:
            self._kick()
        else:
            self._run()

    def _complete(self, work: _Work, status: int, nbytes: int = 0) -> None:
        self.sq.popleft()
        wr = work.wr
        if status != E.IBV_WC_SUCCESS or self.sig_all or wr.send_flags & E.IBV_SEND_SIGNALED:
            self.scq.push(WC(wr.wr_id, status, _wc_opcode(wr.opcode), byte_len=nbytes,
                             qp_num=self.qpn), self, "send")
        else:
            self.send_slots -= 1  # an unsignalled success frees its slot at once

    def _fail(self, work: _Work, status: int) -> None:
        self._complete(work, status)
        self.error()

    def _execute(self, work: _Work) -> float | None:
        """Run the head work request; returns a delay to retry after, or None when done."""
        wr = work.wr
        sge = wr.sg[0]
        lmr = self.pd.find(sge.lkey, sge.addr, sge.length, remote=False) if sge.length else None
        reads = wr.opcode == E.IBV_WR_RDMA_READ
        if sge.length and (lmr is None or (reads and not lmr.access
                                           & E.IBV_ACCESS_LOCAL_WRITE)):
            self._fail(work, E.IBV_WC_LOC_PROT_ERR)
            return None
        local = lmr.translate(sge.addr) if lmr is not None else 0
        dst, _why = self.fabric.route(self)
        if dst is None:
            return self._no_ack(work)
        packets = max(1, -(-sge.length // _MTU[self.path_mtu]))
        if self.sq_psn != dst.rq_psn:
            return self._no_ack(work)  # the responder drops out-of-sequence packets
        consumes = wr.opcode in (E.IBV_WR_SEND, E.IBV_WR_RDMA_WRITE_WITH_IMM)
        if consumes and not dst.rq:
            return self._rnr(work, dst)
        if reads and (self.max_rd_atomic < 1 or dst.max_dest_rd_atomic < 1):
            self._fail(work, E.IBV_WC_REM_INV_REQ_ERR)  # no read resources negotiated
            dst.error()
            return None
        if wr.opcode != E.IBV_WR_SEND:  # RDMA WRITE or READ: check the remote range
            need = E.IBV_ACCESS_REMOTE_READ if reads else E.IBV_ACCESS_REMOTE_WRITE
            mr = dst.pd.find(wr.rkey, wr.remote_addr, sge.length, remote=True)
            if (sge.length and (mr is None or not mr.access & need)) or (
                    not dst.access & need):
                self._fail(work, E.IBV_WC_REM_ACCESS_ERR)
                dst.error()
                dst.pd.ctx.event(E.IBV_EVENT_QP_ACCESS_ERR, qp_num=dst.qpn)
                return None
            if sge.length:
                assert mr is not None
                if reads:
                    ctypes.memmove(local, mr.translate(wr.remote_addr), sge.length)
                else:
                    ctypes.memmove(mr.translate(wr.remote_addr), local, sge.length)
            self.fabric.stats["read" if reads else "write"] += 1
        recv = dst.rq[0] if consumes else None
        if wr.opcode == E.IBV_WR_SEND:
            assert recv is not None
            rsge = recv.sg[0] if recv.sg else SGE(0, 0, 0)
            if sge.length > rsge.length:
                dst.rq.popleft()
                dst.rcq.push(WC(recv.wr_id, E.IBV_WC_LOC_LEN_ERR, E.IBV_WC_RECV,
                                qp_num=dst.qpn), dst, "recv")
                dst.error()
                self._fail(work, E.IBV_WC_REM_INV_REQ_ERR)
                return None
            if sge.length:
                rmr = dst.pd.find(rsge.lkey, rsge.addr, sge.length, remote=False)
                if rmr is None or not rmr.access & E.IBV_ACCESS_LOCAL_WRITE:
                    dst.rq.popleft()
                    dst.rcq.push(WC(recv.wr_id, E.IBV_WC_LOC_PROT_ERR, E.IBV_WC_RECV,
                                    qp_num=dst.qpn), dst, "recv")
                    dst.error()
                    self._fail(work, E.IBV_WC_REM_OP_ERR)
                    return None
                ctypes.memmove(rmr.translate(rsge.addr), local, sge.length)
            self.fabric.stats["send"] += 1
        self.fabric.stats["bytes"] += sge.length
        self.sq_psn = (self.sq_psn + packets) % _U24
        dst.rq_psn = (dst.rq_psn + packets) % _U24
        if recv is not None:
            dst.rq.popleft()
            if wr.opcode == E.IBV_WR_SEND:
                dst.rcq.push(WC(recv.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_RECV,
                                byte_len=sge.length, qp_num=dst.qpn), dst, "recv")
            else:
                dst.rcq.push(WC(recv.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_RECV_RDMA_WITH_IMM,
                                byte_len=sge.length, qp_num=dst.qpn, imm_data=wr.imm_data,
                                wc_flags=E.IBV_WC_WITH_IMM), dst, "recv")
        self._complete(work, E.IBV_WC_SUCCESS, sge.length)
        return None

    def _no_ack(self, work: _Work) -> float | None:
        """No ACK: retry after the ACK timeout, ``retry_cnt`` times, then fail."""
        self.fabric.stats["timeouts"] += 1
        work.attempts += 1
        if work.attempts > self.retry_cnt:
            self._fail(work, E.IBV_WC_RETRY_EXC_ERR)
            return None
        return 4.096e-6 * 2 ** self.timeout if self.timeout else 3600.0

    def _rnr(self, work: _Work, dst: _QP) -> float | None:
        """Receiver not ready: retry after the responder's RNR timer."""
        self.fabric.stats["rnr_naks"] += 1
        if self.rnr_retry != 7:
            if work.rnr_left is None:
                work.rnr_left = self.rnr_retry
            if work.rnr_left == 0:
                self._fail(work, E.IBV_WC_RNR_RETRY_EXC_ERR)
                return None
            work.rnr_left -= 1
        return _RNR_TIMER[dst.min_rnr_timer]

    # ------------------------------------------------------------------ destroy
    def close(self) -> None:
        with self.fabric.lock:
            if self.closed:
                return
            self.closed = True
            self.sq.clear()
            self.rq.clear()
            self.fabric.qps.pop(self.qpn, None)
            if self in self.pd.qps:
                self.pd.qps.remove(self)


def _wc_opcode(wr_opcode: int) -> int:
    if wr_opcode == E.IBV_WR_RDMA_READ:
        return E.IBV_WC_RDMA_READ
    return E.IBV_WC_SEND if wr_opcode in (E.IBV_WR_SEND, E.IBV_WR_SEND_WITH_IMM) else (
        E.IBV_WC_RDMA_WRITE)
