"""The verbs adapter: the few pyverbs calls the RDMA transport makes, in one place.

pyverbs (rdma-core's Python binding, the ``rdma`` extra) is imported lazily, on first use,
so acoll imports without it. Every call goes through a *lib*: a namespace with pyverbs'
names (``Context``, ``PD``, ``MR``, ``CompChannel``, ``CQ``, ``QPCap``, ``QPInitAttr``,
``QP``, ``QPAttr``, ``AHAttr``, ``GlobalRoute``, ``GID``, ``SGE``, ``SendWR``, ``RecvWR``,
``get_device_list``, the enums as ``e``, ``PyverbsError`` and ``DmaBufMR``, ``None`` where
pyverbs lacks it). :func:`load_pyverbs`
builds it from the real package; tests install a verbs test double with the same surface
through :func:`set_provider` (see ``tests/verbs_double.py``), so this module's code runs
in CI exactly as it does on hardware.

Nothing here blocks: pyverbs holds the GIL in every call, so a blocking call would stop
the whole process. The completion channel's descriptor is made non-blocking and read only
when the event loop says it is readable; the device's asynchronous-event descriptor too.
pyverbs does not expose the latter (nor, before rdma-core v45, the channel's ``fd``), so
such a descriptor is found as the one ``[infinibandevent]`` descriptor that creating its
object added to ``/proc/self/fd``. Without the async one, asynchronous events are not
watched (failures still arrive as error completions and through the control connection);
without the channel's, no connection can be made.

Memory regions come back as :class:`Region` objects, which say how a buffer's address
reads in the region's own address space: the virtual address for ordinary regions; for
dma-buf regions pyverbs' ``DmaBufMR`` sets the I/O virtual address to the offset in the
dma-buf (``ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd, access)``), so local
and remote addresses are offsets there. ``DmaBufMR`` takes a descriptor from rdma-core
v44 on (``DmaBufMR(pd, length, access, dmabuf=fd, offset=...)``); v34 to v43 accept only
their own ``DmaBuf`` objects (allocated from a DRM device, not a GPU's memory), so
GPUDirect through dma-buf needs v44 (:meth:`Device.probe_dmabuf` says why not).

pyverbs errors become :class:`VerbsError` (a :class:`~acoll.errors.TransportError`) here,
with the failed call named.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ...errors import TransportError
from .discovery import GidEntry, PortInfo
from .qp import QpSettings, Transition
from .spec import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    GID_TYPE_IB,
    GID_TYPE_ROCE_V1,
    GID_TYPE_ROCE_V2,
    LINK_LAYER_ETHERNET,
)

__all__ = ["Completion", "Device", "Endpoint", "Region", "VerbsError", "get_lib",
           "list_ports", "load_pyverbs", "provided", "set_provider"]

SEND, WRITE, WRITE_IMM, READ = "send", "write", "write_imm", "read"
_GID_LIMIT = 256  # GID table entries looked at per port
_ANON_EVENT = "anon_inode:[infinibandevent]"


class VerbsError(TransportError):
    """A verbs call failed (``__cause__`` holds pyverbs' error)."""


class Completion(NamedTuple):
    """One work completion, as plain values."""

    wr_id: int
    status: int
    opcode: int
    byte_len: int
    imm: int
    vendor_err: int


# ---------------------------------------------------------------------------- the lib
def load_pyverbs() -> Any:
    """The real pyverbs as a lib namespace.

    pyverbs calls ``logging.basicConfig(level=INFO)`` when imported, which would print
    every library's INFO records; the root logger's handlers and level are put back.

    Raises:
        ImportError: pyverbs (or a part of it this transport needs) is not installed.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from pyverbs import addr, cq, device, mr, pd, qp, wr
        from pyverbs.pyverbs_error import PyverbsError

        try:
            from pyverbs import libibverbs_enums as e
        except ImportError:  # rdma-core before v45 called it pyverbs.enums
            from pyverbs import enums as e
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)

    return types.SimpleNamespace(
        get_device_list=device.get_device_list, Context=device.Context, PD=pd.PD, MR=mr.MR,
        CompChannel=cq.CompChannel, CQ=cq.CQ, QPCap=qp.QPCap, QPInitAttr=qp.QPInitAttr,
        QP=qp.QP, QPAttr=qp.QPAttr, AHAttr=addr.AHAttr, GlobalRoute=addr.GlobalRoute,
        GID=addr.GID, SGE=wr.SGE, SendWR=wr.SendWR, RecvWR=wr.RecvWR, e=e,
        PyverbsError=PyverbsError, DmaBufMR=getattr(mr, "DmaBufMR", None), name="pyverbs")


_provider: Callable[[], Any] | None = None


def set_provider(factory: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """Make ``factory()`` the lib every later call uses (``None``: real pyverbs again);
    returns the previous factory. For tests (a verbs test double) and embedders."""
    global _provider
    previous, _provider = _provider, factory
    return previous


@contextlib.contextmanager
def provided(lib: Any) -> Iterator[Any]:
    """``with provided(lib):`` -- use ``lib`` inside the block (see :func:`set_provider`)."""
    previous = set_provider(lambda: lib)
    try:
        yield lib
    finally:
        set_provider(previous)


def get_lib() -> Any:
    """The lib in use: the provider's, else real pyverbs.

    Raises:
        ImportError: no provider, and pyverbs is not installed or cannot load.
    """
    return _provider() if _provider is not None else load_pyverbs()


def _fail(what: str, exc: BaseException) -> VerbsError:
    return VerbsError(f"{what} failed: {exc}")


def _name(dev: Any) -> str:
    name = dev.name
    return name.decode() if isinstance(name, bytes) else str(name)


def _gid_bytes(gid: Any) -> bytes:
    """pyverbs' GID (``.gid`` is ``'fe80:0000:...'``) as 16 bytes."""
    text = str(gid.gid)
    return ipaddress.IPv6Address(text).packed


def _read_port(lib: Any, ctx: Any, name: str, port: int, dev_attr: Any) -> PortInfo:
    attr = ctx.query_port(port)
    gids: list[GidEntry] = []
    layer = int(attr.link_layer)
    for index in range(min(int(attr.gid_tbl_len), _GID_LIMIT)):
        try:
            raw = _gid_bytes(ctx.query_gid(port, index))
        except lib.PyverbsError:
            continue
        if not any(raw):
            continue
        if layer == LINK_LAYER_ETHERNET:
            try:
                sysfs_type = int(ctx.query_gid_type(port, index))
            except lib.PyverbsError:
                continue
            kind = GID_TYPE_ROCE_V2 if sysfs_type == 1 else GID_TYPE_ROCE_V1
        else:
            kind = GID_TYPE_IB
        gids.append(GidEntry(index, raw, kind))
    return PortInfo(
        device=name, port=port, state=int(attr.state), link_layer=layer,
        active_mtu=int(attr.active_mtu), lid=int(attr.lid),
        speed=int(attr.active_speed), width=int(attr.active_width),
        speed_ex=int(getattr(attr, "active_speed_ex", 0) or 0),
        max_msg_sz=int(attr.max_msg_sz), gids=tuple(gids),
        max_qp_wr=int(dev_attr.max_qp_wr), max_sge=int(dev_attr.max_sge),
        max_cqe=int(dev_attr.max_cqe), max_mr_size=int(dev_attr.max_mr_size),
        max_qp=int(dev_attr.max_qp), max_mr=int(dev_attr.max_mr))


def list_ports(lib: Any) -> tuple[list[PortInfo], str]:
    """Every port of every device ``lib`` lists (any state), and why none if empty.

    Never raises for a device that cannot be opened or queried: it is skipped and named
    in the reason.
    """
    try:
        devices = list(lib.get_device_list())
    except Exception as exc:
        return [], f"listing RDMA devices failed: {exc}"
    ports: list[PortInfo] = []
    skipped: list[str] = []
    for dev in devices:
        name = _name(dev)
        try:
            with contextlib.closing(lib.Context(name=name)) as ctx:
                dev_attr = ctx.query_device()
                for port in range(1, int(dev_attr.phys_port_cnt) + 1):
                    ports.append(_read_port(lib, ctx, name, port, dev_attr))
        except Exception as exc:
            skipped.append(f"{name}: {exc}")
    if ports:
        return ports, ""
    if skipped:
        return [], "no RDMA device could be queried (" + "; ".join(skipped) + ")"
    return [], "no RDMA device"


def _set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def _event_fds() -> set[int]:
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for entry in names:
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == _ANON_EVENT:
                out.add(int(entry))
        except (OSError, ValueError):
            continue
    return out


# ---------------------------------------------------------------------------- regions
class Region:
    """A registered memory region: ``length`` bytes at virtual address ``addr``, which
    the region's keys address as ``iova`` (the same number except for dma-buf regions).
    """

    __slots__ = ("addr", "device", "iova", "length", "lkey", "mr", "rkey")

    def __init__(self, mr: Any, addr: int, length: int, iova: int | None = None,
                 device: int | None = None) -> None:
        self.mr = mr
        self.device = device  # the GPU ordinal of device memory, None for host memory
        self.addr = addr
        self.length = length
        self.iova = addr if iova is None else iova
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def translate(self, ptr: int) -> int:
        """The address work requests use for virtual address ``ptr`` inside the region."""
        return ptr - self.addr + self.iova

    def close(self) -> None:
        self.mr.close()


# ---------------------------------------------------------------------------- device
class Device:
    """One opened RDMA device: its context, a protection domain, its async events."""

    def __init__(self, lib: Any, name: str) -> None:
        self.lib = lib
        self.name = name
        e = lib.e
        self._access_rw = int(e.IBV_ACCESS_LOCAL_WRITE) | int(e.IBV_ACCESS_REMOTE_WRITE)
        assert self._access_rw == ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
        self._access_all = self._access_rw | int(e.IBV_ACCESS_REMOTE_READ)
        assert self._access_all == self._access_rw | ACCESS_REMOTE_READ
        before = _event_fds()
        try:
            self.ctx = lib.Context(name=name)
        except lib.PyverbsError as exc:
            raise _fail(f"opening RDMA device {name}", exc) from exc
        fd = getattr(self.ctx, "async_fd", None)
        if fd is None:
            fresh = _event_fds() - before
            fd = fresh.pop() if len(fresh) == 1 else None
        self.async_fd: int | None = fd
        if fd is not None:
            _set_nonblocking(fd)
        try:
            self.pd = lib.PD(self.ctx)
            self._dev_attr = self.ctx.query_device()
        except lib.PyverbsError as exc:
            self.ctx.close()
            raise _fail(f"allocating a protection domain on {name}", exc) from exc

    def port_info(self, port: int) -> PortInfo:
        try:
            return _read_port(self.lib, self.ctx, self.name, port, self._dev_attr)
        except self.lib.PyverbsError as exc:
            raise _fail(f"querying {self.name}:{port}", exc) from exc

    def register(self, addr: int, length: int, writable: bool) -> Region:
        """Register ``length`` bytes at ``addr``: read-only memory for local reads (the
        source of sends and writes), writable memory also for remote writes."""
        access = self._access_rw if writable else 0
        try:
            return Region(self.lib.MR(self.pd, length, access, address=addr), addr, length)
        except self.lib.PyverbsError as exc:
            raise _fail(f"registering {length} bytes at {addr:#x} on {self.name}",
                        exc) from exc

    def register_device(self, addr: int, length: int, device: int) -> Region:
        """Register GPU memory through a peer-memory module (an ordinary registration of a
        device pointer), for local access, remote writes and remote reads (the flush)."""
        try:
            mr = self.lib.MR(self.pd, length, self._access_all, address=addr)
        except self.lib.PyverbsError as exc:
            raise _fail(f"registering {length} bytes of GPU memory at {addr:#x} on "
                        f"{self.name} (peer memory)", exc) from exc
        return Region(mr, addr, length, device=device)

    def register_dmabuf(self, fd: int, offset: int, length: int, addr: int, device: int
                        ) -> Region:
        """Register ``length`` bytes at ``offset`` of dma-buf ``fd``, whose byte
        ``offset`` is virtual address ``addr`` (the caller still owns ``fd``)."""
        cls = self.lib.DmaBufMR
        if cls is None:
            raise VerbsError("this pyverbs has no DmaBufMR")
        try:
            mr = cls(self.pd, length, self._access_all, dmabuf=fd, offset=offset)
        except (self.lib.PyverbsError, TypeError) as exc:
            raise _fail(f"registering {length} bytes of dma-buf {fd} (GPU memory at "
                        f"{addr:#x}) on {self.name}", exc) from exc
        return Region(mr, addr, length, iova=offset, device=device)

    def probe_dmabuf(self) -> tuple[bool, str]:
        """Whether dma-buf regions can be registered here, and why not (NCCL's probe: a
        registration of descriptor -1 fails with ``EOPNOTSUPP`` or ``EPROTONOSUPPORT``
        when the kernel driver lacks dma-buf support, with ``EBADF`` otherwise)."""
        cls = getattr(self.lib, "DmaBufMR", None)
        if cls is None:
            return False, "pyverbs has no DmaBufMR (rdma-core before v34)"
        try:
            mr = cls(self.pd, 0, 0, dmabuf=-1, offset=0)
        except TypeError:
            return False, ("pyverbs takes no dma-buf descriptor (rdma-core before v44 "
                           "accepts only its own DmaBuf objects)")
        except self.lib.PyverbsError as exc:
            code = getattr(exc, "error_code", -1)
            if code in (errno.EOPNOTSUPP, errno.EPROTONOSUPPORT):
                return False, f"{self.name}'s kernel driver does not register dma-bufs"
            return True, ""
        with contextlib.suppress(Exception):
            mr.close()
        return True, ""

    @staticmethod
    def deregister(mr: Any) -> None:
        mr.close()

    def endpoint(self, send_depth: int, recv_depth: int) -> Endpoint:
        return Endpoint(self, send_depth, recv_depth)

    def read_async_events(self) -> list[tuple[int, int | None, int | None]]:
        """The asynchronous events waiting (never blocks): ``(type, qp number or None,
        port or None)`` each (pyverbs does not say which queue pair or port: ``None``)."""
        out: list[tuple[int, int | None, int | None]] = []
        if self.async_fd is None:
            return out
        for _ in range(64):
            try:
                event = self.ctx.get_async_event()
            except self.lib.PyverbsError as exc:
                code = getattr(exc, "error_code", -1)
                if code in (errno.EAGAIN, errno.EWOULDBLOCK, -1):
                    break
                raise _fail(f"reading async events of {self.name}", exc) from exc
            out.append((int(event.event_type), getattr(event, "qp_num", None),
                        getattr(event, "port_num", None)))
            event.ack()
        return out

    def close(self) -> None:
        for obj in (self.pd, self.ctx):
            with contextlib.suppress(Exception):
                obj.close()


class Endpoint:
    """One RC queue pair with its own completion queue and completion channel.

    Every send is signalled; the completion queue holds ``send_depth + recv_depth``
    entries, so it cannot overflow.
    """

    def __init__(self, device: Device, send_depth: int, recv_depth: int) -> None:
        lib = device.lib
        self.lib = lib
        self.device = device
        e = lib.e
        self._e = e
        self._ops = {SEND: e.IBV_WR_SEND, WRITE: e.IBV_WR_RDMA_WRITE,
                     WRITE_IMM: e.IBV_WR_RDMA_WRITE_WITH_IMM, READ: e.IBV_WR_RDMA_READ}
        self._signaled = e.IBV_SEND_SIGNALED
        self.channel: Any = None
        self.cq: Any = None
        self.qp: Any = None
        self._closed = False
        try:
            before = _event_fds()
            self.channel = lib.CompChannel(device.ctx)
            fd = getattr(self.channel, "fd", None)
            if fd is None:
                fresh = _event_fds() - before
                if len(fresh) != 1:
                    raise VerbsError("the completion channel's descriptor was not found "
                                     "(pyverbs does not expose it)")
                fd = fresh.pop()
            self.fd = int(fd)
            _set_nonblocking(self.fd)
            self.cq = lib.CQ(device.ctx, send_depth + recv_depth, None, self.channel, 0)
            cap = lib.QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1,
                            max_recv_sge=1, max_inline_data=0)
            init = lib.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                                  sq_sig_all=1)
            self.qp = lib.QP(device.pd, init)
            self.qpn = int(self.qp.qp_num)
            self.cq.req_notify()
        except (lib.PyverbsError, VerbsError) as exc:
            self.close()
            if isinstance(exc, VerbsError):
                raise
            raise _fail(f"creating a queue pair on {device.name}", exc) from exc

    def modify(self, step: Transition) -> None:
        """Apply one state transition (see :mod:`.qp`)."""
        lib = self.lib
        attr = lib.QPAttr()
        attr.qp_state = step.state
        for name, value in step.attrs.items():
            if name == "ah_attr":
                attr.ah_attr = self._ah(value)
            else:
                setattr(attr, name, value)
        try:
            self.qp.modify(attr, step.mask)
        except lib.PyverbsError as exc:
            raise _fail(f"moving queue pair {self.qpn} to state {step.state}", exc) from exc

    def _ah(self, ah: dict[str, Any]) -> Any:
        lib = self.lib
        gr = None
        if ah["is_global"]:
            gid = lib.GID(str(ipaddress.IPv6Address(ah["dgid"]).exploded))
            gr = lib.GlobalRoute(dgid=gid, flow_label=0, sgid_index=ah["sgid_index"],
                                 hop_limit=ah["hop_limit"], traffic_class=ah["traffic_class"])
        return lib.AHAttr(dlid=ah["dlid"], sl=ah["sl"], src_path_bits=0, static_rate=0,
                          is_global=ah["is_global"], port_num=ah["port_num"], gr=gr)

    def to_error(self) -> None:
        """Move the queue pair to the error state: no more incoming writes land, and
        every outstanding work request is flushed. Never raises."""
        if self.qp is None or self._closed:
            return
        attr = self.lib.QPAttr()
        attr.qp_state = self._e.IBV_QPS_ERR
        with contextlib.suppress(Exception):
            self.qp.modify(attr, int(self._e.IBV_QP_STATE))

    def state(self) -> int:
        if self.qp is None:
            raise VerbsError(f"queue pair {self.qpn} is destroyed")
        try:
            return int(self.qp.qp_state)
        except self.lib.PyverbsError as exc:
            raise _fail(f"querying queue pair {self.qpn}", exc) from exc

    def post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> None:
        lib = self.lib
        sge = lib.SGE(addr, length, lkey)
        try:
            self.qp.post_recv(lib.RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))
        except lib.PyverbsError as exc:
            raise _fail(f"posting a receive on queue pair {self.qpn}", exc) from exc

    def post_send(self, wr_id: int, op: str, addr: int, length: int, lkey: int, *,
                  rkey: int = 0, remote: int = 0, imm: int = 0) -> None:
        """Post one signalled ``SEND``, ``WRITE``, ``WRITE_IMM`` or ``READ`` (into the
        local SGE, from ``remote``) of one SGE."""
        lib = self.lib
        sge = lib.SGE(addr, length, lkey)
        wr = lib.SendWR(wr_id=wr_id, opcode=self._ops[op], num_sge=1, imm_data=imm, sg=[sge],
                        send_flags=self._signaled)
        if op != SEND:
            wr.set_wr_rdma(rkey, remote)
        try:
            self.qp.post_send(wr)
        except lib.PyverbsError as exc:
            raise _fail(f"posting a {op} on queue pair {self.qpn}", exc) from exc

    def poll(self, n: int) -> list[Completion]:
        """Up to ``n`` completions (never blocks)."""
        try:
            _count, wcs = self.cq.poll(n)
        except self.lib.PyverbsError as exc:
            raise _fail(f"polling the completion queue of queue pair {self.qpn}", exc) from exc
        return [Completion(int(w.wr_id), int(w.status), int(w.opcode), int(w.byte_len),
                           int(w.imm_data), int(w.vendor_err)) for w in wcs]

    def take_events(self) -> int:
        """Read and acknowledge the completion events waiting on the channel (never
        blocks); returns how many there were."""
        got = 0
        while True:
            try:
                self.channel.get_cq_event(self.cq)
            except self.lib.PyverbsError as exc:
                code = getattr(exc, "error_code", -1)
                if code in (errno.EAGAIN, errno.EWOULDBLOCK, -1):
                    break
                raise _fail(f"reading the completion channel of {self.qpn}", exc) from exc
            got += 1
        if got:
            self.cq.ack_events(got)
        return got

    def arm(self) -> None:
        """Ask for an event on the channel at the next completion."""
        try:
            self.cq.req_notify()
        except self.lib.PyverbsError as exc:
            raise _fail(f"arming the completion queue of {self.qpn}", exc) from exc

    def close(self) -> None:
        """Destroy the queue pair, then its completion queue and channel. Never raises."""
        self._closed = True
        for name in ("qp", "cq", "channel"):
            obj = getattr(self, name)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
                setattr(self, name, None)


def settings_summary(settings: QpSettings) -> str:
    return (f"timeout {settings.timeout} ({settings.ack_timeout_s * 1e3:.3g} ms), retry_cnt "
            f"{settings.retry_cnt}, rnr_retry {settings.rnr_retry}")
