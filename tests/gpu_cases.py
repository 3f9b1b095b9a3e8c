"""GPU helpers shared by tests/test_gpu.py and the cross-process GPU rank (mp_gpu.py):
``check_all``'s ``dev``/``host`` for CuPy memory (bfloat16 as a DeviceView, since CuPy has
no bfloat16)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from acoll._dtypes import BFLOAT16

try:
    import cupy as cp

    NGPUS = int(cp.cuda.runtime.getDeviceCount())
    NO_GPU_REASON = "" if NGPUS else "CuPy found no CUDA device"
except Exception as exc:  # ImportError, or CUDARuntimeError without a driver/device
    cp = None
    NGPUS = 0
    NO_GPU_REASON = f"no CuPy/GPU ({type(exc).__name__}: {exc})"


def to_device(device: int) -> Callable[[np.ndarray[Any, Any]], Any]:
    """A NumPy array copied to GPU ``device``: a CuPy array, or a DeviceView for bf16."""
    from acoll._memory.cuda import DeviceView

    def dev(arr: np.ndarray[Any, Any]) -> Any:
        arr = np.ascontiguousarray(arr)
        with cp.cuda.Device(device):
            if arr.dtype == BFLOAT16:
                raw = cp.asarray(arr.view(np.uint16))
                return DeviceView(int(raw.data.ptr), arr.size, BFLOAT16, device, raw)
            return cp.asarray(arr)

    return dev


def to_host(buf: Any) -> np.ndarray[Any, Any]:
    """A GPU buffer (CuPy array or DeviceView) copied to a NumPy array (synchronously).

    The caller awaited the op that wrote it, so no device-wide synchronize: with several
    ranks driving GPUs from this thread, that would wait for a peer's P2P kernel which
    waits for a rank this thread has not launched yet.
    """
    from acoll._memory.cuda import DeviceView

    if isinstance(buf, DeviceView):
        out = np.empty(buf.size, buf.dtype)
        if buf.nbytes:
            with cp.cuda.Device(buf.device):
                cp.cuda.runtime.memcpy(out.ctypes.data, buf.ptr, buf.nbytes, 2)
        return out
    with buf.device:
        return cp.asnumpy(buf)  # type: ignore[no-any-return]


def count_scale_launches(monkeypatch: Any) -> list[int]:
    """Record the element count of every AVG scaling kernel the CUDA space launches from
    now on (the kernels still run); returns the list it appends to."""
    from acoll._memory import cuda as cuda_space
    launched: list[int] = []
    real = cuda_space.launch_scale

    def counted(*args: Any, **kw: Any) -> Any:
        launched.append(args[2])
        return real(*args, **kw)

    monkeypatch.setattr(cuda_space, "launch_scale", counted)
    return launched
