"""The RDMA transport: RC queue pairs, registered memory, completions on the event loop.

Set-up (control path)
    A connection starts as an authenticated TCP connection of the socket transport (the
    job-key proofs of :mod:`acoll._auth`, the hello bound into them). Over it both ends
    exchange their :class:`~.qp.QpInfo` (msgpack) and walk their queue pairs INIT -> RTR
    -> RTS (:mod:`.qp`); each then reports RTS, and neither posts a send before the other
    did. The TCP connection stays open, idle, as a liveness line: a peer that dies or
    aborts drops it at once (RDMA alone would notice only when a send times out), and an
    orderly close ends it with the close notice.

Data path
    Each end keeps ``ACOLL_IB_QUEUE_DEPTH`` receives posted into registered slots of
    ``ACOLL_IB_EAGER`` bytes plus a 72-byte header. Messages up to that size travel as one
    SEND (copied into a registered send slot, so their send completes at once; the
    receiver copies the payload into the posted buffer, or keeps it until the receive is
    posted). Larger messages use the receiver-driven rendezvous of :mod:`.flow` (NCCL's
    "CTS fifo"): ``RTS``; once the receive is posted, ``CTS`` with the buffer's address and
    rkey (the buffer registered through the :mod:`.regcache` cache); the sender writes it
    with RDMA WRITE in ``ACOLL_IB_CHUNK`` pieces, the last one with immediate data naming
    the receive, whose completion finishes the receive. Every SEND and write with
    immediate spends a receive credit (:class:`~.flow.Credits`), so no receive is ever
    missing (no RNR waits). Frames are described in :mod:`.wire`.

Completions
    Each connection has its own completion queue and completion channel. The channel's
    descriptor is watched with ``loop.add_reader``; when it is readable the events are
    read and acknowledged, the queue is re-armed, then drained (so a completion that
    arrived between the drain and the arm still wakes us). Draining is bounded per loop
    step. :meth:`RdmaConnection.poll` drains without waiting (the communicator's bounded
    busy-poll for small messages). Nothing ever blocks the loop.

Failures
    A work completion with an error status, an asynchronous event that concerns the
    queue pair (or its port or device), a protocol violation, or the loss of the control
    connection ends the connection: the queue pair is moved to the error state (so no
    write lands in a buffer whose receive is then failed), and every pending operation
    fails with :class:`~.base.ConnectionLost`, as for TCP.

Orderly close
    Queued sends are flushed; a rendezvous message still waiting for its CTS is sent as
    ``DATA`` parts instead (so it is delivered, as the contract wants, even if the receive
    is posted only after the close); then ``CLOSE`` frames with the notice. The peer,
    on them, fails what it has pending (orderly), releases its end and closes the
    control connection, which releases this end; a peer closing at the same time sends
    its own ``CLOSE`` (this end keeps returning credits until then, so the peer's flush
    can finish), and each end is released once its ``CLOSE`` was acknowledged and the
    other's arrived. A close that makes no progress for 5 s ends there. A receive whose
    buffer was advertised keeps its buffer registered, and fails, only when its data has
    landed or the queue pair is gone.

Memory
    Host memory, registered through the :mod:`.regcache` cache. GPU memory moves directly
    (GPUDirect RDMA) when :mod:`.gdr` says the stack and the PCI topology allow it for the
    communicator's GPU (:meth:`RdmaTransport.memory_for`, decided once per GPU and logged
    at INFO); otherwise the communicator stages device buffers through pinned host memory
    (:mod:`acoll._transport.staged`), as over TCP. Device regions cover the whole
    allocation (``cuMemGetAddressRange``, whole pages), registered through dma-buf
    (``cuMemGetHandleForAddressRange``, then ``DmaBufMR``; the descriptor is closed once
    registered) or, with a peer-memory module, as an ordinary region of the device
    pointer; a separate cache per GPU keys them by address range.

    A device send is always a rendezvous (there is no host copy to send eagerly): its RTS
    leaves at once, its writes only once the GPU work queued before the send has finished
    (a fence of the space's stream, :meth:`~acoll._memory.MemorySpace.fence`). A device
    receive advertises its buffer (CTS) only once the GPU work queued before it has
    finished, so the NIC never races a kernel still using the buffer; when the write with
    immediate data lands, the receive completes at once, or, where the GPU needs it (see
    :mod:`.gdr`), after a flush: an RDMA READ of one byte of the buffer on a loop-back
    queue pair, which the PCIe ordering rules complete only after the NIC's writes to the
    GPU did. The rare messages that arrive as bytes (eager frames of a host sender, parts
    pushed at close, early storage) are uploaded to the device through the space's
    staging copies, in stream order; a device send pushed at close is downloaded first.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ..._config import Setting, get_logger, parse_size
from ..._deadline import wait_until
from ..._dtypes import empty_bytes
from ..._memory import Buffer, Fence, MemoryKind, Staging, host_buffer
from ...errors import AcollError, ClosedError, ProtocolError, TransportError
from ..base import (
    META_SIZE,
    Capability,
    ConnectionLost,
    MessageSizeError,
    PeerInfo,
    QueuedListener,
    Transport,
)
from ..copyout import PacedCopies
from ..lifecycle import LoopConnection
from ..matching import Matcher, Message
from ..tcp import MAX_EARLY, TcpConnection, TcpListener, TcpTransport
from . import gdr, wire
from .discovery import GidEntry, PortInfo, usable_ports
from .failures import Scope, completion_failure, event_scope, is_flush
from .flow import Credits, RecvTable, SendState, SendTable
from .qp import (
    Handshake,
    QpInfo,
    QpSettings,
    init_transition,
    rtr_transition,
    rts_transition,
)
from .regcache import Entry, RegCache
from .spec import (
    QPS_ERR,
    WC_RECV,
    WC_RECV_RDMA_WITH_IMM,
    WC_SUCCESS,
    mtu_enum,
)
from .verbs import READ, SEND, WRITE, WRITE_IMM, Device, Endpoint, Region, get_lib, list_ports

__all__ = ["RdmaConnection", "RdmaListener", "RdmaTransport", "make_rdma", "rdma_ports"]

log = get_logger("NET")

GID_INDEX = Setting("IB_GID_INDEX", int, -1,
                    "GID table index for RoCE (-1: automatic, a RoCE v2 IPv4-mapped GID "
                    "first).", "NET", lo=-1)
TIMEOUT = Setting("IB_TIMEOUT", int, 18,
                  "RDMA ACK timeout exponent: 4.096 us * 2**value before a retry (1-31).",
                  "NET", lo=1, hi=31)
RETRY_CNT = Setting("IB_RETRY_CNT", int, 7,
                    "RDMA retransmissions without an ACK before a send fails (0-7).", "NET",
                    lo=0, hi=7)
SL = Setting("IB_SL", int, 0, "InfiniBand service level of the queue pairs (0-15).", "NET",
             lo=0, hi=15)
TC = Setting("IB_TC", int, 0, "RoCE traffic class of the queue pairs (0-255).", "NET",
             lo=0, hi=255)
MTU = Setting("IB_MTU", parse_size, 0,
              "Largest RDMA path MTU in bytes (256-4096; 0: the ports' active MTU).", "NET")
EAGER = Setting("IB_EAGER", parse_size, 16 << 10,
                "RDMA messages up to this size go as one SEND through registered slots; "
                "larger ones are written into the receive buffer (rendezvous).", "NET")
QUEUE_DEPTH = Setting("IB_QUEUE_DEPTH", int, 64,
                      "Receives (and send slots) per RDMA connection; the flow-control "
                      "window of small messages.", "NET", lo=1)
CHUNK = Setting("IB_CHUNK", parse_size, 1 << 20,
                "RDMA writes of a large message are cut into pieces of this size.", "NET")
REG_CACHE = Setting("IB_REG_CACHE", int, 256,
                    "Memory regions the RDMA registration cache keeps at most.", "NET", lo=0)

_VERSION = 1
_INFO_TAG, _READY_TAG = 1, 2
_INFO_SIZE = 256  # QP info record, length-prefixed and padded
_WRITE_DEPTH = 32  # send queue entries for RDMA writes beyond the send slots
_POLL_BATCH = 16
_IO_NS = 200_000  # a drain or poll starts no new batch after this (ns)
_LINGER = 5.0
_MAX_NOTICE = (1 << 16) - 64  # as over TCP
_TCP_GRACE = 0.5  # seconds to wait for the RDMA CLOSE after the control line closed
_RECV_BIT = 1 << 62
_FRAME_BIT = 1 << 61
_WRITE_BIT = 1 << 60
_LOW = (1 << 32) - 1
_EMPTY = memoryview(bytearray())
_FLUSH_DEPTH = 64  # outstanding flush reads on the loop-back queue pair
_PAGE = mmap.PAGESIZE


def _storage(nbytes: int) -> memoryview:
    return empty_bytes(nbytes).data


# ---------------------------------------------------------------------------- settings
def _settings(mtu_cap: int | None = None) -> QpSettings:
    mtu_bytes_cap = MTU.resolve(mtu_cap)
    try:
        mtu = mtu_enum(mtu_bytes_cap) if mtu_bytes_cap else 0
        return QpSettings(timeout=TIMEOUT.resolve(), retry_cnt=RETRY_CNT.resolve(),
                          sl=SL.resolve(), traffic_class=TC.resolve(), mtu=mtu)
    except ValueError as exc:
        from ...errors import InvalidUsage

        raise InvalidUsage(f"RDMA settings: {exc}") from exc


# ---------------------------------------------------------------------------- transport
def rdma_ports(hca: str = "", lib: Any = None) -> tuple[list[tuple[PortInfo, GidEntry | None]],
                                                        str]:
    """The usable ports (with their GIDs) and why none if empty; never raises for a
    missing stack (pyverbs not installed, no device)."""
    if lib is None:
        try:
            lib = get_lib()
        except ImportError as exc:
            return [], f"pyverbs cannot be imported ({exc})"
    ports, why = list_ports(lib)
    if not ports:
        return [], why
    try:
        return usable_ports(ports, hca, GID_INDEX.resolve())
    except ValueError as exc:
        return [], str(exc)


def make_rdma(sockaddr: tuple[Any, ...], family: socket.AddressFamily, *, timeout: float,
              key: bytes, hca: str = "") -> tuple[RdmaTransport | None, str]:
    """The RDMA transport on the first usable port, or ``None`` and why not (for
    :func:`~acoll._transport.select.select_transport`). Logs the ports at INFO."""
    try:
        lib = get_lib()
    except ImportError as exc:
        return None, f"pyverbs cannot be imported ({exc})"
    found, why = rdma_ports(hca, lib)
    if not found:
        return None, why
    for port, gid in found:
        log.info("NET/IB: %s", port.describe(gid))
    port, gid = found[0]
    try:
        transport = RdmaTransport(sockaddr, family, key=key, timeout=timeout, port=port,
                                  gid=gid, lib=lib)
    except TransportError as exc:
        return None, str(exc)
    return transport, ""


class RdmaTransport(Transport):
    """RC queue pairs over one RDMA port (NCCL's ``IB`` net). See the module doc.

    Args:
        sockaddr, family: where the control listener binds (as for TCP).
        key: the job's authentication key.
        port, gid: the port to use and its GID (:func:`rdma_ports`).
        lib: the verbs lib (default: :func:`~.verbs.get_lib`).
        eager, depth, chunk, reg_cache: override ``ACOLL_IB_EAGER``, ``_QUEUE_DEPTH``,
            ``_CHUNK``, ``_REG_CACHE``.
        settings: queue-pair settings (default: from the ``ACOLL_IB_*`` settings).
    """

    name = "ib"
    capabilities = Capability.REGISTRATION

    def __init__(self, sockaddr: tuple[Any, ...], family: socket.AddressFamily, *,
                 key: bytes, port: PortInfo, gid: GidEntry | None, timeout: float = 30.0,
                 lib: Any = None, eager: int | None = None, depth: int | None = None,
                 chunk: int | None = None, reg_cache: int | None = None,
                 settings: QpSettings | None = None) -> None:
        self.key = key
        self.timeout = timeout
        self.port = port
        self.gid = gid
        self.settings = settings if settings is not None else _settings()
        self.eager = max(EAGER.resolve(eager), 0)
        self.depth = QUEUE_DEPTH.resolve(depth)
        if self.depth < 4:
            raise TransportError(f"ACOLL_IB_QUEUE_DEPTH={self.depth}: at least 4")
        self.chunk = max(CHUNK.resolve(chunk), 4096)
        self.slot = -(-(wire.HEADER.size + self.eager) // 64) * 64
        # (the control channel: one socket for both directions, never split)
        self._tcp = TcpTransport(sockaddr, family, key=key, nsocks=1, timeout=timeout,
                                 split=0)
        self.lib = lib if lib is not None else get_lib()
        self.device = Device(self.lib, port.device)
        self._max_regs = REG_CACHE.resolve(reg_cache)
        self.cache: RegCache[Region] = RegCache(self._register, self._deregister,
                                                max_entries=self._max_regs)
        # device memory: one cache per GPU (ordinal), and what GPUDirect can do there
        self.device_caches: dict[int, RegCache[Region]] = {}
        self._gdr: dict[int, gdr.GdrChoice] = {}
        self._dmabuf_probe: tuple[bool, str] | None = None
        self._flusher: _Flusher | None = None
        self.conns: dict[int, RdmaConnection] = {}  # by queue pair number
        self._closed = False
        self._events_fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        log.info("NET/IB: using %s (eager %d bytes, queue depth %d, chunk %d, %s)",
                 port.name, self.eager, self.depth, self.chunk,
                 f"timeout {self.settings.timeout}, retry_cnt {self.settings.retry_cnt}")

    # ------------------------------------------------------------------ memory
    def _register(self, addr: int, length: int, writable: bool) -> Region:
        return self.device.register(addr, length, writable)

    def _deregister(self, mr: Any) -> None:
        try:
            self.device.deregister(mr)
        except Exception as exc:  # never from a finalizer or a loop callback
            log.warning("NET/IB: deregistering memory failed: %s", exc)

    def acquire(self, buf: Buffer, writable: bool) -> Entry[Region]:
        """A registration covering ``buf`` (give it back with :meth:`release`).

        Raises:
            TransportError: registration failed (:class:`~.gdr.GdrError` for device
                memory: a CUDA driver call, or GPUDirect is off for its GPU).
        """
        if buf.kind is MemoryKind.HOST:
            addr, owner, extent = _extent(buf)
            return self.cache.acquire(addr, buf.nbytes, writable, owner, extent)
        self.check_device(buf)
        ordinal = self._device_of(buf)
        choice = self.gdr_choice(ordinal)
        cache = self.device_caches.get(ordinal)
        if cache is None:
            cache = self.device_caches[ordinal] = RegCache(
                lambda a, n, _w: self._register_device(a, n, ordinal, choice.mode),
                self._deregister, max_entries=self._max_regs)
        base, size = gdr.get_driver().address_range(buf.ptr, ordinal)
        extent = gdr.dmabuf_range(base, size, _PAGE)
        try:
            return cache.acquire(buf.ptr, buf.nbytes, True, _owner(buf.array), extent)
        except ValueError as exc:  # the driver's range does not hold the buffer
            raise gdr.GdrError(f"cuMemGetAddressRange gave {base:#x}+{size} for a buffer "
                               f"at {buf.ptr:#x}+{buf.nbytes}: {exc}") from exc

    def release(self, entry: Entry[Region]) -> None:
        """Give back an entry of :meth:`acquire`."""
        region = entry.region
        ordinal = None if region is None else region.device
        cache = self.cache if ordinal is None else self.device_caches[ordinal]
        cache.release(entry)

    def _register_device(self, addr: int, length: int, ordinal: int,
                         mode: gdr.GdrMode | None) -> Region:
        if mode is gdr.GdrMode.PEERMEM:
            return self.device.register_device(addr, length, ordinal)
        fd = gdr.get_driver().dmabuf_fd(addr, length, ordinal)
        try:
            return self.device.register_dmabuf(fd, 0, length, addr, ordinal)
        finally:
            os.close(fd)  # the region holds the dma-buf now

    @staticmethod
    def _device_of(buf: Buffer) -> int:
        ordinal = buf.space.device
        if ordinal is None:
            raise TransportError(f"{buf.space} has {buf.kind.value} memory but no device")
        return ordinal

    def register(self, buf: Buffer) -> object | None:
        writable = buf.kind is not MemoryKind.HOST or not buf.view().readonly
        return (buf, self.acquire(buf, writable))

    def deregister(self, handle: object | None) -> None:
        if handle is None:
            return
        assert isinstance(handle, tuple)
        entry: Entry[Region] = handle[1]
        self.release(entry)

    # ------------------------------------------------------------------ GPUDirect RDMA
    def memory_for(self, staging: Staging | None) -> frozenset[MemoryKind]:
        """Host memory, and the device's memory when GPUDirect RDMA is usable for it."""
        if (staging is None or staging.device is None
                or staging.kind is not MemoryKind.CUDA):
            return self.memory
        if self.gdr_choice(staging.device).enabled:
            return self.memory | {staging.kind}
        return self.memory

    def gdr_choice(self, ordinal: int) -> gdr.GdrChoice:
        """What GPUDirect RDMA can do between GPU ``ordinal`` and this transport's NIC
        (decided once, logged at INFO; see :mod:`.gdr`)."""
        choice = self._gdr.get(ordinal)
        if choice is None:
            choice = self._gdr[ordinal] = self._decide(ordinal)
            log.info("NET/IB: %s", choice.why)
        return choice

    def _decide(self, ordinal: int) -> gdr.GdrChoice:
        nic = self.port.device
        try:
            driver = gdr.get_driver()
            bus = driver.pci_bus_id(ordinal)
            cc_major = driver.attribute(gdr.ATTR_CC_MAJOR, ordinal)
        except gdr.GdrError as exc:
            return gdr.GdrChoice(None, f"GPUDirect RDMA cuda:{ordinal} <-> {nic}: off "
                                       f"({exc}); staging through host memory")
        try:
            gpu_dmabuf = bool(driver.attribute(gdr.ATTR_DMA_BUF_SUPPORTED, ordinal))
        except gdr.GdrError:  # a driver older than the attribute
            gpu_dmabuf = False
        try:
            gpath, gnuma = gdr.gpu_pci_path(bus)
            npath, nnuma = gdr.nic_pci_path(nic)
            distance: gdr.Distance | None = gdr.pci_distance(gpath, npath, gnuma, nnuma)
        except ValueError:
            distance = None
        if self._dmabuf_probe is None:
            self._dmabuf_probe = self.device.probe_dmabuf()
        flush = gdr.flush_needed(cc_major, disabled=gdr.FLUSH_DISABLE.resolve(),
                                 forced=gdr.FORCE_FLUSH.resolve())
        return gdr.decide(gpu=f"cuda:{ordinal} ({bus})", nic=nic, distance=distance,
                          level=gdr.GDR_LEVEL.resolve(), nic_dmabuf=self._dmabuf_probe,
                          gpu_dmabuf=gpu_dmabuf, dmabuf_enable=gdr.DMABUF_ENABLE.resolve(),
                          peermem=gdr.peermem_loaded(), flush=flush)

    def check_device(self, buf: Buffer) -> None:
        """Raise :class:`~.gdr.GdrError` unless GPUDirect RDMA moves ``buf``'s memory."""
        choice = self.gdr_choice(self._device_of(buf))
        if not choice.enabled:
            raise gdr.GdrError(f"a {buf.kind.value} buffer reached the RDMA transport, but "
                               f"{choice.why}")

    def flusher(self) -> _Flusher:
        """The loop-back queue pair that flushes GPUDirect receives (made on first use).

        Raises:
            TransportError: it could not be made (a verbs call failed).
        """
        if self._flusher is None:
            self._flusher = _Flusher(self)
        return self._flusher

    # ------------------------------------------------------------------ pairs
    def can_connect(self, mine: PeerInfo, theirs: PeerInfo) -> bool:
        """Both ends must sit on the same link layer (InfiniBand or RoCE)."""
        a, b = _parse_handle(mine.handles.get(self.name)), _parse_handle(
            theirs.handles.get(self.name))
        return a is not None and b is not None and a[1] == b[1]

    def _handle(self, tcp_handle: bytes) -> bytes:
        return msgpack.packb([_VERSION, self.port.link_layer, tcp_handle])

    async def listen(self) -> RdmaListener:
        if self._closed:
            raise ClosedError("the RDMA transport is closed")
        self._watch_events()
        tcp = await self._tcp.listen()
        return RdmaListener(self, tcp, self._handle(tcp.handle))

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> RdmaConnection:
        if self._closed:
            raise ClosedError("the RDMA transport is closed")
        parsed = _parse_handle(handle)
        if parsed is None:
            raise ProtocolError("bad RDMA handle")
        _version, layer, tcp_handle = parsed
        if layer != self.port.link_layer:
            raise TransportError("the peer's RDMA port has another link layer")
        self._watch_events()
        tcp = await self._tcp.connect(tcp_handle, hello, deadline)
        try:
            return await self.establish(tcp, deadline)
        except BaseException:
            tcp.abort()
            raise

    async def establish(self, tcp: TcpConnection, deadline: float) -> RdmaConnection:
        """Make the queue pair and run the set-up exchange over ``tcp`` (module doc).

        Raises:
            ProtocolError: the peer's record is malformed or out of order.
            TransportError: a verbs call failed, or the control connection broke.
            acoll.TimeoutError: ``deadline`` passed.
        """
        port = self.port
        ep = self.device.endpoint(self.depth + _WRITE_DEPTH, self.depth)
        conn: RdmaConnection | None = None
        try:
            ep.modify(init_transition(port.port, self.settings))
            conn = RdmaConnection(self, ep, tcp, tcp.peer)
            gid = self.gid.gid if self.gid is not None else bytes(16)
            local = QpInfo(qpn=ep.qpn, psn=random.getrandbits(24), lid=port.lid, gid=gid,
                           mtu=port.active_mtu, link_layer=port.link_layer)
            hs = Handshake()
            record = msgpack.packb({"qp": hs.created(local), "eager": self.eager,
                                    "depth": self.depth})
            await wait_until(tcp.send(host_buffer(_pad(record)), _INFO_TAG), deadline,
                             f"sending QP info to {tcp.peer}")
            hs.sent()
            raw = bytearray(_INFO_SIZE)
            await wait_until(tcp.recv(host_buffer(raw), _INFO_TAG), deadline,
                             f"QP info from {tcp.peer}")
            qp_record, peer_eager, peer_depth = _parse_setup(_unpad(raw))
            remote = hs.got(qp_record)
            gid_index = self.gid.index if self.gid is not None else 0
            ep.modify(rtr_transition(local, remote, port.port, gid_index, self.settings))
            ep.modify(rts_transition(local, self.settings))
            hs.rts()
            ready = bytearray(1)
            await wait_until(tcp.send(host_buffer(b"R"), _READY_TAG), deadline,
                             f"sending RTS to {tcp.peer}")
            await wait_until(tcp.recv(host_buffer(ready), _READY_TAG), deadline,
                             f"RTS from {tcp.peer}")
            if ready != b"R":
                raise ProtocolError("bad ready message from the peer")
            hs.ready()
        except BaseException as exc:
            if conn is not None:
                conn.discard()
            else:
                ep.close()
            if isinstance(exc, ConnectionLost):
                raise TransportError(f"RDMA set-up with {tcp.peer}: control connection "
                                     f"lost: {exc}") from exc
            raise
        conn.start(remote, peer_eager, peer_depth)
        return conn

    # ------------------------------------------------------------------ async events
    def _watch_events(self) -> None:
        fd = self.device.async_fd
        if self._events_fd is not None or fd is None:
            if fd is None and self._loop is None:
                log.info("NET/IB: asynchronous events of %s are not watched (descriptor "
                         "not found)", self.port.device)
                self._loop = asyncio.get_running_loop()
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._on_async_event)
        self._events_fd = fd

    def _on_async_event(self) -> None:
        try:
            events = self.device.read_async_events()
        except Exception as exc:
            log.warning("NET/IB: reading asynchronous events failed: %s", exc)
            self._stop_events()
            return
        for event_type, qpn, port in events:
            try:
                self.handle_event(event_type, qpn, port)
            except Exception:
                log.exception("NET/IB: handling an asynchronous event raised")

    def handle_event(self, event_type: int, qpn: int | None, port: int | None) -> None:
        """Act on one asynchronous event (see :func:`~.failures.event_scope`)."""
        scope, name = event_scope(event_type)
        if scope is Scope.NONE:
            log.info("NET/IB: %s event %s", self.port.device, name)
            return
        log.warning("NET/IB: %s event %s (ends %s)", self.port.device, name, scope.value)
        if scope is Scope.PORT and port is not None and port != self.port.port:
            return
        if scope is Scope.QP:
            if qpn is not None:
                victims = [c for c in (self.conns.get(qpn),) if c is not None]
            else:  # pyverbs does not say which: every queue pair now in the error state
                victims = [c for c in self.conns.values() if c.in_error()]
        else:
            victims = list(self.conns.values())
        for conn in victims:
            conn.fail(f"asynchronous event {name} on {self.port.device}")

    def _stop_events(self) -> None:
        if self._events_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._events_fd)
        self._events_fd = None

    # ------------------------------------------------------------------ end
    def forget(self, conn: RdmaConnection) -> None:
        self.conns.pop(conn.qpn, None)
        if self._closed and not self.conns:
            self._close_device()

    def close(self) -> None:
        """Release the registration cache and, once its connections are gone, the device."""
        if self._closed:
            return
        self._closed = True
        if not self.conns:
            self._close_device()

    def _close_device(self) -> None:
        self._stop_events()
        if self._flusher is not None:
            self._flusher.close()
        busy = self.cache.close()
        for cache in self.device_caches.values():
            busy += cache.close()
        if busy:
            log.info("NET/IB: %d registrations still in use at close", len(busy))
        self.device.close()


