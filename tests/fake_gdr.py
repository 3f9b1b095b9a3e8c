"""A fake CUDA driver and a fake ``/sys`` for GPUDirect RDMA tests (no GPU, no NIC here).

:class:`FakeCudaDriver` implements :class:`acoll._transport.rdma.gdr.CudaDriver` over
"device allocations" that are host NumPy arrays (a :class:`~fake_device.FakeDeviceSpace`
buffer's memory): ``cuMemGetAddressRange`` finds the tracked allocation holding a
pointer (``CUDA_ERROR_INVALID_VALUE`` otherwise), ``cuMemGetHandleForAddressRange``
exports page-aligned ranges of one allocation as dma-buf descriptors the verbs test
double accepts (:func:`verbs_double.export_dmabuf`). It is installed where the transport
would load ``libcuda`` (``gdr.provided``); nothing of the real driver is patched.

:func:`make_sysfs` builds the few ``/sys`` entries the topology code reads: PCI devices
under root complexes, ``/sys/bus/pci/devices/<bdf>`` and
``/sys/class/infiniband/<dev>/device`` links, NUMA nodes, peer-memory version files.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from acoll._memory import Buffer
from acoll._transport.rdma import gdr
from fake_device import FakeDeviceSpace
from verbs_double import Fabric, export_dmabuf

__all__ = ["FakeCudaDriver", "GPU_BUS", "make_sysfs"]

GPU_BUS = "0000:03:00.0"
_PAGE = 4096


class FakeCudaDriver:
    """See the module doc. ``cc_major``: compute capability; ``dmabuf``: the GPU exports
    dma-bufs; ``fail``: ``{call name: CUresult}`` to fail a call with."""

    def __init__(self, *, cc_major: int = 8, dmabuf: bool = True, bus: str = GPU_BUS,
                 fail: dict[str, int] | None = None) -> None:
        self.cc_major = cc_major
        self.dmabuf = dmabuf
        self.bus = bus
        self.fail = dict(fail or {})
        self._allocs: dict[int, tuple[int, weakref.ref[Any]]] = {}  # base -> (size, owner)
        self.exported: list[int] = []  # descriptors handed out
        self.calls: list[str] = []

    # -- the fake GPU's memory
    def track(self, arr: np.ndarray[Any, Any]) -> None:
        """Make ``arr``'s memory a device allocation (for as long as ``arr`` lives)."""
        base = int(arr.__array_interface__["data"][0])
        self._allocs[base] = (arr.nbytes, weakref.ref(arr))

    def _find(self, ptr: int) -> tuple[int, int] | None:
        for base, (size, ref) in list(self._allocs.items()):
            if ref() is None:
                del self._allocs[base]
            elif base <= ptr < base + max(size, 1):
                return base, size
        return None

    def contains(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` overlaps the bytes of fake GPU memory.

        Exact bytes, not pages: a fake allocation is host memory that may share a page
        with real host buffers (a GPU's never does), and a host buffer next to it must not
        count as device memory (that made registrations of small host buffers fail at
        random, by where malloc put them). A device registration rounded out to pages
        still overlaps its allocation's bytes."""
        for base, (size, ref) in self._allocs.items():
            if ref() is not None and addr < base + size and base < addr + length:
                return True
        return False

    def buffer(self, obj: Any, space: FakeDeviceSpace) -> Buffer:
        """``obj`` (bytes, bytearray, NumPy array) as a device buffer of ``space`` over
        the same memory, tracked as an allocation."""
        if isinstance(obj, np.ndarray):
            arr = obj.reshape(-1).view(np.uint8)
        else:
            arr = np.frombuffer(obj, np.uint8)
        self.track(arr)
        return Buffer(arr, space)

    # -- CudaDriver
    def _check(self, name: str) -> None:
        self.calls.append(name)
        rc = self.fail.get(name)
        if rc is not None:
            raise gdr.GdrError(f"{name} failed: CUresult {rc}")

    def attribute(self, attr: int, ordinal: int) -> int:
        self._check("cuDeviceGetAttribute")
        if attr == gdr.ATTR_CC_MAJOR:
            return self.cc_major
        if attr == gdr.ATTR_DMA_BUF_SUPPORTED:
            return int(self.dmabuf)
        raise gdr.GdrError(f"cuDeviceGetAttribute failed: attribute {attr} unknown here")

    def pci_bus_id(self, ordinal: int) -> str:
        self._check("cuDeviceGetPCIBusId")
        return self.bus

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        self._check("cuMemGetAddressRange")
        found = self._find(ptr)
        if found is None:
            raise gdr.GdrError("cuMemGetAddressRange failed: CUDA_ERROR_NOT_FOUND (500)")
        return found

    def dmabuf_fd(self, start: int, length: int, ordinal: int) -> int:
        """Exports whole pages of one allocation (page-aligned ``start`` and ``length``,
        within the allocation's pages)."""
        self._check("cuMemGetHandleForAddressRange")
        if not self.dmabuf:
            raise gdr.GdrError("cuMemGetHandleForAddressRange failed: "
                               "CUDA_ERROR_NOT_SUPPORTED (801)")
        ok = False
        if length > 0 and not start % _PAGE and not length % _PAGE:
            for base, (size, ref) in self._allocs.items():
                lo, hi = base - base % _PAGE, -(-(base + size) // _PAGE) * _PAGE
                if ref() is not None and lo <= start and start + length <= hi:
                    ok = True
        if not ok:
            raise gdr.GdrError("cuMemGetHandleForAddressRange failed: "
                               "CUDA_ERROR_INVALID_VALUE (1)")
        fd = export_dmabuf(start, length)
        self.exported.append(fd)
        return fd


def make_sysfs(root: Path, *, gpu: list[str], nics: dict[str, list[str]],
               gpu_numa: int = 0, nic_numa: int = 0, peermem: str | None = None) -> Path:
    """A fake ``/sys`` under ``root``: the GPU at PCI path ``gpu`` (root complex first,
    then the functions down to the device, e.g. ``["pci0000:00", "0000:00:01.0",
    "0000:03:00.0"]``) and each RDMA device of ``nics`` likewise; ``peermem``: a
    peer-memory version file to create (``module/nvidia_peermem/version``). Returns
    ``root`` (pass it as ``gdr.provided(..., sysfs=root)``)."""
    sys = root / "sys"

    def device(path: list[str], numa: int) -> Path:
        where = sys / "devices" / Path(*path)
        where.mkdir(parents=True, exist_ok=True)
        (where / "numa_node").write_text(f"{numa}\n")
        return where

    gdir = device(gpu, gpu_numa)
    links = sys / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(gdir, links / gpu[-1])
    for name, path in nics.items():
        ndir = device(path, nic_numa)
        cls = sys / "class" / "infiniband" / name
        cls.mkdir(parents=True, exist_ok=True)
        os.symlink(ndir, cls / "device")
    if peermem is not None:
        version = sys / peermem
        version.parent.mkdir(parents=True, exist_ok=True)
        version.write_text("1.0\n")
    return root


def attach(fabric: Fabric, driver: FakeCudaDriver) -> Fabric:
    """Tell ``fabric`` which addresses are the fake GPU's (peer-memory rule)."""
    fabric.device_memory = driver.contains
    return fabric
