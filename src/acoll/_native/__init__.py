"""The native ring (``ring.c``): compiled on first use, cached, called through ctypes.

The C file holds the data path of ring all-reduce, reduce-scatter and all-gather over two
TCP sockets (its header comment states the contract), and the element loops it reduces
with, which acoll's host reductions of 16-bit floats also call once it is loaded
(:func:`acoll._dtypes.combiner`: NumPy's own float16 loops are 10 to 30 times slower).
It is built with the system's C compiler (``ACOLL_NATIVE_CC``, default ``cc``) into a
cache folder (``ACOLL_NATIVE_CACHE``, default ``$XDG_CACHE_HOME/acoll`` or
``~/.cache/acoll``) under a name that hashes the source, the compiler's identity and the
flags, so that a changed file or compiler builds again and concurrent first uses (several
ranks starting at once) each write a private file and move it into place. A ctypes call
runs without the GIL, which is the point: the loop thread and the other ranks' Python
threads run while the C code moves and reduces the data.

Nothing here may run on an event loop's thread when it can take long: :func:`load` is
the blocking entry (a compile takes about a second); :func:`load_async` runs it on a worker
thread. Where no compiler works, :func:`load` returns ``None`` and says why at INFO; the
Python ring then does the work, with the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

from .._config import Setting, get_logger, parse_bool
from .._dtypes import use_native_halves
from .._offloop import in_thread

__all__ = ["NR", "NativeLib", "Stage", "State", "load", "load_async"]

log = get_logger("NET")

CC = Setting("NATIVE_CC", str, "cc", "C compiler that builds acoll's native ring (once, "
             "cached; ACOLL_NATIVE=0 or no working compiler: the Python ring).", "NET")
CACHE = Setting("NATIVE_CACHE", str, "",
                "Folder for the compiled native ring (empty: $XDG_CACHE_HOME/acoll or "
                "~/.cache/acoll).", "NET")

SIMD = Setting("NATIVE_SIMD", parse_bool, True,
                "The native library's 16-bit float loops use AVX2 and F16C where the CPU "
                "has them (0: plain C loops; the results are the same bits).", "NET")

_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing")
_LIBS = ("-ldl",)  # (dlopen: in the C library itself from glibc 2.34; harmless there)
HEADER_SIZE = 32


class NR:
    """Return codes of ``acoll_nr_allreduce`` (``ring.c``)."""

    OK = 0
    PEER_CLOSED = 1
    SEND_FAILED = 2
    RECV_FAILED = 3
    ABORTED = 4
    DEADLINE = 5
    MISMATCH = 6
    BAD_ARGS = 7
    NO_MEMORY = 8


class State(ctypes.Structure):
    """``nr_state``: progress counters, the errno of a failed socket call, the abort word."""

    _fields_ = [("sent", ctypes.c_int64), ("received", ctypes.c_int64),
                ("err", ctypes.c_int32), ("abort", ctypes.c_int32)]


class Stage(ctypes.Structure):
    """``nr_stage``: a staged all-reduce's copy counters (``ring.c``'s contract)."""

    _fields_ = [("ready", ctypes.c_void_p), ("final", ctypes.c_void_p),
                ("ready_base", ctypes.c_uint32), ("final_base", ctypes.c_uint32),
                ("piece", ctypes.c_int64)]


class NativeLib:
    """The loaded library: :meth:`run` blocks its (worker) thread, GIL released."""

    ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = 0, 1, 2  # modes of ``acoll_nr_run``

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        fn = lib.acoll_nr_run
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(State), ctypes.c_char_p,
                       ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(Stage)]
        self._fn = fn
        lib.acoll_nr_version.restype = ctypes.c_int
        self.version = int(lib.acoll_nr_version())
        #: ``acoll_nr_reduce(out, a, b, n, dtype, op)`` and ``acoll_nr_scale(out, a, n,
        #: dtype, factor)``: the ring's element loops on their own, for 16-bit floats
        #: (:func:`acoll._dtypes.combiner`); addresses as ints
        self.reduce = lib.acoll_nr_reduce
        self.reduce.restype = ctypes.c_int
        self.reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        self.scale = lib.acoll_nr_scale
        self.scale.restype = ctypes.c_int
        self.scale.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int, ctypes.c_float]
        self._set_simd = lib.acoll_nr_set_simd
        self._set_simd.restype = ctypes.c_int
        self._set_simd.argtypes = [ctypes.c_int]
        #: whether the 16-bit float loops run on AVX2 and F16C (else plain C: same bits)
        self.simd = self.set_simd(SIMD.resolve())
        self._lib = lib

    def set_simd(self, on: bool) -> bool:
        """Run the 16-bit float loops on AVX2/F16C where the CPU has them (``on``), or
        as plain C; returns whether the vector loops now run (the results are the same
        bits either way: tests compare both)."""
        self.simd = bool(self._set_simd(1 if on else 0))
        return self.simd

    def run(self, mode: int, send_fd: int, recv_fd: int, src: int, dst: int, scratch: int,
            count: int, dtype: int, op: int, rank: int, nranks: int, send_items: int,
            deadline_ns: int, state: State, header: bytes, inline_max: int = -1,
            stage: Stage | None = None) -> tuple[int, int, bytes]:
        """Run one ring collective (see ``acoll_nr_run`` in ``ring.c``); returns (code,
        side, the previous rank's header). ``side``: 1 the receiving side failed first, 2
        the sending side, 0 no failure. ``count``: items per rank's block (all_reduce: of
        the whole buffer). ``inline_max``: a call sending at most this many bytes runs on
        the calling thread alone (no helper thread; -1: never). ``stage``: an all-reduce's
        copy counters (the staged all-reduce of ``ring.c``'s contract)."""
        peer = ctypes.create_string_buffer(HEADER_SIZE)
        which = ctypes.c_int(0)
        code = self._fn(mode, send_fd, recv_fd, src, dst, scratch or None, count, dtype, op,
                        rank, nranks, send_items, inline_max, deadline_ns,
                        ctypes.byref(state), header, peer, ctypes.byref(which),
                        None if stage is None else ctypes.byref(stage))
        return int(code), int(which.value), peer.raw


_lock = threading.Lock()
_loaded: dict[tuple[str, str], NativeLib | None] = {}


def _cache_dir() -> Path:
    given = CACHE.resolve()
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "acoll"


def source(name: str = "ring") -> bytes:
    """The C source ``name``.c, as packaged (``ring`` or ``launch``)."""
    return resources.files(__package__).joinpath(f"{name}.c").read_bytes()


def _compiler_id(cc: list[str]) -> str:
    out = subprocess.run([*cc, "--version"], capture_output=True, timeout=30, check=True)
    return out.stdout.decode(errors="replace").splitlines()[0] if out.stdout else cc[0]


def build(cc: str | None = None, cache: Path | None = None, name: str = "ring") -> Path:
    """Compile ``name``.c (``ring.c`` unless told) into the cache (if not there yet) and
    return the library's path.

    Raises:
        OSError, subprocess.SubprocessError: no compiler, or it failed (its output is in
            the message).
    """
    argv = shlex.split(cc if cc is not None else CC.resolve())
    if not argv:
        raise OSError("ACOLL_NATIVE_CC is empty")
    src = source(name)
    ident = _compiler_id(argv)
    digest = hashlib.sha256(src + ident.encode() + " ".join(_FLAGS + _LIBS).encode()
                            + os.uname().machine.encode()).hexdigest()[:20]
    folder = cache if cache is not None else _cache_dir()
    target = folder / f"acoll-{name}-{digest}.so"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder)
    if target.exists():
        _check_private(target)
        return target
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        c_file = Path(tmp) / f"{name}.c"
        c_file.write_bytes(src)
        out = Path(tmp) / f"{name}.so"
        done = subprocess.run([*argv, *_FLAGS, "-o", str(out), str(c_file), *_LIBS],
                              capture_output=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{' '.join(argv)} failed ({done.returncode}): "
                          f"{done.stderr.decode(errors='replace').strip()[-2000:]}")
        os.replace(out, target)  # (atomic: a concurrent build's file is as good)
    log.info("native %s built: %s (%s)", name, target, ident)
    return target