def _parse_handle(handle: bytes | None) -> tuple[int, int, bytes] | None:
    if handle is None:
        return None
    try:
        version, layer, tcp_handle = msgpack.unpackb(handle)
    except Exception:
        return None
    if version != _VERSION or not isinstance(layer, int) or not isinstance(tcp_handle, bytes):
        return None
    return version, layer, tcp_handle


def _pad(record: bytes) -> bytes:
    if len(record) > _INFO_SIZE - 2:
        raise ProtocolError("QP info record too large")
    return struct.pack("<H", len(record)) + record + bytes(_INFO_SIZE - 2 - len(record))


def _parse_setup(body: bytes) -> tuple[bytes, int, int]:
    """The peer's set-up record: its QP info, eager size and receive depth."""
    try:
        rec = msgpack.unpackb(body)
        qp, eager, depth = rec["qp"], rec["eager"], rec["depth"]
    except Exception as exc:
        raise ProtocolError(f"bad RDMA set-up record: {exc}") from exc
    if not (isinstance(qp, bytes) and type(eager) is int and type(depth) is int
            and 0 <= eager <= 1 << 30 and 4 <= depth <= 1 << 16):
        raise ProtocolError("bad RDMA set-up record: fields out of range")
    return qp, eager, depth


def _unpad(raw: bytearray) -> bytes:
    (n,) = struct.unpack_from("<H", raw)
    if n > _INFO_SIZE - 2:
        raise ProtocolError("bad QP info frame")
    return bytes(raw[2:2 + n])


