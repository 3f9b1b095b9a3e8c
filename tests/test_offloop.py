"""acoll._offloop.in_thread: blocking work off the loop, its result never lost to a cancel."""

from __future__ import annotations

import asyncio
import threading

import pytest

from acoll._offloop import in_thread


async def test_the_work_runs_on_another_thread() -> None:
    names: list[str] = []

    def work() -> int:
        names.append(threading.current_thread().name)
        return 7

    assert await in_thread(work) == 7
    assert names
    assert names[0] != threading.current_thread().name


async def test_an_error_reaches_the_caller() -> None:
    def work() -> None:
        raise OSError("no memory")

    with pytest.raises(OSError, match="no memory"):
        await in_thread(work, lambda _: None)


async def _cancel_while_running(work_result: object, fail: bool) -> list[object]:
    gate, finished = threading.Event(), threading.Event()
    discarded: list[object] = []

    def work() -> object:
        try:
            gate.wait(10)
            if fail:
                raise OSError("late failure")
            return work_result
        finally:
            finished.set()

    task = asyncio.ensure_future(in_thread(work, discarded.append))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert discarded == []  # (the thread is still in work())
    gate.set()
    for _ in range(200):
        if finished.is_set():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # (the loop runs the thread's done callback)
    return discarded


async def test_a_cancelled_caller_hands_the_result_to_discard() -> None:
    """The result (a descriptor, a mapping) is handed to ``discard`` when the thread ends:
    nothing it owns is left for the collector."""
    result = object()
    assert await _cancel_while_running(result, fail=False) == [result]


async def test_a_late_error_after_a_cancel_is_dropped_quietly() -> None:
    """(The test harness fails on anything reaching the loop's exception handler.)"""
    assert await _cancel_while_running(None, fail=True) == []


async def test_the_work_does_not_wait_for_the_loops_default_executor() -> None:
    """Found by review: with the loop's default executor (the application's pool) busy or
    its workers blocked on acoll calls, acoll's set-up waited for them (a deadlock when
    the workers drove the very communicators being formed)."""
    import concurrent.futures

    loop = asyncio.get_running_loop()
    busy = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    loop.set_default_executor(busy)
    try:
        blocked = loop.run_in_executor(None, release.wait, 10)
        assert await asyncio.wait_for(in_thread(lambda: 5), 5) == 5
    finally:
        release.set()
        await blocked
        busy.shutdown()


def test_unmap_drops_a_mapping_and_keeps_its_data() -> None:
    import mmap
    import os

    from acoll._offloop import DROP_STEP, unmap

    size = 2 * DROP_STEP + 4096
    fd = os.memfd_create("acoll-test")
    try:
        os.ftruncate(fd, size)
        first = mmap.mmap(fd, size)
        other = mmap.mmap(fd, size)
        first[-1:] = b"\x07"
        unmap(first)
        assert first.closed
        assert other[-1:] == b"\x07"  # (the shared file keeps the data)
        view = memoryview(other)
        unmap(other)  # (exported: left to the collector, as close() would)
        assert not other.closed
        view.release()
        other.close()
    finally:
        os.close(fd)


def test_a_result_is_discarded_even_after_the_loop_closed() -> None:
    """(Found by review: the clean-up ran from a loop callback, which never comes once
    the loop is closed: a segment's descriptor made for a cancelled caller leaked.) The
    worker thread hands the result to ``discard`` itself."""
    gate, discarded = threading.Event(), threading.Event()
    got: list[object] = []

    def work() -> str:
        gate.wait(10)
        return "fd"

    def discard(result: str) -> None:
        got.append(result)
        discarded.set()

    async def main() -> None:
        task = asyncio.ensure_future(in_thread(work, discard))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())  # (the loop is closed when this returns; the worker still waits)
    gate.set()
    assert discarded.wait(10)
    assert got == ["fd"]
