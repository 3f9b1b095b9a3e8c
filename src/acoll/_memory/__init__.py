"""Memory spaces (host; CUDA devices in :mod:`.cuda`, imported on demand): see :mod:`.base`."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import shared
from .base import (
    BYTE,
    Buffer,
    CopySignals,
    DirectStaging,
    DType,
    Fence,
    MemoryKind,
    MemorySpace,
    Pace,
    SignalledStaging,
    Staging,
    StreamOrder,
)
from .host import HostSpace

__all__ = ["BYTE", "Buffer", "CopySignals", "DType", "Fence", "HostSpace", "MemoryKind",
           "MemorySpace", "Pace", "DirectStaging", "SignalledStaging", "Staging", "StreamOrder",
           "host_buffer", "shared"]

_HOST = HostSpace()  # for buffers made outside any communicator (tests, transports)


def host_buffer(obj: Any) -> Buffer:
    """Bytes-like ``obj`` (bytearray, bytes, memoryview, a NumPy array) as a host buffer of
    unsigned bytes, without copying (for transports and their tests)."""
    if isinstance(obj, np.ndarray):
        arr = obj.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(obj, np.uint8) if not isinstance(obj, memoryview) else (
            np.asarray(obj.cast("B")) if obj.nbytes else np.empty(0, np.uint8))
    return _HOST.wrap(arr)