_ZERO = np.zeros(1, np.uint8)


def _staging(buf: Buffer) -> Staging:
    staging = buf.space.staging()
    if staging is None:
        raise TransportError(f"{buf.space} has no staging copies")
    return staging


def _owner(arr: Any) -> object:
    """The object whose lifetime is that of ``arr``'s memory: a NumPy array's root, a
    device view's owner (the first of a DLPack pair)."""
    owner = getattr(arr, "owner", None)
    if owner is not None:
        return owner[0] if isinstance(owner, tuple) else owner
    while isinstance(getattr(arr, "base", None), np.ndarray):
        arr = arr.base
    return arr


def _extent(buf: Buffer) -> tuple[int, object, tuple[int, int] | None]:
    """``buf``'s address, the object owning its memory and that memory's range: for a
    view of a NumPy array that owns its data, the whole array (so later slices of it hit
    the cache); otherwise the buffer itself."""
    addr = buf.ptr
    arr = buf.array
    root = arr
    while isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base
    if isinstance(root, np.ndarray) and (root.flags.c_contiguous or root.flags.f_contiguous):
        start = int(root.__array_interface__["data"][0])
        size = int(root.nbytes)
        if size and start <= addr and addr + buf.nbytes <= start + size:
            return addr, root, (start, size)
    return addr, arr, None


