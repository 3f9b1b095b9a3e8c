"""GPU building blocks (CuPy): reduction kernels and loop-friendly completion waits.

Nothing here imports CuPy at import time: kernel sources can be generated and inspected on
machines without a GPU; launching or waiting raises :class:`CudaUnavailable` there.
"""

from __future__ import annotations

from typing import Any

from ..errors import AcollError

__all__ = ["CudaUnavailable", "import_cupy"]


class CudaUnavailable(AcollError, RuntimeError):
    """CuPy (or a CUDA device) is missing, so GPU work cannot be launched or awaited."""


def import_cupy() -> Any:
    """The ``cupy`` module; :class:`CudaUnavailable` if it cannot be imported."""
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailable("GPU buffers need CuPy (pip install cupy-cuda12x or "
                              f"cupy-cuda13x matching your CUDA): {exc}") from exc
    return cupy
