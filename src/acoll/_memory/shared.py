"""Host memory that the other processes of this host can map: what registered host buffers
are made of (the host-side counterpart of ``ncclMemAlloc``).

:func:`empty_shared` makes a NumPy array in an allocation of its own: a memfd named
``acoll-host``, sealed against resizing (a process that maps it can never fault on a
shrunk file), whose first page holds a random token and the rest the array. A
communicator's ``register()`` hands the allocation to its local peers, which map it
through ``/proc/PID/fd`` and check the name, the size, the seals and the token before
trusting it (:func:`open_shared`); collectives on registered buffers then read the peers'
arrays in place (:mod:`acoll._comm.lane`).

The allocation lives as long as the array (or anything else holding its memory): then its
descriptor is closed and it leaves the registry; peers that mapped it keep their mapping
(the memory is freed when the last mapping goes).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import operator
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from .._config import get_logger

__all__ = ["HEADER", "SharedBlock", "empty_shared", "find", "open_shared"]

log = get_logger("INIT")

NAME = "acoll-host"
_LINK = f"/memfd:{NAME} (deleted)"  # what /proc/PID/fd/N reads for such an allocation
#: bytes before the array: the token (16 bytes) and padding to a page
HEADER = mmap.PAGESIZE
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
          if hasattr(fcntl, "F_SEAL_SHRINK") else 0)


class _Map(mmap.mmap):
    """An mmap that can be referenced weakly (the registry must not keep it alive)."""


#: Python's mmap keeps a duplicate of the descriptor it maps unless told not to (3.13+)
_NO_FD_COPY: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class SharedBlock:
    """One allocation of :func:`empty_shared`: its descriptor, size and token, and where
    its array starts in this process."""

    __slots__ = ("__weakref__", "_map", "fd", "span", "start", "token")

    def __init__(self, fd: int, span: int, start: int, token: bytes, map_: _Map) -> None:
        self.fd, self.span, self.start, self.token = fd, span, start, token
        self._map = weakref.ref(map_)

    @property
    def nbytes(self) -> int:
        """Bytes available to arrays (the span less the header)."""
        return self.span - HEADER

    def mapping(self) -> _Map | None:
        """The allocation's mapping in this process, or None once it was freed."""
        return self._map()


_lock = threading.Lock()
_blocks: dict[int, SharedBlock] = {}  # by start address


def _free(start: int, fd: int) -> None:
    with _lock:
        _blocks.pop(start, None)
    os.close(fd)


def empty_shared(shape: int | tuple[int, ...] | list[int], dtype: Any = np.float32
                 ) -> np.ndarray:
    """A new uninitialised NumPy array of ``shape`` and ``dtype`` in host memory that
    other processes of this host can map. Collectives of a communicator whose ranks are
    processes of one host read such arrays in place once registered
    (``await comm.register(x)``): the fastest host path. Sub-arrays (views) of it count
    as registered too. It costs one page more than the array and, while it lives, two
    file descriptors (one on Python 3.13 and later, whose mmap can do without its copy);
    each peer that maps it once registered holds one more (none on 3.13+).

    Raises:
        InvalidUsage: a negative or non-integer size, a size over 2**62 bytes, not a
        dtype, or a dtype without fixed-size items (object, void of size 0). OSError: the system
        has no memfd, or too little memory.
    """
    from ..errors import InvalidUsage

    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidUsage(f"empty_shared: {dtype!r} is not a dtype: {exc}") from None
    if dt.hasobject or dt.itemsize == 0 or dt.subdtype is not None:
        raise InvalidUsage(f"empty_shared: dtype {dt} has no fixed-size scalar items to "
                           "share (object, empty or sub-array dtypes)")
    raw = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    try:
        dims: tuple[int, ...] | None = tuple(operator.index(d) for d in raw)
    except TypeError:
        dims = None
    if dims is None or any(isinstance(d, bool) for d in raw) or any(d < 0 for d in dims):
        raise InvalidUsage(f"empty_shared: shape must hold non-negative ints, got {shape!r}")
    count = 1
    for d in dims:
        count *= d  # (Python ints: no wrap-around)
    nbytes = count * dt.itemsize
    if nbytes > 1 << 62:
        raise InvalidUsage(f"empty_shared: {shape!r} of {dt} is {nbytes} bytes, too many")
    span = HEADER + max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, span)
        if _SEALS:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = _Map(fd, span, **_NO_FD_COPY)
        try:
            token = os.urandom(16)
            mm[:16] = token
            arr = np.frombuffer(mm, dt, count, HEADER).reshape(dims)
        except BaseException:
            with contextlib.suppress(BufferError):
                mm.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    start = arr.__array_interface__["data"][0]
    block = SharedBlock(fd, span, start, token, mm)
    with _lock:
        _blocks[start] = block
    weakref.finalize(mm, _free, start, fd)
    return arr


def find(address: int, nbytes: int) -> tuple[SharedBlock, int] | None:
    """The live allocation holding ``[address, address + nbytes)`` and the offset of
    ``address`` in its array, or None."""
    with _lock:
        for start, block in _blocks.items():
            off = address - start
            if off >= 0 and off + nbytes <= block.span - HEADER:
                return block, off
    return None


def open_shared(pid: int, fd: int, span: int, token: bytes) -> tuple[mmap.mmap, Any]:
    """Map another process's allocation (its descriptor ``fd``, through ``/proc``) after
    checking that it is one: a memfd named ``acoll-host``, ``span`` bytes, sealed against
    resizing, holding ``token``. Returns the mapping and its array bytes (uint8), both
    read-only: peers only ever read a registered allocation.

    Raises:
        OSError: it cannot be opened. ValueError: it is not the allocation announced.
    """
    path = f"/proc/{int(pid)}/fd/{int(fd)}"
    if os.readlink(path) != _LINK:
        raise ValueError(f"{path} is not an acoll host allocation")
    sfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        if os.readlink(f"/proc/self/fd/{sfd}") != _LINK:
            raise ValueError(f"{path} is not an acoll host allocation")  # (it changed)
        size = os.fstat(sfd).st_size
        if size != span:
            raise ValueError(f"the allocation holds {size} bytes, not {span}")
        if _SEALS and fcntl.fcntl(sfd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ValueError("the allocation is not sealed against resizing")
        mm = mmap.mmap(sfd, span, prot=mmap.PROT_READ, **_NO_FD_COPY)
    finally:
        os.close(sfd)
    if mm[:16] != token:
        mm.close()
        raise ValueError(f"{path} holds another allocation (its token differs)")
    return mm, np.frombuffer(mm, np.uint8, span - HEADER, HEADER)