def _check_private(path: Path) -> None:
    """Refuse a cache folder or library that another user could have written: the name
    of the library follows from the public source, so a folder others can write to
    would let them plant code that every rank loads."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} is not private to this user (owner {st.st_uid}, mode "
                      f"{st.st_mode & 0o777:o}): not loading code from it; set "
                      "ACOLL_NATIVE_CACHE to a folder only you can write")


def load(cc: str | None = None) -> NativeLib | None:
    """The native ring, built if needed; ``None`` (the reason logged) where it cannot be.

    Blocking (a first build takes about a second): call it off the event loop's thread.
    """
    key = (cc if cc is not None else CC.resolve(), str(_cache_dir()))
    with _lock:
        if key in _loaded:
            return _loaded[key]
        lib: NativeLib | None
        try:
            lib = NativeLib(build(key[0]))
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            log.info("native ring unavailable (the Python ring runs instead): %s", exc)
            lib = None
        else:
            use_native_halves(lib.reduce, lib.scale)
        _loaded[key] = lib
        return lib


async def load_async(cc: str | None = None) -> NativeLib | None:
    """:func:`load` on a worker thread (the event loop keeps running)."""
    key = (cc if cc is not None else CC.resolve(), str(_cache_dir()))
    if key in _loaded:  # (read without the lock: a finished entry never changes)
        return _loaded[key]
    return await in_thread(functools.partial(load, cc))