# ---------------------------------------------------------------------------- flushes
class _Flusher:
    """A queue pair connected to itself that reads one byte of a GPUDirect receive's
    buffer (NCCL's ``gpuFlush``): the read completes only after the NIC's earlier writes
    to that GPU memory did. ``flush(region, ptr, done)`` calls ``done(None)`` then, or
    ``done(error)`` when the queue pair failed (which ends every flush, now and later).
    """

    def __init__(self, t: RdmaTransport) -> None:
        self._loop = asyncio.get_running_loop()
        self._device = t.port.device
        port = t.port
        self._ep = t.device.endpoint(_FLUSH_DEPTH, 1)
        self._mr: Region | None = None
        try:
            settings = t.settings
            self._ep.modify(init_transition(port.port, settings, remote_read=True))
            me = QpInfo(qpn=self._ep.qpn, psn=random.getrandbits(24), lid=port.lid,
                        gid=t.gid.gid if t.gid is not None else bytes(16),
                        mtu=port.active_mtu, link_layer=port.link_layer)
            gid_index = t.gid.index if t.gid is not None else 0
            self._ep.modify(rtr_transition(me, me, port.port, gid_index, settings))
            self._ep.modify(rts_transition(me, settings))
            self._sink = empty_bytes(64)
            self._base = int(self._sink.__array_interface__["data"][0])
            self._mr = t.device.register(self._base, 64, True)
        except BaseException:
            self._ep.close()
            raise
        self._t = t
        self._pending: dict[int, Callable[[BaseException | None], None]] = {}
        self._queue: deque[tuple[int, int, Callable[[BaseException | None], None]]] = deque()
        self._next = 0
        self._broken: BaseException | None = None
        self.flushes = 0
        self._loop.add_reader(self._ep.fd, self._on_channel)

    def flush(self, region: Region, ptr: int, done: Callable[[BaseException | None], None]
              ) -> None:
        if self._broken is not None:
            self._loop.call_soon(done, self._broken)
            return
        self._queue.append((region.translate(ptr), region.rkey, done))
        self._post()

    def _post(self) -> None:
        assert self._mr is not None
        try:
            while self._queue and len(self._pending) < _FLUSH_DEPTH:
                remote, rkey, done = self._queue.popleft()
                wr_id = self._next
                self._next += 1
                self._pending[wr_id] = done
                self.flushes += 1
                self._ep.post_send(wr_id, READ, self._base, 1, self._mr.lkey, rkey=rkey,
                                   remote=remote)
        except TransportError as exc:
            self._fail(exc)

    def _on_channel(self) -> None:
        try:
            self._ep.take_events()
            self._ep.arm()
            while True:
                batch = self._ep.poll(_POLL_BATCH)
                for c in batch:
                    if c.status != WC_SUCCESS:  # fails it and every other one
                        self._fail(TransportError(completion_failure(
                            c.status, "flushing a GPUDirect receive on", self._device,
                            c.vendor_err)))
                        return
                    done = self._pending.pop(c.wr_id, None)
                    if done is not None:
                        done(None)
                if len(batch) < _POLL_BATCH:
                    break
        except TransportError as exc:
            self._fail(exc)
            return
        self._post()

    def _fail(self, exc: BaseException, *, warn: bool = True) -> None:
        if self._broken is not None:
            return
        self._broken = exc
        if warn:
            log.warning("NET/IB: the GPUDirect flush queue pair on %s failed: %s",
                        self._device, exc)
        waiting = [*self._pending.values(), *(done for _r, _k, done in self._queue)]
        self._pending.clear()
        self._queue.clear()
        self._stop()
        for done in waiting:
            done(exc)

    def _stop(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._ep.fd)
        self._ep.to_error()
        self._ep.close()
        if self._mr is not None:
            self._t._deregister(self._mr)
            self._mr = None

    def close(self) -> None:
        self._fail(ClosedError("the RDMA transport is closed"), warn=False)


