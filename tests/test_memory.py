"""Host memory space (:mod:`acoll._memory`): adoption, aliasing, pooling, paced work."""

from __future__ import annotations

import concurrent.futures.thread as cf_thread
import gc
import mmap
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import acoll
from acoll._dtypes import DTYPES, ReduceOp, empty_bytes, finish_avg, reduce_into
from acoll._memory import HostSpace, MemoryKind, host_buffer
from acoll._memory import host as host_mod

pace_calls = 0


async def _pace() -> None:
    global pace_calls
    pace_calls += 1


def test_adopt_views_without_copy_and_names_bad_arguments() -> None:
    mem = HostSpace()
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf = mem.adopt(arr, "send")
    assert buf.count == 12
    assert buf.dtype == np.float32
    assert buf.kind is MemoryKind.HOST
    assert buf.ptr == arr.__array_interface__["data"][0]
    buf.array[0] = 99
    assert arr[0, 0] == 99
    with pytest.raises(acoll.InvalidUsage, match="recv is read-only"):
        mem.adopt(_readonly(), "recv", writable=True)
    with pytest.raises(acoll.InvalidUsage, match="buf is not contiguous"):
        mem.adopt(np.zeros(10)[::2], "buf")
    with pytest.raises(acoll.InvalidUsage, match="buf is not a buffer"):
        mem.adopt(object(), "buf")


def _readonly() -> np.ndarray:
    a = np.zeros(3)
    a.setflags(write=False)
    return a


def test_slices_and_overlap() -> None:
    mem = HostSpace()
    whole = mem.adopt(np.zeros(100, np.int32), "x")
    a, b, c = whole[0:10], whole[10:20], whole[5:15]
    assert a.nbytes == 40
    assert b.ptr == whole.ptr + 40
    assert not mem.overlaps(a, b)
    assert mem.overlaps(a, c)
    assert mem.overlaps(c, b)
    assert mem.same(whole[0:10], a)
    assert not mem.same(a, whole[0:11])
    assert not mem.overlaps(whole[3:3], whole[0:10])  # empty overlaps nothing


def test_scratch_is_pooled_per_slot() -> None:
    mem = HostSpace()
    s1 = mem.scratch(100, np.dtype(np.float64), 0)
    s2 = mem.scratch(50, np.dtype(np.float32), 0)
    assert s1.ptr == s2.ptr  # same slot: same memory, reused
    s3 = mem.scratch(100, np.dtype(np.float64), 1)
    assert not mem.overlaps(s1, s3)
    big = mem.scratch(1 << 20, np.dtype(np.float64), 0)  # grows
    assert big.count == 1 << 20


