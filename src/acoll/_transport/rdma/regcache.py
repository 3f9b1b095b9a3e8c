"""Memory registration cache keyed by address range (sans-IO), NCCL's ``ncclIbMrCache``.

Registering memory with the HCA costs a system call and pins pages, so a region is
registered once and reused by every later message inside it. The cache knows nothing of
verbs: it is given ``register(addr, length, writable) -> region`` and ``deregister(region)``
callables and works on plain integers.

Correctness rests on one rule: an entry never outlives the memory it describes. Each
entry names an *owner*, the object whose lifetime is that memory's (a NumPy array that
owns its data). The cache holds the owner only weakly and drops the entry (deregistering
it) from the owner's finalizer, which runs before the memory is freed, so an address
reused by a later allocation can never hit a stale registration. An owner that cannot be
weakly referenced makes an uncached entry, deregistered as soon as it is released.

Entries in use (acquired, not yet released) are never evicted. Beyond ``max_entries``
entries or ``max_bytes`` registered bytes, the least recently used idle entries go.
A writable request needs a writable registration; a read-only one takes either.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Entry", "RegCache"]

R = TypeVar("R")


class Entry(Generic[R]):
    """One registered range ``[addr, addr + length)``."""

    __slots__ = ("__weakref__", "addr", "cached", "dead", "length", "region", "users",
                 "writable")

    def __init__(self, addr: int, length: int, writable: bool, region: R, cached: bool) -> None:
        self.addr = addr
        self.length = length
        self.writable = writable
        self.region = region
        self.cached = cached
        self.users = 0
        self.dead = False  # deregistered (or to be, once its last user releases it)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def covers(self, addr: int, length: int, writable: bool) -> bool:
        return (not self.dead and self.addr <= addr and addr + length <= self.end
                and (self.writable or not writable))

    def __repr__(self) -> str:
        return (f"<Entry {self.addr:#x}+{self.length} {'rw' if self.writable else 'ro'} "
                f"users={self.users}{' dead' if self.dead else ''}>")


class RegCache(Generic[R]):
    """See the module doc.

    Attributes:
        hits, misses, evictions: counters, for tests and the INFO log.
    """

    def __init__(self, register: Callable[[int, int, bool], R],
                 deregister: Callable[[R], None], *, max_entries: int = 64,
                 max_bytes: int = 1 << 34) -> None:
        self._register = register
        self._deregister = deregister
        self.max_entries = max(1, max_entries)
        self.max_bytes = max_bytes
        # cached entries, least recently used first
        self._lru: OrderedDict[int, Entry[R]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._closed = False
        # entries whose owner died: marked dead at once by the finalizer (which may run
        # in the middle of any of these methods, from the garbage collector), deregistered
        # at the next call
        self._graveyard: list[Entry[R]] = []

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def registered_bytes(self) -> int:
        return self._bytes

    def acquire(self, addr: int, length: int, writable: bool, owner: object,
                extent: tuple[int, int] | None = None) -> Entry[R]:
        """An entry covering ``[addr, addr + length)``, registering ``extent`` (default:
        that range) on a miss; the caller must :meth:`release` it.

        ``owner`` keeps the memory of ``extent`` alive (see the module doc).

        Raises:
            ValueError: ``extent`` does not contain the range, or the cache is closed.
            Whatever ``register`` raises (nothing is cached then).
        """
        if self._closed:
            raise ValueError("the registration cache is closed")
        self._bury()
        for key, entry in reversed(self._lru.items()):
            if entry.covers(addr, length, writable):
                self._lru.move_to_end(key)
                entry.users += 1
                self.hits += 1
                return entry
        self.misses += 1
        start, size = extent if extent is not None else (addr, length)
        if not (start <= addr and addr + length <= start + size):
            raise ValueError(f"extent {start:#x}+{size} does not contain {addr:#x}+{length}")
        try:
            ref_ok = True
            weakref.ref(owner)
        except TypeError:
            ref_ok = False
        region = self._register(start, size, writable)
        entry = Entry(start, size, writable, region, cached=ref_ok)
        entry.users = 1
        if ref_ok:
            self._lru[id(entry)] = entry
            self._bytes += size
            weakref.finalize(owner, _owner_gone, weakref.ref(self), weakref.ref(entry))
            self._trim()
        return entry

    def release(self, entry: Entry[R]) -> None:
        """The caller is done with ``entry`` (for now)."""
        if entry.users <= 0:
            raise RuntimeError(f"{entry!r} released more often than acquired")
        self._bury()
        entry.users -= 1
        if entry.users == 0:
            if not entry.cached or entry.dead:
                self._drop(entry)
            else:
                self._trim()

    def _owner_gone(self, entry: Entry[R]) -> None:
        if not entry.dead:
            entry.dead = True
            self._graveyard.append(entry)

    def collect(self) -> None:
        """Deregister now the entries whose owner died (otherwise done at the next
        acquire or release)."""
        self._bury()

    def _bury(self) -> None:
        while self._graveyard:
            entry = self._graveyard.pop()
            self._forget(entry)
            if entry.users == 0:
                self._drop(entry)

    def _forget(self, entry: Entry[R]) -> None:
        if self._lru.pop(id(entry), None) is not None:
            self._bytes -= entry.length

    def _trim(self) -> None:
        """Evict idle entries, least recently used first, while over the limits."""
        if len(self._lru) <= self.max_entries and self._bytes <= self.max_bytes:
            return
        for entry in list(self._lru.values()):
            if len(self._lru) <= self.max_entries and self._bytes <= self.max_bytes:
                break
            if entry.users == 0:
                self._forget(entry)
                self.evictions += 1
                self._drop(entry)

    def _drop(self, entry: Entry[R]) -> None:
        if entry.region is None:
            return
        entry.dead = True
        region, entry.region = entry.region, None  # type: ignore[assignment]
        self._deregister(region)

    def close(self) -> list[Entry[R]]:
        """Deregister every idle entry; return those still in use (their users release
        them later, which deregisters them)."""
        self._closed = True
        self._bury()
        busy = []
        for entry in list(self._lru.values()):
            self._forget(entry)
            if entry.users:
                entry.dead = True
                busy.append(entry)
            else:
                self._drop(entry)
        return busy


def _owner_gone(cache_ref: weakref.ref[RegCache[R]], entry_ref: weakref.ref[Entry[R]]) -> None:
    cache, entry = cache_ref(), entry_ref()
    if cache is not None and entry is not None:
        cache._owner_gone(entry)
