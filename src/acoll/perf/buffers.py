"""Test buffers: where the memory a backend measures lives, and its host-side view.

The sweep allocates through an :data:`Allocator` only: host NumPy memory
(:func:`host_buffer`), torch tensors (:class:`TorchAllocator`, CPU or CUDA) or CuPy
device memory (:class:`CupyAllocator`); the sweep, the check and the backends stay as
they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dtypes import DTYPE_NAMES
from .colls import Usage

__all__ = ["Allocator", "Buffer", "CupyAllocator", "StagedBuffer", "TorchAllocator",
           "host_buffer", "shared_buffer"]


class Buffer:
    """``count`` elements of one dtype that ``host`` reaches directly.

    Contract: ``host`` is a 1-D NumPy array of the elements, which the sweep fills before an
    op and checks after; ``obj`` is what the backend hands its library (``host`` itself, or
    an object sharing its memory such as a CPU tensor) and must slice like ``host``.
    :meth:`view` returns a view of elements ``[start, start + count)`` of ``obj``, never a
    copy. :meth:`upload` (after filling) and :meth:`download` (before checking) are no-ops
    here: the memory is shared.
    """

    def __init__(self, host: npt.NDArray[Any], obj: Any = None) -> None:
        self.host = host
        self.obj = host if obj is None else obj

    def view(self, start: int, count: int) -> Any:
        """The backend's object for elements ``[start, start + count)``."""
        return self.obj[start:start + count]

    def upload(self) -> None:
        """Make ``obj`` hold what ``host`` holds."""

    def download(self) -> None:
        """Make ``host`` hold what ``obj`` holds."""


class StagedBuffer(Buffer):
    """Device memory ``obj`` with a separate host copy ``host``, copied on request.

    ``to_device(host, obj)`` and ``to_host(obj, host)`` copy every element; they may be
    asynchronous only if the copy is ordered before later work on ``obj`` (one stream).
    """

    def __init__(self, host: npt.NDArray[Any], obj: Any,
                 to_device: Callable[[npt.NDArray[Any], Any], None],
                 to_host: Callable[[Any, npt.NDArray[Any]], None]) -> None:
        super().__init__(host, obj)
        self._to_device, self._to_host = to_device, to_host

    def upload(self) -> None:
        self._to_device(self.host, self.obj)

    def download(self) -> None:
        self._to_host(self.obj, self.host)


#: ``allocator(count, dtype)``: a fresh :class:`Buffer` of ``count`` uninitialised elements.
Allocator = Callable[[int, np.dtype[Any]], Buffer]


def host_buffer(count: int, dtype: np.dtype[Any]) -> Buffer:
    """The default allocator: host memory, a NumPy array."""
    return Buffer(np.empty(count, dtype))


def shared_buffer(count: int, dtype: np.dtype[Any]) -> Buffer:
    """Host memory other processes of this host can map (:func:`acoll.empty_shared`),
    for registered buffers (``-R 1``)."""
    from .._memory.shared import empty_shared

    return Buffer(empty_shared(count, dtype))


class TorchAllocator:
    """torch tensors on ``device``: CPU tensors share memory with ``host``, others are staged."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device = torch, device

    def __call__(self, count: int, dtype: np.dtype[Any]) -> Buffer:
        torch = self.torch
        name = DTYPE_NAMES[dtype]
        tdtype = getattr(torch, name, None)
        if tdtype is None:
            raise Usage(f"torch has no dtype {name}")
        t = torch.empty(count, dtype=tdtype, device=self.device)
        if self.device.type == "cpu":
            return Buffer(t.view(torch.uint8).numpy().view(dtype) if count
                          else np.empty(0, dtype), t)

        def to_device(host: npt.NDArray[Any], dev: Any) -> None:
            dev.view(torch.uint8).copy_(torch.from_numpy(host.view(np.uint8)))

        def to_host(dev: Any, host: npt.NDArray[Any]) -> None:
            host.view(np.uint8)[:] = dev.view(torch.uint8).cpu().numpy()

        return StagedBuffer(np.empty(count, dtype), t, to_device, to_host)


class CupyAllocator:
    """CuPy memory on CUDA ``device``, staged to and from a host copy. bfloat16 (which
    CuPy lacks) is a :class:`acoll._memory.cuda.DeviceView` over the same bytes.

    Uploads and downloads run on CuPy's current stream, which acoll orders its work after
    (and its readers after acoll's), as a CuPy user's own code would.
    """

    def __init__(self, device: int) -> None:
        from .._cuda import import_cupy

        self.cp, self.device = import_cupy(), device

    def __call__(self, count: int, dtype: np.dtype[Any]) -> Buffer:
        from .._memory.cuda import DeviceView

        cp, device = self.cp, self.device
        with cp.cuda.Device(device):
            raw = cp.empty(count * dtype.itemsize, cp.uint8)
        obj: Any
        if dtype.kind == "V" or dtype.name == "bfloat16":
            obj = DeviceView(int(raw.data.ptr), count, dtype, device, raw)
        else:
            obj = raw.view(dtype)

        def to_device(host: npt.NDArray[Any], dev: Any) -> None:
            with cp.cuda.Device(device):
                raw.set(host.view(np.uint8))

        def to_host(dev: Any, host: npt.NDArray[Any]) -> None:
            with cp.cuda.Device(device):
                host.view(np.uint8)[:] = raw.get()

        return StagedBuffer(np.empty(count, dtype), obj, to_device, to_host)
