"""The ``thread`` GPU wait (``acoll._cuda.completion``) without a GPU: a stand-in CuPy
(``tests/fake_cupy.py``) and a stand-in ``cuEventSynchronize`` that blocks until the test
says the event's work ended. Waiter threads are shared by the process, so each test
resets their bookkeeping and releases what it blocked."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import fake_cupy
from acoll._cuda import CudaUnavailable
from acoll._cuda import completion as C

_ids = itertools.count(1)


class _Event(fake_cupy.Event):
    """An event with a pointer whose work ends when ``gate`` is set."""

    made: list[_Event] = []
    by_ptr: dict[int, _Event] = {}

    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        super().__init__(block, disable_timing)
        self.ptr = next(_ids)
        self.gate = threading.Event()
        _Event.made.append(self)
        _Event.by_ptr[self.ptr] = self


def _sync(ptr: Any) -> int:  # (ctypes passes a c_void_p)
    _Event.by_ptr[ptr.value].gate.wait(10)
    return 0


class _Stream:
    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id
        self.ptr = 5


@pytest.fixture
def thread_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    cp = fake_cupy.module()
    cp.cuda.Event = _Event  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(C, "_threads", [0, 0])
    monkeypatch.setattr(C, "_sync", [_sync])
    monkeypatch.setattr(C, "_thread_events", {})
    monkeypatch.setattr(C, "_jobs", type(C._jobs)())
    _Event.made.clear()
    yield cp
    for ev in _Event.made:  # (no waiter thread is left blocked)
        ev.gate.set()


async def test_a_thread_wait_returns_once_the_event_passed(thread_waits: Any) -> None:
    loop = asyncio.get_running_loop()
    wait = asyncio.ensure_future(C._arm_thread(_Stream(), loop.time() + 5, "w"))
    await asyncio.sleep(0.05)
    assert not wait.done()
    _Event.made[-1].gate.set()
    await asyncio.wait_for(wait, 5)
    assert C._thread_events[0] == [_Event.made[-1]]  # pooled once passed
    assert C._threads == [1, 1]


async def test_busy_waiter_threads_leave_later_waits_to_the_pipe(
        thread_waits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits whose work never ends (a kernel waiting for a peer's launch) time out on the
    loop's side and keep their threads; a later wait on finished work must not queue
    behind them: with every thread busy it goes through the pipe."""
    loop = asyncio.get_running_loop()
    piped: list[int] = []

    def host_func(stream_ptr: Any, fn: Any, fd: Any) -> int:
        piped.append(fd.value)
        import os
        os.close(fd.value)  # (the stream's work has ended: the host function runs)
        return 0

    monkeypatch.setattr(C, "_driver", host_func)
    monkeypatch.setattr(C, "_close_fn", 1)
    stuck = [C._arm_thread(_Stream(), loop.time() + 0.2, "stuck")
             for _ in range(C.MOST_WAITER_THREADS)]
    results = await asyncio.gather(*stuck, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results), results
    assert C._threads == [C.MOST_WAITER_THREADS, 0]
    await asyncio.wait_for(C._arm_thread(_Stream(), loop.time() + 2, "later"), 2)
    assert len(piped) == 1
    for ev in _Event.made:
        ev.gate.set()
    for _ in range(1000):  # the released threads come back as idle
        if C._threads[1] == C.MOST_WAITER_THREADS:
            break
        await asyncio.sleep(0.01)
    assert C._threads == [C.MOST_WAITER_THREADS, C.MOST_WAITER_THREADS]
    assert C._thread_events.get(0, []) == []  # timed-out events are never pooled


async def test_a_missing_driver_is_an_error_not_a_hang(
        thread_waits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "_sync", [])
    real = ctypes.CDLL

    def cdll(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "libcuda.so.1":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    loop = asyncio.get_running_loop()
    with pytest.raises(CudaUnavailable, match="CUDA driver"):
        C._arm_thread(_Stream(), loop.time() + 1, "w")
    assert C._threads == [0, 0]


async def test_a_stream_without_a_device_waits_on_the_current_one(
        thread_waits: Any) -> None:
    """CuPy's null and external streams say device -1: the current device is used."""
    thread_waits.cuda.runtime.setDevice(1)
    loop = asyncio.get_running_loop()
    wait = asyncio.ensure_future(C._arm_thread(_Stream(-1), loop.time() + 5, "w"))
    _Event.made[-1].gate.set()
    await asyncio.wait_for(wait, 5)
    assert list(C._thread_events) == [1]
    thread_waits.cuda.runtime.setDevice(0)
