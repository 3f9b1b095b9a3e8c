"""The native launcher (``acoll/_native/launch.c``): a prepared call's enqueue in one C call.

A prepared P2P call (:mod:`acoll._p2p.fast`) enqueues a fixed sequence per rank: stream
waits, copies into the workspace, a kernel launch per step (its epoch written first), an
event record. Through CuPy and ctypes each of these costs a few microseconds of Python;
with one task driving several GPUs (:func:`acoll.group`) that is most of a small
collective's time. :class:`Launcher` hands the sequences of every local rank to C at once
(``launch.c``'s header states the contract; :class:`Job`, :class:`Step` and :class:`Copy`
mirror its structures).

The library is compiled once, like the native ring (:mod:`acoll._native`), and loads the
CUDA driver library with ``dlopen`` itself, so it builds and is tested where no GPU exists
(``tests/test_launcher.py`` drives it against a recording stand-in for the driver).

**Off by default** (``ACOLL_P2P_NATIVE=1`` turns it on; without a C compiler prepared
calls stay on their Python route, with the same results). Measured on one H200, two ranks
sharing it in one process, group-driven, 8 B to 256 KiB, alternating rounds on the same
communicators (``bench/p2p_native_ab.py``, ``bench/results/session37_h200/``): from
1 KiB to 256 KiB the native route took 1.01 to 1.11x the Python route's time per call in
28 of 30 cells (awaited and pipelined, uvloop and asyncio, three runs, before and after it
stopped switching contexts that were current already). The Python route's driver calls
cost what the C calls cost; the microseconds it spends around them are not where a small
call's time goes (the phase breakdown there: each rank's own call, 15 to 20 us, and the
wait for the kernels). Two ranks on two GPUs, where the Python route switches devices per
launch, were not measured (no such host was lent).

Calls go through :class:`ctypes.PyDLL` for :meth:`Launcher.spin` and :meth:`record`
(held GIL: a short busy wait gains nothing from releasing it and could wait a whole
switch interval to get it back) and :class:`ctypes.CDLL` for :meth:`Launcher.run`
(a launch may block while the device's launch queue is full; other threads run then).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .._config import Setting, get_logger, parse_bool
from .._offloop import in_thread

__all__ = ["AT", "AT_RECORD", "AT_THEN", "NATIVE", "Copy", "Job", "Launcher", "Step", "load",
           "load_async"]

log = get_logger("P2P")

NATIVE = Setting("P2P_NATIVE", parse_bool, False,
                 "Prepared P2P calls enqueue through acoll's C launcher (compiled once "
                 "with ACOLL_NATIVE_CC); off by default: it measured 1 to 11% slower than "
                 "the Python route on one H200 (see acoll._cuda.launcher).", "P2P")

NOT_READY = 600  # CUDA_ERROR_NOT_READY
#: ``failed_at`` values of a job: which driver call failed.
AT = {0: "none", 1: "cuCtxSetCurrent", 2: "cuStreamWaitEvent", 3: "cuMemcpyAsync",
      4: "cuLaunchKernel", 5: "cuEventRecord", 6: "cuStreamWaitEvent (caller's stream)"}
AT_RECORD, AT_THEN = 5, 6  # (LN_AT_RECORD, LN_AT_THEN)


class Copy(ctypes.Structure):
    """``ln_copy``: one copy (device addresses, unified addressing)."""

    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64),
                ("nbytes", ctypes.c_uint64)]


class Step(ctypes.Structure):
    """``ln_step``: one kernel launch, after its copies ``copies[first_copy:][:ncopies]``."""

    _fields_ = [("fn", ctypes.c_uint64), ("params", ctypes.c_uint64),
                ("epoch_field", ctypes.c_uint64), ("blocks", ctypes.c_uint32),
                ("threads", ctypes.c_uint32), ("first_copy", ctypes.c_uint32),
                ("ncopies", ctypes.c_uint32)]


class Job(ctypes.Structure):
    """``ln_job``: one rank's enqueue (``result`` and ``failed_at`` are written back)."""

    _fields_ = [("ctx", ctypes.c_uint64), ("stream", ctypes.c_uint64),
                ("wait1", ctypes.c_uint64), ("wait2", ctypes.c_uint64),
                ("record", ctypes.c_uint64), ("then_stream", ctypes.c_uint64),
                ("epoch_base", ctypes.c_uint64), ("steps", ctypes.c_uint64),
                ("copies", ctypes.c_uint64), ("nsteps", ctypes.c_int32),
                ("result", ctypes.c_int32), ("failed_at", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


#: What ``acoll_ln_layout`` must report: launch.c's structures are these (the sizes, then
#: every field's offset in order).
LAYOUT = [ctypes.sizeof(Copy), ctypes.sizeof(Step), ctypes.sizeof(Job)] + [
    getattr(t, field[0]).offset for t in (Copy, Step, Job) for field in t._fields_]


class Launcher:
    """The loaded launcher, bound to one CUDA driver library."""

    def __init__(self, path: str, driver: str = "libcuda.so.1") -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        held = ctypes.PyDLL(path)
        if lib.acoll_ln_version() != 1:
            raise OSError(f"{path}: unexpected launcher version")
        layout = (ctypes.c_uint64 * 32)()
        written = lib.acoll_ln_layout(layout)
        got = list(layout)[:written]
        if got != LAYOUT:
            raise OSError(f"{path}: the launcher's structures ({got}) are not those of "
                          f"launcher.py ({LAYOUT})")
        lib.acoll_ln_open.argtypes = [ctypes.c_char_p]
        rc = lib.acoll_ln_open(driver.encode())
        if rc != 0:
            raise OSError(f"{path}: the CUDA driver library {driver!r} "
                          f"{'cannot be loaded' if rc == -1 else 'lacks a function'}")
        self._run = lib.acoll_ln_run
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self._spin = held.acoll_ln_spin
        self._spin.argtypes = [ctypes.c_uint64, ctypes.c_int64]
        self._spin.restype = ctypes.c_int
        self._record = held.acoll_ln_record
        self._record.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
        self._record.restype = ctypes.c_int
        self._primary = held.acoll_ln_primary
        self._primary.argtypes = [ctypes.c_int]
        self._primary.restype = ctypes.c_uint64
        # Job arrays by length, reused, one set per thread: event loops in several threads
        # may launch at once, and run() releases the GIL while C reads its array.
        self._local = threading.local()

    def jobs(self, n: int) -> Any:
        """A ``Job`` array of length ``n`` for :meth:`run`, this thread's own (reused:
        fill every field)."""
        arrays: list[Any] | None = getattr(self._local, "arrays", None)
        if arrays is None:
            arrays = self._local.arrays = []
        while len(arrays) < n:
            arrays.append((Job * (len(arrays) + 1))())
        return arrays[n - 1]

    def run(self, jobs: Any, n: int) -> int:
        """Run ``jobs[:n]`` (see ``acoll_ln_run``); returns how many failed."""
        return int(self._run(ctypes.addressof(jobs), n))

    def spin(self, event: int, seconds: float) -> int:
        """Query ``event`` for up to ``seconds``; the last CUresult (0: passed)."""
        return int(self._spin(event, int(seconds * 1e9)))

    def record(self, ctx: int, event: int, stream: int) -> int:
        """Record ``event`` on ``stream`` under context ``ctx``; the CUresult."""
        return int(self._record(ctx, event, stream))

    def primary_context(self, device: int) -> int:
        """Device ``device``'s primary context (the one CuPy's runtime calls use), retained;
        0 if the driver could not give it."""
        return int(self._primary(device))


_lock = threading.Lock()
_loaded: list[Launcher | None] = []


def load() -> Launcher | None:
    """The launcher, built and bound to ``libcuda.so.1`` if it can be; ``None`` (the
    reason logged at INFO) where it cannot. Blocking (a first build takes about a
    second): off the event loop's thread. Whether it is used is for each communicator to
    say (:data:`NATIVE`)."""
    with _lock:
        if _loaded:
            return _loaded[0]
        found: Launcher | None = None
        from .. import _native
        try:
            found = Launcher(str(_native.build(name="launch")))
        except Exception as exc:  # no compiler, no driver: the Python route
            log.info("native launcher unavailable (prepared calls launch from Python): "
                     "%s", exc)
        _loaded.append(found)
        return found


async def load_async() -> Launcher | None:
    """:func:`load` on a worker thread."""
    if _loaded:
        return _loaded[0]
    return await in_thread(load)