@pytest.mark.parametrize("op", list(ReduceOp))
async def test_reduce_and_avg_match_numpy_helpers_in_pieces(op: ReduceOp,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    global pace_calls
    monkeypatch.setattr(host_mod, "_MAX_PIECE_BYTES", 4096)
    mem = HostSpace()
    for dt in (np.dtype(np.float32), np.dtype(np.int64)):
        n = 100_003
        a = (np.arange(n) % 7 + 1).astype(dt)
        b = (np.arange(n) % 5 + 1).astype(dt)
        want = np.empty_like(a)
        reduce_into(want, a, b, op)
        out = mem.adopt(np.empty_like(a), "out", writable=True)
        pace_calls = 0
        await mem.reduce(out, mem.adopt(a, "a"), mem.adopt(b, "b"), op, _pace)
        assert pace_calls > 10  # cut into pieces, pacing between them
        np.testing.assert_array_equal(out.array, want)
        await mem.finish_avg(out, 3, _pace)
        finish_avg(want, 3)
        np.testing.assert_array_equal(out.array, want)


async def test_copy_and_empty() -> None:
    mem = HostSpace()
    src = mem.adopt(np.arange(300_000, dtype=np.uint32), "src")
    dst = mem.empty(300_000, np.dtype(np.uint32))
    await mem.copy(dst, src, _pace)
    np.testing.assert_array_equal(dst.array, src.array)
    assert dst.dtype in DTYPES


def test_host_buffer_wraps_bytes_like_objects() -> None:
    data = bytearray(b"abcdef")
    buf = host_buffer(data)
    assert buf.view().tobytes() == b"abcdef"
    assert buf.nbytes == 6
    buf.view()[0] = ord("z")
    assert data[:1] == b"z"
    assert host_buffer(b"").nbytes == 0
    assert host_buffer(memoryview(bytearray(8)).cast("d")).nbytes == 8
    assert host_buffer(np.zeros((2, 3), np.float32)).nbytes == 24


# --------------------------------------------------------------------------- data_address
def test_data_address_is_the_arrays_and_leaves_owned_arrays_resizable() -> None:
    from acoll._memory import host as host_mod

    x = acoll.empty_shared(1000, np.float32)  # (its memory is a mapping's: kept)
    first = host_mod.data_address(x)
    assert first == x.__array_interface__["data"][0]
    assert id(x) in host_mod._addresses
    assert host_mod.data_address(x) == first  # (the kept answer)
    v = x[10:]
    assert host_mod.data_address(v) == first + 40  # a view is an object of its own
    owned = np.zeros(8, np.uint8)
    assert host_mod.data_address(owned) == owned.__array_interface__["data"][0]
    assert id(owned) not in host_mod._addresses
    owned.resize(1 << 20, refcheck=False)  # still allowed: no weak reference to it
    assert host_mod.data_address(owned) == owned.__array_interface__["data"][0]


def test_data_address_never_answers_for_a_dead_array_whose_id_is_reused() -> None:
    from acoll._memory.host import data_address

    seen = {}
    base = np.empty(4096, np.float64)
    for k in range(200):  # (ids of freed views come back quickly)
        a = base[k:k + 64 + len(seen) % 7]
        got = data_address(a)
        assert got == a.__array_interface__["data"][0]
        seen[id(a)] = got
        del a


def test_data_address_of_an_object_without_weak_references() -> None:
    from acoll._memory.host import data_address

    class Plain:  # (an object with the array interface, no weak references)
        __slots__ = ("__array_interface__", "nbytes")

        def __init__(self, arr: Any) -> None:
            self.__array_interface__ = arr.__array_interface__
            self.nbytes = arr.nbytes

    arr = np.arange(5, dtype=np.int64)
    assert data_address(Plain(arr)) == arr.__array_interface__["data"][0]


def _unmapped_soon(mm: Any) -> bool:
    deadline = time.monotonic() + 10
    while not mm.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(mm.closed)


def test_large_scratch_collected_under_a_lock_is_unmapped_without_taking_one() -> None:
    """A collection can run the array's finalizer anywhere, for instance inside
    ThreadPoolExecutor.submit, which holds concurrent.futures' global lock (not
    reentrant): handing the mapping to an executor from there waited for ever."""
    class Holder:  # (in a reference cycle: only the cyclic collector frees it)
        pass

    holder = Holder()
    holder.me = holder  # type: ignore[attr-defined]
    holder.arr = empty_bytes(2 << 20)  # type: ignore[attr-defined]
    mm = holder.arr.base.obj  # type: ignore[attr-defined]
    assert isinstance(mm, mmap.mmap)
    del holder
    returned: list[bool] = []

    def collect() -> None:
        with cf_thread._global_shutdown_lock:  # as inside ThreadPoolExecutor.submit
            gc.collect()
        returned.append(True)

    worker = threading.Thread(target=collect, daemon=True)
    worker.start()
    worker.join(10)
    assert returned, "the collection did not return while the lock was held"
    assert _unmapped_soon(mm)


def test_large_scratch_is_unmapped_in_a_forked_child_too() -> None:
    # (a fresh interpreter forks: never the threaded test worker)
    script = """
import gc, os, sys, time
from acoll._dtypes import empty_bytes
keep = empty_bytes(2 << 20)  # the parent's unmapping thread starts
pid = os.fork()
if pid == 0:
    arr = empty_bytes(2 << 20)
    mm = arr.base.obj
    del arr
    gc.collect()
    deadline = time.monotonic() + 10
    while not mm.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0 if mm.closed else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