# ---------------------------------------------------------------------------- listener
class RdmaListener(QueuedListener):
    """Accepts authenticated control connections and sets up their queue pairs."""

    def __init__(self, transport: RdmaTransport, tcp: TcpListener, handle: bytes) -> None:
        super().__init__()
        self._transport = transport
        self._tcp = tcp
        self.handle = handle
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._acceptor = self._loop.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        while True:
            try:
                hello, conn = await self._tcp.accept()
            except ClosedError:
                return
            assert isinstance(conn, TcpConnection)
            task = self._loop.create_task(self._setup(hello, conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _setup(self, hello: bytes, tcp: TcpConnection) -> None:
        deadline = self._loop.time() + self._transport.timeout
        try:
            conn = await self._transport.establish(tcp, deadline)
        except (AcollError, OSError) as exc:
            log.warning("NET/IB: refused an RDMA connection from %s: %s", tcp.peer, exc)
            tcp.abort()
            return
        except BaseException:
            tcp.abort()
            raise
        if self._closed:
            conn.abort()
            return
        self._offer(hello, conn)

    def close(self, notice: bytes = b"") -> None:
        if self._closed:
            return
        self._closed = True
        self._acceptor.cancel()
        for task in self._tasks:
            task.cancel()
        self._tcp.close()
        self._close_queue(notice)


# ---------------------------------------------------------------------------- connection
_Recv = Message["_RecvOp", "_Incoming"]


class _RecvOp:
    """A posted receive: its future and buffer; for device memory also the fence of the
    GPU work queued before it (its CTS waits for it) and a host bounce block for a
    message that may arrive as one eager frame."""

    __slots__ = ("block", "buf", "device", "fence", "fut", "host")

    def __init__(self, fut: asyncio.Future[bytes], buf: Buffer) -> None:
        self.fut = fut
        self.buf = buf
        self.device = buf.kind is not MemoryKind.HOST
        self.fence: Fence | None = None
        self.host: Buffer | None = None
        self.block: Buffer | None = None


class _Incoming:
    """A rendezvous message of the peer (announced by RTS) as this end knows it.

    States: ``held`` (no receive yet, kept by the matcher), ``matched`` (CTS sent, the
    receive waits for its writes or pushed parts), ``stream`` (pushed while held: its
    parts go through the matcher as an early message), ``dropped`` (its receive failed:
    pushed parts are read and thrown away).
    """

    __slots__ = ("block", "entry", "host", "meta", "op", "received", "rid", "sid", "state",
                 "tag", "total")

    def __init__(self, sid: int, tag: int, total: int, meta: bytes) -> None:
        self.sid = sid
        self.tag = tag
        self.total = total
        self.meta = meta
        self.state = "held"
        self.op: _RecvOp | None = None
        self.entry: Entry[Region] | None = None
        self.rid = 0
        self.received = 0
        # pushed parts for a device receive gather here, then go up in one copy
        self.host: Buffer | None = None
        self.block: Buffer | None = None


class _SendOp:
    """A send: eager (``data`` copied at post) or rendezvous (written, or pushed).

    A device send has no host view (``view`` is empty until a push at close downloads
    it into ``host``); ``fence``: the GPU work its writes (or push) must wait for.
    """

    __slots__ = ("block", "buf", "device", "entry", "fence", "fut", "meta", "next", "sid",
                 "tag", "total", "view")

    def __init__(self, fut: asyncio.Future[None], buf: Buffer, tag: int, meta: bytes) -> None:
        self.fut = fut
        self.buf = buf
        self.device = buf.kind is not MemoryKind.HOST
        self.view = _EMPTY if self.device else buf.view()
        self.tag = tag
        self.meta = meta
        self.total = buf.nbytes if self.device else self.view.nbytes
        self.entry: Entry[Region] | None = None
        self.fence: Fence | None = None
        self.block: Buffer | None = None
        self.sid = 0
        self.next = 0  # next offset to write or push


class _Write:
    """A rendezvous send being written into the peer's buffer."""

    __slots__ = ("addr", "op", "outstanding", "rid", "rkey")

    def __init__(self, op: _SendOp, addr: int, rkey: int, rid: int) -> None:
        self.op = op
        self.addr = addr
        self.rkey = rkey
        self.rid = rid
        self.outstanding = 0


class RdmaConnection(LoopConnection["_RecvOp", "_Incoming"]):
    """A :class:`~.base.Connection` over one RC queue pair. See the module doc."""

    def __init__(self, transport: RdmaTransport, ep: Endpoint, tcp: TcpConnection,
                 peer: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._t = transport
        self._ep = ep
        self.qpn = ep.qpn
        self._tcp = tcp
        self.peer = f"{peer} (qp {ep.qpn:#x})"
        self._eager = transport.eager  # what our receive slots hold
        self._send_eager = 0  # what the peer's hold (known at start)
        self._slot = transport.slot
        self._chunk = transport.chunk
        depth = transport.depth
        self._depth = depth
        # registered slots: [0, depth) receive, [depth, 2 depth) send
        self._arena = empty_bytes(2 * depth * self._slot)
        self._arena_view = self._arena.data
        self._base = int(self._arena.__array_interface__["data"][0])
        self._mr = transport.device.register(self._base, self._arena.nbytes, True)
        self._lkey = int(self._mr.lkey)
        self._free_slots = list(range(2 * depth - 1, depth - 1, -1))
        self._sq_free = depth + _WRITE_DEPTH
        self._credits = Credits(depth)  # replaced at start, with the peer's depth
        self._match: Matcher[_RecvOp, _Incoming] = Matcher(
            _storage, max_early=MAX_EARLY.resolve(), limit_name="ACOLL_SOCKET_MAX_EARLY")
        self._sends: SendTable[_SendOp] = SendTable()
        self._recvs: RecvTable[_Incoming] = RecvTable()
        self._incoming: dict[int, _Incoming] = {}
        # CTS / DROP frames, each after a fence (a device receive's GPU work) or None
        self._ctrl: deque[tuple[int, dict[str, Any], Fence | None]] = deque()
        self._fence_waits: dict[Fence, asyncio.Task[None]] = {}
        self._frames: deque[tuple[str, Any]] = deque()  # ("data", op) ("rts", op) ("push", op)
        self._writes: deque[_Write] = deque()
        self._wr_writes: dict[int, tuple[_Write, bool]] = {}
        self._wr_next = 0
        self._copies = PacedCopies(self._loop,
                                   lambda exc: self._internal_error("receiving from", exc))
        self._failed: ConnectionLost | None = None
        self._on_failure: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        self._notice = b""
        self._close_posted = False
        self._close_pos = 0  # bytes of the notice sent in CLOSE parts
        self._peer_notice = bytearray()  # CLOSE parts received
        self._close_slot = -1
        self._close_acked = False  # the peer's HCA acknowledged our CLOSE frame
        self._peer_close_seen = False  # the peer's CLOSE arrived while we were closing
        self._released = False
        self._released_fut: asyncio.Future[None] = self._loop.create_future()
        self._started = False
        self._tcp_closed: ConnectionLost | None = None
        self._drain_scheduled = False
        self._progress = 0.0  # loop time of the last completion while closing
        self.stats = {"eager": 0, "rendezvous": 0, "pushed": 0, "credit_frames": 0,
                      "chunks": 0, "busy_polls": 0, "device_sends": 0, "device_recvs": 0,
                      "uploads": 0, "flushes": 0}
        for slot in range(depth):
            self._post_recv(slot)

    # ------------------------------------------------------------------ life cycle
    def start(self, remote: QpInfo, peer_eager: int, peer_depth: int) -> None:
        """Set-up done: watch the completion channel and the control connection."""
        self._send_eager = min(self._eager, peer_eager)
        self._credits = Credits(peer_depth, self._depth)
        self._started = True
        self._t.conns[self.qpn] = self
        self._loop.add_reader(self._ep.fd, self._on_channel)
        self._tcp.set_failure_callback(self._on_tcp_lost)
        log.debug("NET/IB: connected to %s: qp %#x -> %#x", self.peer, self.qpn, remote.qpn)
        self._drain()  # anything that arrived before the reader was installed

    def discard(self) -> None:
        """Set-up failed: free the queue pair and slots (no futures exist yet)."""
        self._released = True
        self._ep.to_error()
        self._ep.close()
        self._t._deregister(self._mr)
        if not self._released_fut.done():
            self._released_fut.set_result(None)

    @property
    def _gone(self) -> bool:
        """Released (a property, so that type narrowing does not outlive a call)."""
        return self._released

    def in_error(self) -> bool:
        try:
            return self._ep.state() == QPS_ERR
        except TransportError:
            return True

    async def wait_closed(self) -> None:
        await asyncio.shield(self._released_fut)

    # ------------------------------------------------------------------ posting
    def isend(self, buf: Buffer, tag: int, meta: bytes = bytes(META_SIZE)
              ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self._failed is not None or self._closing:
            fut.set_exception(self._failed or ConnectionLost("connection is closing"))
            fut.exception()
            return fut
        op = _SendOp(fut, buf, tag, meta)
        try:
            if op.total <= self._send_eager and (not op.device or op.total == 0):
                self.stats["eager"] += 1
                self._frames.append(("data", op))
            else:
                self.stats["rendezvous"] += 1
                try:
                    op.entry = self._t.acquire(buf, writable=False)
                    if op.device:
                        self.stats["device_sends"] += 1
                        op.fence = buf.space.fence()
                except TransportError as exc:  # this send fails; the connection goes on
                    if op.entry is not None:
                        self._release_entry(op)
                    fut.set_exception(exc)
                    return fut
                op.sid = self._sends.add(op.total, op)
                self._frames.append(("rts", op))
            self._pump()
        except Exception as exc:
            self._internal_error("sending to", exc)
        return fut

    def irecv(self, buf: Buffer, tag: int) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = self._loop.create_future()
        op = _RecvOp(fut, buf)
        try:
            dest = self._device_dest(op) if op.device else buf.view()
            msg = self._match.post(tag, dest, op)
        except (ProtocolError, TransportError) as exc:
            self._drop_bounce(op)
            fut.set_exception(exc)
            return fut
        if msg is not None:
            try:
                self._deliver(msg)
                self._pump()
            except TransportError as exc:
                self._lost(ConnectionLost(f"receiving from {self.peer} failed: {exc}"))
            except Exception as exc:
                self._internal_error("receiving from", exc)
        return fut

    # ------------------------------------------------------------------ device memory
    def _device_dest(self, op: _RecvOp) -> memoryview:
        """What the matcher fills for a device receive: a host bounce block when the
        message may come as one eager frame (it goes up to the device on delivery), an
        empty view for an empty buffer, else a read-only placeholder of its size (such a
        message only comes as writes into the buffer, or as parts that go elsewhere)."""
        buf = op.buf
        self._t.check_device(buf)
        self.stats["device_recvs"] += 1
        op.fence = buf.space.fence()
        n = buf.nbytes
        if n == 0:
            return _EMPTY
        if n <= self._send_eager:
            op.host, op.block = _staging(buf).lease(n)
            return op.host.view()
        return memoryview(np.broadcast_to(_ZERO, (n,)))  # type: ignore[arg-type]

    def _drop_bounce(self, op: _RecvOp | _Incoming, fence: Fence | None = None) -> None:
        if op.block is not None:
            owner = op.op.buf if isinstance(op, _Incoming) and op.op is not None else (
                op.buf if isinstance(op, _RecvOp) else None)
            if owner is not None:
                _staging(owner).release(op.block, fence)
            op.block = op.host = None

    def _upload(self, buf: Buffer, host: Buffer) -> Fence:
        """Enqueue ``buf`` (device) ``= host`` on the buffer's space (stream order)."""
        self.stats["uploads"] += 1
        try:
            return _staging(buf).upload(buf, host)
        except AcollError:
            raise
        except Exception as exc:
            raise TransportError(f"copying a message from {self.peer} to the device "
                                 f"failed: {exc!r}") from exc

    def _fenced(self, fence: Fence | None) -> bool:
        """Whether ``fence`` has passed (``None`` has); if not, :meth:`_pump` runs again
        once it has."""
        if fence is None or fence.done():
            return True
        if fence not in self._fence_waits:
            self._fence_waits[fence] = self._loop.create_task(self._wait_fence(fence))
        return False

    async def _wait_fence(self, fence: Fence) -> None:
        try:
            await fence.wait()
        except Exception as exc:
            self._lost(ConnectionLost(f"waiting for GPU work of a transfer with {self.peer} "
                                      f"failed: {exc}"))
            return
        finally:
            self._fence_waits.pop(fence, None)
        self._pump()

    def _stage_push(self, op: _SendOp) -> None:
        """A device send pushed at close: download it into a host block first.

        Raises:
            TransportError: the copy could not be started.
        """
        try:
            staging = _staging(op.buf)
            host, op.block = staging.lease(op.total)
            op.fence = staging.download(host, op.buf)
        except Exception as exc:
            raise TransportError(f"copying a send to {self.peer} to host memory failed: "
                                 f"{exc!r}") from exc
        op.view = host.view()

    def _release_block(self, op: _SendOp) -> None:
        if op.block is not None:
            _staging(op.buf).release(op.block, op.fence)
            op.block = None

    def poll(self) -> None:
        """Drain the completion queue now, within one ``_IO_NS`` budget (busy-poll)."""
        if self._started and not self._released:
            self.stats["busy_polls"] += 1
            self._drain()

    # ------------------------------------------------------------------ the wire
    def _slot_view(self, slot: int) -> memoryview:
        return self._arena_view[slot * self._slot:(slot + 1) * self._slot]

    def _post_recv(self, slot: int) -> None:
        self._ep.post_recv(_RECV_BIT | slot, self._base + slot * self._slot, self._slot,
                           self._lkey)

    def _post_frame(self, kind: int, payload: memoryview = _EMPTY, **fields: Any) -> int:
        """Copy a frame into a free send slot and SEND it (caller checked resources);
        returns the slot."""
        slot = self._free_slots.pop()
        view = self._slot_view(slot)
        returned = self._credits.spend()
        n = len(payload)
        size = wire.pack_into(view, kind, credits=returned, length=n, **fields)
        if n:
            view[wire.HEADER.size:wire.HEADER.size + n] = payload
        self._sq_free -= 1
        self._ep.post_send(_FRAME_BIT | slot, SEND, self._base + slot * self._slot, size,
                           self._lkey)
        return slot

    def _can_frame(self, *, credit_frame: bool = False) -> bool:
        return (self._sq_free > 0 and bool(self._free_slots)
                and self._credits.can_send(credit_frame=credit_frame))

    def _pump(self) -> None:
        """Post what the credits, send slots and send queue allow, in order: control
        frames, writes, then data frames; a CREDIT frame if credits are owed and nothing
        else carried them back."""
        if self._released or not self._started:
            return
        if self._close_posted:
            # After our CLOSE only credits go out: a peer closing at the same time may
            # still be flushing its messages to us, and needs them.
            try:
                if self._credits.should_return() and self._can_frame(credit_frame=True):
                    self.stats["credit_frames"] += 1
                    self._post_frame(wire.CREDIT)
            except TransportError as exc:
                self._lost(ConnectionLost(f"posting to {self.peer} failed: {exc}"))
                return
            self._close_done_check()
            return
        try:
            while self._ctrl and self._can_frame():
                kind, fields, fence = self._ctrl[0]
                if not self._fenced(fence):
                    break
                self._ctrl.popleft()
                self._post_frame(kind, **fields)
            while self._writes and self._sq_free > 0:
                op = self._writes[0].op
                if not self._fenced(op.fence):
                    break
                op.fence = None
                if not self._post_write(self._writes[0]):
                    break
            while self._frames and self._can_frame():
                what, op = self._frames[0]
                if what == "close":  # the notice, in as many CLOSE parts as it takes
                    if self._writes or self._ctrl:
                        break
                    pos, notice = self._close_pos, self._notice
                    part = notice[pos:pos + self._send_eager]
                    slot = self._post_frame(wire.CLOSE, memoryview(part), total=len(notice),
                                            offset=pos)
                    self._close_pos = pos + len(part)
                    if self._close_pos >= len(notice):
                        self._frames.popleft()
                        self._close_slot = slot
                        self._close_posted = True
                    continue
                if op.fut.done() and what != "push":  # failed meanwhile (drop_queued)
                    self._frames.popleft()
                    continue
                if what == "data":
                    self._frames.popleft()
                    self._post_frame(wire.DATA, op.view, tag=op.tag, total=op.total,
                                     meta=op.meta)
                    op.fut.set_result(None)
                elif what == "rts":
                    self._frames.popleft()
                    self._post_frame(wire.RTS, tag=op.tag, total=op.total, send_id=op.sid,
                                     meta=op.meta)
                else:  # a part of a pushed rendezvous message
                    if not self._fenced(op.fence):  # a device send's download
                        break
                    length = min(self._send_eager, op.total - op.next)
                    self._post_frame(wire.DATA, op.view[op.next:op.next + length],
                                     tag=op.tag, total=op.total, offset=op.next,
                                     send_id=op.sid, meta=op.meta, flags=wire.PUSH)
                    op.next += length
                    if op.next >= op.total:
                        self._frames.popleft()
                        self._sends.done(op.sid)
                        self._release_entry(op)
                        self._release_block(op)
                        if not op.fut.done():
                            op.fut.set_result(None)
            if self._credits.should_return() and self._can_frame(credit_frame=True):
                self.stats["credit_frames"] += 1
                self._post_frame(wire.CREDIT)
            if self._close_posted:
                self._close_done_check()
        except TransportError as exc:
            self._lost(ConnectionLost(f"posting to {self.peer} failed: {exc}"))

    def _post_write(self, w: _Write) -> bool:
        """Post the next chunk of ``w``; False when it must wait (credit for the last)."""
        op = w.op
        offset = op.next
        length = min(self._chunk, op.total - offset)
        last = offset + length >= op.total
        if last and not self._credits.can_send():
            return False
        assert op.entry is not None
        region = op.entry.region
        wr_id = _WRITE_BIT | (self._wr_next & _LOW)
        self._wr_next += 1
        if last:
            self._credits.spend_silent()
        self._sq_free -= 1
        w.outstanding += 1
        self._wr_writes[wr_id] = (w, last)
        self.stats["chunks"] += 1
        self._ep.post_send(wr_id, WRITE_IMM if last else WRITE,
                           region.translate(op.buf.ptr) + offset, length, region.lkey,
                           rkey=w.rkey, remote=w.addr + offset, imm=w.rid if last else 0)
        op.next = offset + length
        if last:
            self._writes.popleft()
        return True

    def _release_entry(self, op: _SendOp | _Incoming) -> None:
        if op.entry is not None:
            entry, op.entry = op.entry, None
            self._t.release(entry)

    # ------------------------------------------------------------------ completions
    def _on_channel(self) -> None:
        try:
            self._ep.take_events()
            self._ep.arm()
            self._drain()
        except TransportError as exc:
            self._lost(ConnectionLost(f"completion channel of {self.peer}: {exc}"))
        except Exception as exc:
            self._internal_error("receiving from", exc)

    def _drain_later(self) -> None:
        self._drain_scheduled = False
        self._drain()

    def _drain(self) -> None:
        """Handle completions for at most ``_IO_NS``; schedule the rest for the next loop
        step."""
        if self._released:
            return
        until = time.perf_counter_ns() + _IO_NS
        try:
            while True:
                batch = self._ep.poll(_POLL_BATCH)
                for c in batch:
                    self._completion(c.wr_id, c.status, c.opcode, c.byte_len, c.imm,
                                     c.vendor_err)
                    if self._gone:
                        return
                if len(batch) < _POLL_BATCH:
                    break
                if time.perf_counter_ns() >= until:
                    if not self._drain_scheduled:
                        self._drain_scheduled = True
                        self._loop.call_soon(self._drain_later)
                    break
            self._pump()
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))
        except TransportError as exc:
            self._lost(ConnectionLost(f"RDMA with {self.peer} failed: {exc}"))
        except Exception as exc:
            self._internal_error("receiving from", exc)

    def _completion(self, wr_id: int, status: int, opcode: int, nbytes: int, imm: int,
                    vendor_err: int) -> None:
        if self._closing:
            self._progress = self._loop.time()
        if status != WC_SUCCESS:
            if is_flush(status) and (self._failed is not None or self._closing):
                return
            what = ("receiving from" if wr_id & _RECV_BIT else "writing to"
                    if wr_id & _WRITE_BIT else "sending to")
            self._lost(ConnectionLost(completion_failure(status, what, self.peer, vendor_err)))
            return
        if wr_id & _RECV_BIT:
            slot = wr_id & _LOW
            if opcode == WC_RECV_RDMA_WITH_IMM:
                self._credits.arrived(0)
                self._written(imm)
            elif opcode == WC_RECV:
                frame = wire.parse(self._slot_view(slot), nbytes)
                self._credits.arrived(frame.credits)
                self._frame(frame, slot)
            else:
                raise ProtocolError(f"unexpected receive completion opcode {opcode}")
            if not self._released and self._failed is None:
                self._post_recv(slot)
                self._credits.reposted()
        elif wr_id & _FRAME_BIT:
            self._sq_free += 1
            slot = wr_id & _LOW
            self._free_slots.append(slot)
            if self._close_posted and slot == self._close_slot:
                self._close_acked = True
        elif wr_id & _WRITE_BIT:
            self._sq_free += 1
            w, last = self._wr_writes.pop(wr_id)
            w.outstanding -= 1
            if last:
                op = w.op
                self._sends.done(op.sid)
                self._release_entry(op)
                if not op.fut.done():
                    op.fut.set_result(None)
        else:
            raise ProtocolError(f"completion for unknown work request {wr_id:#x}")

    def _frame(self, f: wire.Frame, slot: int) -> None:
        kind = f.kind
        if kind == wire.DATA:
            payload = self._slot_view(slot)[wire.HEADER.size:wire.HEADER.size + f.length]
            if f.flags & wire.PUSH:
                self._pushed(f, payload)
            else:
                self._data(f.tag, f.total, f.offset, payload, f.meta)
        elif kind == wire.RTS:
            self._rts(f)
        elif kind == wire.CTS:
            op = self._sends.cts(f.send_id, f.total)
            if op is not None:
                self._writes.append(_Write(op, f.addr, f.rkey, f.rid))
        elif kind == wire.DROP:
            op = self._sends.drop(f.send_id)
            if op is not None:
                self._release_entry(op)
                if not op.fut.done():
                    op.fut.set_result(None)
        elif kind == wire.CLOSE:
            if f.total > _MAX_NOTICE or f.offset != len(self._peer_notice):
                raise ProtocolError(f"CLOSE part {f.offset}+{f.length} of {f.total} out of "
                                    "order or too large")
            self._peer_notice += self._slot_view(slot)[wire.HEADER.size:
                                                       wire.HEADER.size + f.length]
            if len(self._peer_notice) == f.total:
                self._peer_closed(bytes(self._peer_notice))
        # CREDIT: nothing beyond the credits

    def _data(self, tag: int, total: int, offset: int, payload: memoryview,
              meta: bytes) -> None:
        match = self._match
        msg, dest = match.place(tag, total, offset, len(payload), meta)
        self._arrivals()
        if dest is not None and len(payload):
            dest[:len(payload)] = payload
        done = match.landed(msg, len(payload))
        if done is not None:
            self._deliver(done)

    def _arrivals(self) -> None:
        match = self._match
        if match.arrivals:
            for early_tag, early_meta in match.arrivals:
                self._notify_arrival(self._loop, early_tag, early_meta)
            match.arrivals.clear()

    def _rts(self, f: wire.Frame) -> None:
        if f.send_id in self._incoming:
            raise ProtocolError(f"a second RTS for send {f.send_id}")
        inc = _Incoming(f.send_id, f.tag, f.total, f.meta)
        self._incoming[f.send_id] = inc
        msg = self._match.hold(f.tag, f.total, f.meta, inc)
        self._arrivals()
        if msg is not None:
            self._deliver(msg)

    def _pushed(self, f: wire.Frame, payload: memoryview) -> None:
        inc = self._incoming.get(f.send_id)
        if inc is None or f.tag != inc.tag or f.total != inc.total:
            raise ProtocolError(f"pushed part of unknown send {f.send_id}")
        n = len(payload)
        inc.received += n
        if inc.received > inc.total:
            raise ProtocolError(f"pushed parts of send {f.send_id} exceed its size")
        if inc.state == "held":
            if not self._match.withdraw(inc.tag, inc):
                raise ProtocolError(f"send {f.send_id} was pushed after being matched")
            inc.state = "stream"
        if inc.state == "stream":
            match = self._match
            msg, dest = match.place(inc.tag, inc.total, f.offset, n, inc.meta)
            match.arrivals = [a for a in match.arrivals if a[0] != inc.tag]  # told at RTS
            if dest is not None and n:
                dest[:n] = payload
            done = match.landed(msg, n)
            if done is not None:
                self._deliver(done)
        elif inc.state == "matched":
            op = inc.op
            assert op is not None
            if n and op.device:
                if inc.host is None:
                    inc.host, inc.block = _staging(op.buf).lease(inc.total)
                inc.host.view()[f.offset:f.offset + n] = payload
            elif n:
                op.buf.view()[f.offset:f.offset + n] = payload
            if inc.received == inc.total:
                self._recvs.take(inc.rid)
                if inc.host is not None:
                    fence = self._upload(op.buf, inc.host)
                    self._drop_bounce(inc, fence)
                self._finish_incoming(inc, written=False)
        # "dropped": thrown away
        if inc.received == inc.total:
            self._incoming.pop(inc.sid, None)

    def _written(self, rid: int) -> None:
        inc = self._recvs.written(rid)
        self._incoming.pop(inc.sid, None)
        self._finish_incoming(inc, written=True)

    def _finish_incoming(self, inc: _Incoming, *, written: bool) -> None:
        """The whole message is in the receive's buffer: complete it (or, when the
        receive failed meanwhile, just let go of its buffer). ``written``: the NIC wrote
        it; into device memory that needs a flush first (see :mod:`.gdr`)."""
        op = inc.op
        if (written and op is not None and op.device and inc.entry is not None
                and not op.fut.done() and self._failed is None and not self._closing
                and self._t.gdr_choice(self._t._device_of(op.buf)).flush):
            entry, inc.entry = inc.entry, None
            self._flush(op, entry, inc.meta)
            return
        self._release_entry(inc)
        if op is not None and not op.fut.done():
            if self._closing or self._failed is not None:
                op.fut.set_exception(self._failed or ConnectionLost(
                    "the connection was closed locally"))
                op.fut.exception()
            else:
                op.fut.set_result(inc.meta)

    def _flush(self, op: _RecvOp, entry: Entry[Region], meta: bytes) -> None:
        """Read one byte of a GPUDirect receive's buffer, then complete it."""
        self.stats["flushes"] += 1

        def done(exc: BaseException | None) -> None:
            self._t.release(entry)
            if op.fut.done():
                return
            if exc is not None:
                lost = ConnectionLost(f"flushing a receive from {self.peer} failed: {exc}")
                op.fut.set_exception(lost)
                op.fut.exception()
                self._lost(lost)
            else:
                op.fut.set_result(meta)

        try:
            self._t.flusher().flush(entry.region, op.buf.ptr, done)
        except TransportError as exc:
            done(exc)

    def _deliver(self, msg: _Recv) -> None:
        """Carry out a delivery of the matcher (see :class:`~.matching.Message`)."""
        op = msg.token
        inc = msg.ref
        if msg.error is not None:
            if op is not None:
                self._drop_bounce(op)
                if not op.fut.done():
                    op.fut.set_exception(msg.error)
                    op.fut.exception()
            if inc is not None:
                inc.state = "dropped"
                if isinstance(msg.error, MessageSizeError):
                    self._ctrl.append((wire.DROP, {"send_id": inc.sid}, None))
            return
        if op is None:
            return
        if op.fut.done():
            self._drop_bounce(op)
            return
        if msg.storage is not None:
            assert msg.dest is not None
            if op.device:  # up to the device from the storage, kept until it is read
                self._drop_bounce(op)
                if msg.total:
                    # through page-locked memory: an upload from pageable memory would
                    # synchronize the stream, blocking the loop until earlier GPU work ends
                    staging = _staging(op.buf)
                    view, block = staging.lease(msg.total)
                    view.view()[:] = msg.storage[:msg.total]
                    fence = self._upload(op.buf, view)
                    staging.release(block, fence)
                op.fut.set_result(msg.meta)
            else:
                self._copies.start(msg.dest, msg.storage, op.fut, msg.meta)
        elif inc is not None:  # a rendezvous message met its receive: ask for the data
            self._drop_bounce(op)
            inc.op = op
            inc.entry = self._t.acquire(op.buf, writable=True)
            inc.rid = self._recvs.add(inc)
            inc.state = "matched"
            region = inc.entry.region
            self._ctrl.append((wire.CTS, {"send_id": inc.sid, "total": inc.total,
                                          "addr": region.translate(op.buf.ptr),
                                          "rkey": region.rkey, "rid": inc.rid}, op.fence))
        elif op.host is not None:  # an eager frame landed in the bounce block
            assert op.block is not None
            fence = self._upload(op.buf, op.host)
            self._drop_bounce(op, fence)
            op.fut.set_result(msg.meta)
        else:
            op.fut.set_result(msg.meta)

    # ------------------------------------------------------------------ closing
    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        if self._closing or self._failed is not None or self._released:
            return
        self._closing = True
        self._notice = notice[:_MAX_NOTICE]
        lost = ConnectionLost("the connection was closed locally")
        for msg in self._match.fail(lost):
            self._deliver(msg)
        self._copies.fail(lost)
        # receives whose buffer was advertised fail once their data landed (or at release)
        if drop_queued:
            keep: deque[tuple[str, Any]] = deque()
            for what, op in self._frames:
                if what == "push":
                    keep.append((what, op))
                elif not op.fut.done():
                    op.fut.set_exception(lost)
                    op.fut.exception()
            self._frames = keep
            for op in self._sends.items():
                if self._sends.state(op.sid) is SendState.WAITING:
                    self._sends.done(op.sid)
                    self._release_entry(op)
                    if not op.fut.done():
                        op.fut.set_exception(lost)
                        op.fut.exception()
        else:
            # rendezvous messages still waiting for a CTS are pushed as DATA parts, after
            # their RTS (queued or sent: the receiver knows the send id first)
            for _sid, op in self._sends.push():
                self.stats["pushed"] += 1
                op.next = 0
                if op.device and op.total:
                    try:
                        self._stage_push(op)
                    except TransportError as exc:  # the peer must not wait for it: crash
                        self._failed = ConnectionLost(str(exc))
                        self._release(abort=True)
                        return
                self._frames.append(("push", op))
        self._frames.append(("close", None))
        self._progress = self._loop.time()
        self._loop.call_later(_LINGER, self._linger_expired)
        self._pump()

    def _close_done_check(self) -> None:
        """Release once the peer has our CLOSE (its completion) and has closed too: its
        CLOSE arrived, or (checked elsewhere) its control connection closed."""
        if self._close_acked and self._peer_close_seen and not self._released:
            self._release()

    def _linger_expired(self) -> None:
        """A close that made no progress (no completion) for ``_LINGER`` s ends here; one
        still flushing a backlog gets more time."""
        if self._released:
            return
        idle = self._loop.time() - self._progress
        if idle < _LINGER:
            self._loop.call_later(_LINGER - idle, self._linger_expired)
            return
        log.info("NET/IB: %s: close made no progress for %.0f s", self.peer, _LINGER)
        self._release()

    def _peer_closed(self, notice: bytes) -> None:
        if self._closing:  # both close: done once our CLOSE is acknowledged too
            self._peer_close_seen = True
            self._close_done_check()
            return
        self._lost(ConnectionLost(f"{self.peer} closed the connection", orderly=True,
                                  notice=notice))

    def _on_tcp_lost(self, lost: ConnectionLost) -> None:
        """The control connection ended: the peer closed (orderly), aborted or died."""
        if self._released:
            return
        if self._closing:
            self._release()  # the peer is done with us
            return
        self._drain()  # its CLOSE frame may be waiting in the completion queue
        if self._failed is not None or self._released:
            return
        if lost.orderly:
            self._tcp_closed = lost
            self._loop.call_later(_TCP_GRACE, self._tcp_grace_over)
        else:
            self._lost(ConnectionLost(f"{self.peer}: the control connection broke ({lost}); "
                                      "the peer died or aborted"))

    def _tcp_grace_over(self) -> None:
        if self._released or self._failed is not None:
            return
        self._drain()
        lost = self._tcp_closed
        if self._failed is None and lost is not None:
            self._lost(ConnectionLost(f"{self.peer} closed the connection", orderly=True,
                                      notice=lost.notice))

    def abort(self) -> None:
        if self._failed is None:
            self._failed = ConnectionLost("the connection was aborted locally")
        self._release(abort=True)

    def fail(self, why: str) -> None:
        """End the connection with ``why`` (an asynchronous event, from the transport)."""
        self._lost(ConnectionLost(f"{self.peer}: {why}"))

    # ------------------------------------------------------------------ failure
    def _ended(self) -> bool:
        return self._released

    def _settle_lost(self, exc: ConnectionLost) -> None:
        self._release(abort=not exc.orderly)

    def _release(self, *, abort: bool = False) -> None:
        """Stop the queue pair, then fail whatever is pending and free everything."""
        if self._released:
            return
        self._released = True
        exc = self._failed or ConnectionLost("the connection was closed locally",
                                            orderly=True)
        if self._failed is None:
            self._failed = exc
        # No write may land after this, and no send buffer be read: only then are the
        # buffers' owners told (their futures fail) and registrations released.
        self._ep.to_error()
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._ep.fd)
        self._ep.close()
        for msg in self._match.fail(exc):
            self._deliver(msg)
        if not self._match.keeping:
            self._copies.fail(exc)
        for inc in self._recvs.clear():
            self._release_entry(inc)
            self._drop_bounce(inc)
            if inc.op is not None and not inc.op.fut.done():
                inc.op.fut.set_exception(exc)
                inc.op.fut.exception()
        for _what, op in self._frames:
            if op is not None and not op.fut.done():
                op.fut.set_exception(exc)
                op.fut.exception()
        self._frames.clear()
        for op in self._sends.clear():
            self._release_entry(op)
            self._release_block(op)
            if not op.fut.done():
                op.fut.set_exception(exc)
                op.fut.exception()
        self._writes.clear()
        self._wr_writes.clear()
        self._ctrl.clear()
        for inc in self._incoming.values():
            self._release_entry(inc)
            self._drop_bounce(inc)
        self._incoming.clear()
        for task in self._fence_waits.values():
            task.cancel()
        self._fence_waits.clear()
        self._t._deregister(self._mr)
        self._t.forget(self)
        if abort or not exc.orderly:
            self._tcp.abort()
        else:
            self._tcp.close(self._notice if self._closing else b"")
        if not self._released_fut.done():
            self._released_fut.set_result(None)
