"""Run a GPU bench script on the CPU stand-in for CuPy (tests/fake_cupy.py), to check that
it runs before device time is spent on it; its timings mean nothing.

    python -m acoll.run -n 2 -- python bench/on_fake_cupy.py bench/SCRIPT.py [ARGS...]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fake_cupy
from acoll._memory import cuda as cuda_mod

cp = fake_cupy.module()
cp.float32 = np.float32  # type: ignore[attr-defined]


def _filled(value: float) -> Any:
    return lambda n, dtype=np.float32: fake_cupy.ndarray(np.full(n, value, dtype))


cp.ones, cp.zeros = _filled(1.0), _filled(0.0)  # type: ignore[attr-defined]
sys.modules["cupy"] = cp
cuda_mod.launch_reduce = fake_cupy.launch_reduce  # type: ignore[assignment]
cuda_mod.launch_finish_avg = fake_cupy.launch_finish_avg  # type: ignore[assignment]
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
