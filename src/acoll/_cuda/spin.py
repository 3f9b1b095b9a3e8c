"""A GPU kernel that busy-waits for a given time (for tests and benchmarks of waits)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import import_cupy

__all__ = ["SPIN_SOURCE", "spin"]

SPIN_SOURCE = r"""
extern "C" __global__ void acoll_spin(unsigned long long ns, int* flag) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
  if (flag != 0) {
    __threadfence_system();
    *(volatile int*)flag = 1;
  }
}
"""

_kernel: list[Any] = []


def spin(seconds: float, stream: Any = None, flag: Any = None) -> None:
    """Enqueue one thread spinning ``seconds`` on ``stream``, then setting ``flag[0] = 1``
    (``flag``: an int32 CuPy array, optional)."""
    cp = import_cupy()
    if not _kernel:
        _kernel.append(cp.RawKernel(SPIN_SOURCE, "acoll_spin"))
    ptr = 0 if flag is None else flag.data.ptr
    _kernel[0]((1,), (1,), (np.uint64(int(seconds * 1e9)), np.uint64(ptr)), stream=stream)
