"""GPUDirect RDMA: whether the NIC may read and write a GPU's memory, and how to register it.

NCCL's ``net_ib`` rules, in pieces that are tested on plain values:

- **Support.** dma-buf (the upstream path): the NIC's kernel driver registers dma-buf
  memory regions (probed once per device with ``ibv_reg_dmabuf_mr`` on descriptor -1:
  ``EOPNOTSUPP``/``EPROTONOSUPPORT`` means no, anything else, ``EBADF`` normally, yes; see
  :func:`~.verbs.Device.probe_dmabuf`), pyverbs can pass it a descriptor (rdma-core v44 and
  later), the GPU exports dma-bufs (``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``) and
  ``ACOLL_DMABUF_ENABLE`` allows it. Legacy peer memory: the ``nvidia_peermem`` (or
  ``nv_peer_mem``) kernel module is loaded (:func:`peermem_loaded`); then an ordinary
  memory registration of a device pointer works.
- **Distance.** The NIC and the GPU must be close enough on the PCI tree:
  :func:`pci_distance` classifies their sysfs paths as NCCL's path types ``LOC`` < ``PIX``
  < ``PXB`` < ``PHB`` < ``SYS``, and GPUDirect is used up to ``ACOLL_NET_GDR_LEVEL``
  (default ``PXB``, as ``NCCL_NET_GDR_LEVEL``).
- **Flush.** On GPUs before compute capability 9.0 the NIC's writes may still be in
  flight inside the GPU when their completion reaches the CPU; a receive into GPU memory
  then ends with an RDMA READ of one byte of it (NCCL's ``iflush``), unless
  ``ACOLL_GDR_FLUSH_DISABLE=1``. ``ACOLL_NET_FORCE_FLUSH=1`` flushes on every GPU.

:func:`decide` turns those facts into one :class:`GdrChoice` (its ``why`` is the INFO
line). CUDA driver calls go through a :class:`CudaDriver`: :class:`LibCuda` calls
``libcuda`` through ctypes; tests install a fake with :func:`provided`, as the verbs
adapter does for pyverbs. Driver failures become :class:`GdrError` (a
:class:`~acoll.errors.TransportError`) naming the call and the CUDA error.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..._config import Setting, parse_bool
from ...errors import InvalidUsage, TransportError

__all__ = ["DMABUF_ENABLE", "FLUSH_DISABLE", "FORCE_FLUSH", "GDR_LEVEL", "CudaDriver",
           "Distance", "GdrChoice", "GdrError", "GdrMode", "LibCuda", "decide",
           "dmabuf_range", "flush_needed", "get_driver", "nic_pci_path", "gpu_pci_path",
           "parse_level", "pci_distance", "peermem_loaded", "provided", "sysfs_root"]


class Distance(enum.IntEnum):
    """How far apart two PCI devices are (NCCL's path types, nearest first)."""

    LOC = 0  #: the same device
    PIX = 1  #: through at most one PCIe switch
    PXB = 2  #: through several PCIe switches, not the host bridge
    PHB = 3  #: through the CPU's PCIe host bridge
    SYS = 4  #: across the link between CPU sockets (NUMA nodes)


def parse_level(text: str) -> Distance:
    """``ACOLL_NET_GDR_LEVEL``'s value: a path type name (``LOC``, ``PIX``, ``PXB``,
    ``PHB``, ``SYS``; any case).

    Raises:
        InvalidUsage: anything else.
    """
    try:
        return Distance[text.strip().upper()]
    except KeyError:
        raise InvalidUsage(f"ACOLL_NET_GDR_LEVEL={text!r}: one of LOC, PIX, PXB, PHB, "
                           "SYS") from None


GDR_LEVEL = Setting("NET_GDR_LEVEL", parse_level, Distance.PXB,
                    "Farthest GPU-NIC distance at which the NIC reads and writes GPU memory "
                    "directly (LOC, PIX, PXB, PHB, SYS; NCCL_NET_GDR_LEVEL).", "NET")
DMABUF_ENABLE = Setting("DMABUF_ENABLE", parse_bool, True,
                        "Register GPU memory with the NIC through dma-buf when the stack "
                        "supports it.", "NET")
FLUSH_DISABLE = Setting("GDR_FLUSH_DISABLE", parse_bool, False,
                        "Skip the RDMA READ that orders a GPUDirect receive before its "
                        "consumers (GPUs before compute capability 9.0).", "NET")
FORCE_FLUSH = Setting("NET_FORCE_FLUSH", parse_bool, False,
                      "Flush GPUDirect receives on every GPU, also from compute "
                      "capability 9.0 on.", "NET")


class GdrError(TransportError):
    """A CUDA driver call that GPUDirect RDMA needs failed (the call and error named)."""


# ---------------------------------------------------------------------------- topology
def _chain(path: str) -> tuple[str, list[str]]:
    """``(root complex, PCI functions from the root port down)`` of a sysfs device path
    (``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0``)."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return part, parts[i + 1:]
    raise ValueError(f"{path!r} is not a sysfs PCI device path")


def pci_distance(gpu_path: str, nic_path: str, gpu_numa: int = -1,
                 nic_numa: int = -1) -> Distance:
    """The distance between a GPU and a NIC from their resolved sysfs paths.

    Under one root complex: the same function is ``LOC``; devices below one PCIe switch
    (each at most one bridge below the deepest bridge they share) are ``PIX``; deeper
    trees are ``PXB``; devices on different root ports are ``PHB``. Under different root
    complexes: ``SYS`` when both NUMA nodes are known and differ, else ``PHB``. (NCCL
    builds the same path types from the whole topology; sysfs alone cannot see NVLink or
    C2C links, which only GPU-GPU and Grace paths use.)

    Raises:
        ValueError: a path is not a sysfs PCI device path.
    """
    groot, gchain = _chain(gpu_path)
    nroot, nchain = _chain(nic_path)
    if not gchain or not nchain:
        raise ValueError("a sysfs PCI path names a root complex, not a device")
    if groot != nroot:
        return Distance.SYS if 0 <= gpu_numa != nic_numa >= 0 else Distance.PHB
    if gchain == nchain:
        return Distance.LOC
    common = 0
    for a, b in zip(gchain, nchain, strict=False):
        if a != b:
            break
        common += 1
    if common == 0:
        return Distance.PHB
    below = max(len(gchain), len(nchain)) - common  # bridges + the device, deepest side
    return Distance.PIX if below <= 2 else Distance.PXB


_root = ["/"]


def sysfs_root() -> str:
    """Where ``/sys`` is looked for (``/`` unless a test changed it with
    :func:`provided`)."""
    return _root[0]


def _sys(*parts: str) -> str:
    return os.path.join(_root[0], "sys", *parts)


def _numa(device_dir: str) -> int:
    try:
        with open(os.path.join(device_dir, "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def gpu_pci_path(bus_id: str) -> tuple[str, int]:
    """The resolved sysfs path and NUMA node of the PCI device ``bus_id``
    (``0000:05:00.0``, as ``cuDeviceGetPCIBusId`` gives it)."""
    path = os.path.realpath(_sys("bus", "pci", "devices", bus_id.lower()))
    return path, _numa(path)


def nic_pci_path(device: str) -> tuple[str, int]:
    """The resolved sysfs path and NUMA node of RDMA device ``device`` (``mlx5_0``)."""
    path = os.path.realpath(_sys("class", "infiniband", device, "device"))
    return path, _numa(path)


_PEERMEM = (("kernel", "mm", "memory_peers", "nv_mem", "version"),
            ("kernel", "mm", "memory_peers", "nv_mem_nc", "version"),
            ("module", "nvidia_peermem", "version"))


def peermem_loaded() -> bool:
    """Whether a peer-memory module lets ``ibv_reg_mr`` take GPU pointers (NCCL's check:
    ``nv_peer_mem``'s or ``nvidia_peermem``'s version file exists)."""
    return any(os.path.exists(_sys(*parts)) for parts in _PEERMEM)


# ---------------------------------------------------------------------------- deciding
class GdrMode(enum.Enum):
    DMABUF = "dma-buf"
    PEERMEM = "peer memory"


@dataclass(frozen=True)
class GdrChoice:
    """Whether device buffers go straight to the NIC, how, and why (the INFO line)."""

    mode: GdrMode | None
    why: str
    flush: bool = False

    @property
    def enabled(self) -> bool:
        return self.mode is not None


def flush_needed(cc_major: int, *, disabled: bool, forced: bool) -> bool:
    """Whether GPUDirect receives end with a flush: GPUs before compute capability 9.0
    (NCCL's ``ncclTopoNeedFlush``), or ``forced``; never when ``disabled``."""
    return not disabled and (forced or cc_major < 9)


def decide(*, gpu: str, nic: str, distance: Distance | None, level: Distance,
           nic_dmabuf: tuple[bool, str], gpu_dmabuf: bool, dmabuf_enable: bool,
           peermem: bool, flush: bool) -> GdrChoice:
    """Choose GPUDirect for GPU ``gpu`` and RDMA device ``nic`` (names for the message).

    ``distance``: from :func:`pci_distance` (``None``: unknown, treated as too far);
    ``nic_dmabuf``: the NIC probe's answer and its reason. dma-buf is preferred, then peer
    memory; otherwise device buffers are staged through host memory.
    """
    prefix = f"GPUDirect RDMA {gpu} <-> {nic}"
    if distance is None:
        return GdrChoice(None, f"{prefix}: off (their PCI distance is unknown); staging "
                               "through host memory")
    if distance > level:
        return GdrChoice(None, f"{prefix}: off (too far: distance {distance.name} > "
                               f"ACOLL_NET_GDR_LEVEL {level.name}); staging through host "
                               "memory")
    reasons = []
    if not dmabuf_enable:
        reasons.append("dma-buf disabled by ACOLL_DMABUF_ENABLE=0")
    elif not nic_dmabuf[0]:
        reasons.append(f"no dma-buf: {nic_dmabuf[1]}")
    elif not gpu_dmabuf:
        reasons.append(f"no dma-buf: {gpu} does not export dma-bufs")
    else:
        return GdrChoice(GdrMode.DMABUF, f"{prefix}: dma-buf (distance {distance.name}, "
                                         f"flush {'on' if flush else 'off'})", flush)
    if peermem:
        return GdrChoice(GdrMode.PEERMEM, f"{prefix}: peer memory (nvidia_peermem; "
                                          f"distance {distance.name}, flush "
                                          f"{'on' if flush else 'off'}; "
                                          f"{reasons[0]})", flush)
    reasons.append("no peer memory module (nvidia_peermem)")
    return GdrChoice(None, f"{prefix}: off ({'; '.join(reasons)}); staging through host "
                           "memory")


def dmabuf_range(base: int, size: int, page: int) -> tuple[int, int]:
    """The page-aligned ``(start, length)`` exported as a dma-buf for an allocation of
    ``size`` bytes at ``base`` (the driver exports whole pages)."""
    start = base - base % page
    end = -(-(base + size) // page) * page
    return start, end - start


# ---------------------------------------------------------------------------- the driver
class CudaDriver(Protocol):
    """The CUDA driver calls GPUDirect RDMA makes (device ``ordinal`` as CUDA counts)."""

    def attribute(self, attr: int, ordinal: int) -> int:
        """``cuDeviceGetAttribute``."""

    def pci_bus_id(self, ordinal: int) -> str:
        """``cuDeviceGetPCIBusId`` (``0000:05:00.0``)."""

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        """``cuMemGetAddressRange``: ``(base, size)`` of the allocation holding ``ptr``."""

    def dmabuf_fd(self, start: int, length: int, ordinal: int) -> int:
        """``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)``: a
        new descriptor the caller closes."""


ATTR_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
ATTR_DMA_BUF_SUPPORTED = 124  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
_HANDLE_DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD


class LibCuda:
    """:class:`CudaDriver` over ``libcuda.so.1`` (ctypes). Every call runs with the
    device's primary context current (pushed, then popped).

    Raises:
        GdrError: the library cannot be loaded or ``cuInit`` fails.
    """

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise GdrError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._call("cuInit", ctypes.c_uint(0))

    def _name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        fn = self._lib.cuGetErrorName
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if fn(rc, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} ({rc})"
        return f"CUresult {rc}"

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise GdrError(f"{name} failed: {self._name(rc)}")

    def _device(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev

    @contextlib.contextmanager
    def _current(self, ordinal: int) -> Iterator[None]:
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                ctx = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self._device(ordinal))
                self._contexts[ordinal] = ctx
        self._call("cuCtxPushCurrent_v2", ctx)
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    def attribute(self, attr: int, ordinal: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attr),
                   self._device(ordinal))
        return int(value.value)

    def pci_bus_id(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self._call("cuDeviceGetPCIBusId", buf, ctypes.c_int(64), self._device(ordinal))
        return buf.value.decode()

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._current(ordinal):
            self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size),
                       ctypes.c_uint64(ptr))
        return int(base.value), int(size.value)

    def dmabuf_fd(self, start: int, length: int, ordinal: int) -> int:
        fd = ctypes.c_int(-1)
        with self._current(ordinal):
            self._call("cuMemGetHandleForAddressRange", ctypes.byref(fd),
                       ctypes.c_uint64(start), ctypes.c_size_t(length),
                       ctypes.c_int(_HANDLE_DMA_BUF_FD), ctypes.c_ulonglong(0))
        return int(fd.value)


_driver: list[CudaDriver | None] = [None]


def get_driver() -> CudaDriver:
    """The driver in use: the one :func:`provided` installed, else :class:`LibCuda`
    (loaded once).

    Raises:
        GdrError: no CUDA driver here.
    """
    driver = _driver[0]
    if driver is None:
        driver = _driver[0] = LibCuda()
    return driver


@contextlib.contextmanager
def provided(driver: CudaDriver | None, sysfs: str | None = None) -> Iterator[None]:
    """``with provided(fake_driver, sysfs=tmpdir):`` -- use ``driver`` and look for
    ``/sys`` under ``sysfs`` inside the block (tests)."""
    saved = (_driver[0], _root[0])
    _driver[0] = driver
    if sysfs is not None:
        _root[0] = sysfs
    try:
        yield
    finally:
        _driver[0], _root[0] = saved
