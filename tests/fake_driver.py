"""The recording stand-in for the CUDA driver (``fake_libcuda.c``), built for tests of the
native launcher (``tests/test_launcher.py``, ``tests/test_p2p_fast_cpu.py``)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from acoll import _native

HERE = Path(__file__).parent


class _Entry(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64),
                ("c", ctypes.c_uint64), ("d", ctypes.c_uint64), ("e", ctypes.c_uint64)]


def compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the native launcher cannot be built")
    return cc


def build_launcher_and_fake(folder: Path) -> tuple[Path, Path]:
    """(a private copy of the launcher library, the fake driver), built into ``folder``."""
    cc = compiler()
    lib = _native.build(cache=folder, name="launch")
    # A copy of its own (another inode): the process may load the real launcher too, and
    # the driver a library is opened with stays bound to it.
    mine = folder / "launch-under-test.so"
    shutil.copy(lib, mine)
    fake = folder / "fake_libcuda.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(fake),
                    str(HERE / "fake_libcuda.c")], check=True, timeout=120)
    return mine, fake


class FakeDriver:
    """The stand-in, loaded: its log, failures and current context."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.fake_reset.argtypes = [ctypes.c_uint64]
        self.lib.fake_current.restype = ctypes.c_uint64

    def reset(self, ctx: int = 0xC0) -> None:
        self.lib.fake_reset(ctx)

    def fail(self, kind: str, nth: int, code: int) -> None:
        self.lib.fake_fail(ord(kind), nth, code)

    def log(self) -> list[tuple[Any, ...]]:
        out = (_Entry * 256)()
        n = self.lib.fake_log(out, 256)
        rows = []
        for e in out[:n]:
            row = (chr(e.kind), e.a, e.b, e.c, e.d, e.e)
            width = {"G": 2, "S": 2, "W": 5, "C": 6, "L": 6, "R": 4, "Q": 2, "D": 2,
                     "P": 2}[row[0]]
            rows.append(row[:width])
        return rows

    @property
    def current(self) -> int:
        return int(self.lib.fake_current())
