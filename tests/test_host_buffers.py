"""Host buffer adaptation (``as_host_array``): DLPack exporters incl. bfloat16, and
``__array_interface__`` objects.

The bf16 path is exercised without torch by a tiny exporter: NumPy exports a uint16 array as
a DLPack capsule, and the exporter relabels the capsule's dtype as kDLBfloat/16 bits, which
is what torch hands out for a bf16 tensor (and what ``np.from_dlpack`` refuses).
"""

from __future__ import annotations

import ctypes
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import acoll
from acoll._dtypes import _capsule_is_valid, _capsule_pointer, as_host_array
from acoll.testing import run_ranks

BF16 = np.dtype(ml_dtypes.bfloat16)
_PTR = ctypes.sizeof(ctypes.c_void_p)
_get = _capsule_pointer
_valid = _capsule_is_valid


def _relabel(capsule: object, code: int, bits: int) -> object:
    """Rewrite the DLTensor dtype inside a fresh (unconsumed) capsule."""
    for name, start in ((b"dltensor_versioned", 8 + 2 * _PTR + 8), (b"dltensor", 0)):
        if _valid(capsule, name):
            at = _get(capsule, name) + start + _PTR + 8 + 4
            ctypes.c_uint8.from_address(at).value = code
            ctypes.c_uint8.from_address(at + 1).value = bits
            return capsule
    raise AssertionError("not a DLPack capsule")


class FakeExporter:
    """A CPU DLPack exporter of ``backing`` (uint16) that claims another dtype."""

    def __init__(self, backing: np.ndarray[Any, Any], *, code: int = 4, bits: int = 16,
                 versioned: bool = True, device: tuple[int, int] = (1, 0)) -> None:
        self.backing = backing
        self.code, self.bits = code, bits
        self.versioned = versioned
        self.device = device
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> object:
        self.calls.append({"max_version": max_version})
        if self.versioned and max_version is not None:
            capsule = self.backing.__dlpack__(max_version=max_version)
        else:
            capsule = self.backing.__dlpack__()
        return _relabel(capsule, self.code, self.bits)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def _numpy_exports_versioned() -> bool:
    try:
        np.zeros(1).__dlpack__(max_version=(1, 0))
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("versioned", [True, False])
def test_bf16_dlpack_is_viewed_without_copy(versioned: bool) -> None:
    if versioned and not _numpy_exports_versioned():
        pytest.skip("this NumPy cannot export DLPack >= 1.0 capsules")
    values = np.array([1.5, -2.0, 3.25, 0.0, 65280.0], dtype=BF16)
    backing = values.view(np.uint16).copy()
    arr = as_host_array(FakeExporter(backing, versioned=versioned), "buf")
    assert arr.dtype == BF16
    assert np.shares_memory(arr.view(np.uint16), backing)
    np.testing.assert_array_equal(arr.astype(np.float32), values.astype(np.float32))
    if versioned:  # a DLPack 1.0 capsule says it is writable; legacy ones import read-only
        arr = as_host_array(FakeExporter(backing), "buf", writable=True)
        arr[0] = 7.0
        assert backing.view(BF16)[0] == 7.0


def test_other_unsupported_dlpack_dtype_is_refused() -> None:
    fake = FakeExporter(np.zeros(4, np.uint32), code=4, bits=32)  # "bfloat32": no such thing
    with pytest.raises(acoll.InvalidUsage, match="buf: cannot view it as host memory"):
        as_host_array(fake, "buf")


def test_device_dlpack_buffer_is_refused() -> None:
    fake = FakeExporter(np.zeros(4, np.uint16), device=(2, 0))  # kDLCUDA
    with pytest.raises(acoll.InvalidUsage, match="buf is not in host memory"):
        as_host_array(fake, "buf")
    assert fake.calls == []  # refused before anything was exported


class ArrayInterfaceOnly:
    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self._arr = arr
        self.__array_interface__ = arr.__array_interface__


def test_array_interface_object_is_viewed() -> None:
    backing = np.arange(6, dtype=np.float32)
    arr = as_host_array(ArrayInterfaceOnly(backing), "buf", writable=True)
    assert np.shares_memory(arr, backing)
    arr[1] = 42
    assert backing[1] == 42


async def test_all_reduce_bf16_through_dlpack() -> None:
    async def fn(comm: acoll.Communicator) -> list[float]:
        backing = np.full(5, comm.rank + 1, dtype=BF16).view(np.uint16)
        await comm.all_reduce(FakeExporter(backing))
        return [float(v) for v in backing.view(BF16)]

    assert await run_ranks(3, fn) == [[6.0] * 5] * 3


# --- with torch, when installed (CI has no torch: these skip with the reason) ---------------

def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed (pip install torch)")


def test_torch_bf16_tensor_is_accepted() -> None:
    torch = _torch()
    t = torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16)
    arr = as_host_array(t, "tensor", writable=True)
    assert arr.dtype == BF16
    arr[2] = 8.0
    assert t.tolist() == [1.0, 2.5, 8.0]


async def test_torch_bf16_all_reduce() -> None:
    torch = _torch()

    async def fn(comm: acoll.Communicator) -> list[float]:
        t = torch.full((1000,), float(comm.rank) + 0.5, dtype=torch.bfloat16)
        await comm.all_reduce(t)
        return sorted(set(t.tolist()))

    assert await run_ranks(2, fn) == [[2.0], [2.0]]
