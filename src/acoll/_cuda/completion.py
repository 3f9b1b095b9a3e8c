"""Awaiting GPU work from asyncio without blocking the event loop's thread.

Four ways to learn that a stream (or event) has finished, chosen by ``method=``:

- ``"pipe"`` (default): enqueue ``cuLaunchHostFunc(stream, close, write_fd)`` on the stream,
  with libc's ``close`` as the host function and the write end of a fresh pipe as its
  argument. When the stream reaches it, CUDA's callback thread closes the fd — no Python,
  no GIL, no CUDA call — the read end turns readable (EOF) and the loop's own selector wakes
  the awaiting task. The stream is never held up by the GIL and there is no lock inversion.
  Costs a pipe and two ``epoll_ctl`` per wait. Linux on x86-64/aarch64 only (it relies on
  ``close(int)`` taking a ``void*`` argument in the C calling convention there).
- ``"hostfunc"``: CuPy's ``Stream.launch_host_func`` with a Python callback that calls
  ``loop.call_soon_threadsafe``. The callback needs the GIL; while it waits for it the
  stream is blocked, and a thread that holds the GIL while blocking on that stream (a
  synchronize, or a ``cudaFree`` that synchronizes the device) deadlocks.
- ``"poll"``: record an event; query ``Event.done`` on a timer, doubling the interval from
  ``POLL_MIN_S`` up to ``POLL_MAX_S``. The loop's timer resolution (1 ms for asyncio's
  selector) bounds its latency.
- ``"spin"``: query ``Event.done`` on every loop iteration (yielding between queries, so
  the loop keeps running) for ``SPIN_S``, then ``"poll"``.
- ``"thread"``: a waiter thread (up to :data:`MOST_WAITER_THREADS`) calls
  ``cuEventSynchronize`` through ctypes on an event recorded now (the GIL is released; the
  driver polls, so the thread keeps a core busy for the whole wait), then closes a pipe
  the loop watches, as ``pipe`` does.

Measured on an H200 (``bench/gpu_kernels.py``, ``bench/results/gpu_kernels_h200.txt``;
latency added over a never-yielding ``Stream.done`` loop, p50/p99 µs; CPU µs per wait):

=========  ==========================  ==========================  ===================
method     20 µs kernel, asyncio       2 ms kernel, asyncio        uvloop, 20 µs / 2 ms
=========  ==========================  ==========================  ===================
pipe       +66 / +110, CPU 112         +235 / +547, CPU 262        +61 / +231
hostfunc   +78 / +141, CPU 106         +250 / +556, CPU 263        +74 / +224
poll       +1101 / +1293, CPU 88       +260 / +609, CPU 166        +9 / +356 (busy)
spin       +1 / +14, CPU 37            +367 / +560, CPU 271        +6 / +982, CPU 886
=========  ==========================  ==========================  ===================

Session 23, another H200 (``bench/results/session23_h200/wait2/completion.txt``), added
p50 / p99 us, CPU us per wait:

=========  ==========================  ==========================  ===================
method     20 µs kernel, asyncio       2 ms kernel, asyncio        uvloop, 20 µs / 2 ms
=========  ==========================  ==========================  ===================
pipe       +57 / +95, CPU 85           +155 / +504, CPU 167        +50 / +253
thread     +39 / +77, CPU 75           +48 / +251, CPU 2077        +22 / +120
=========  ==========================  ==========================  ===================

With a blocking-sync event (the thread sleeps in the driver) ``thread`` measured no better
than ``pipe`` at 2 ms (+208 against +198 us, uvloop, ``wait/``): the driver's blocking
wake-up is what makes long waits slow. So ``thread`` trades a busy core for the whole wait
for 100 to 130 us less latency on long waits; it is a choice (``ACOLL_GPU_WAIT=thread``),
not the default.

``pipe`` is the default: its latency does not depend on the loop's timer resolution (poll
waits a whole 1 ms selector tick on asyncio; on uvloop sub-ms timers round to 0 and it
busy-loops), it never busy-waits (spin costs a core while it spins, and on uvloop its poll
tail does too), and, unlike ``hostfunc``, the stream never waits for the GIL. Most of its
CPU cost at 2 ms is CUDA's callback thread. ``spin`` wins for kernels shorter than its
window; a spin-then-pipe hybrid is the likely best default but was not measured.

All of them: return when the work is finished (results readable from the host); raise
:class:`acoll.errors.TimeoutError` at ``deadline`` (loop time, as ``loop.time()``); leave
nothing behind when cancelled or timed out except, for ``pipe``/``hostfunc``, a callback
still queued on the stream that fires harmlessly later.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import queue
import sys
import threading
from collections.abc import Awaitable
from typing import Any

from .._config import Setting
from ..errors import InvalidUsage
from ..errors import TimeoutError as AcollTimeoutError
from . import CudaUnavailable, import_cupy

__all__ = ["DEFAULT_METHOD", "METHODS", "arm_stream", "wait_event", "wait_stream"]

METHODS = ("pipe", "hostfunc", "poll", "spin", "thread")
DEFAULT_METHOD = "pipe"
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
SPIN_S = 100e-6


def _timeout(what: str) -> AcollTimeoutError:
    return AcollTimeoutError(f"timed out waiting for {what}")


def _parse_method(text: str) -> str:
    m = text.strip().lower()
    if m not in METHODS:
        raise ValueError(f"use one of {', '.join(METHODS)}")
    return m


WAIT = Setting("GPU_WAIT", _parse_method, DEFAULT_METHOD,
               "How a wait for GPU work that outlasts the first poll learns it ended "
               "(see acoll._cuda.completion).", "COLL")
_default: list[str] = []


def _method(method: str | None) -> str:
    if method is None:
        if not _default:
            _default.append(WAIT.resolve())
        method = _default[0]
    m = method
    if m not in METHODS:
        raise InvalidUsage(f"unknown wait method {method!r}; use one of {', '.join(METHODS)}")
    if m == "pipe" and not _pipe_supported():
        return "hostfunc"
    return m


# ------------------------------------------------------------------------- host-function waits

_driver: Any = None
_close_fn: int | None = None
_driver_lock = threading.Lock()


def _pipe_supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def _launch_close(stream_ptr: int, fd: int) -> None:
    """Enqueue ``close(fd)`` as a host function on the stream (driver API, no GIL needed)."""
    global _driver, _close_fn
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as exc:
                    raise CudaUnavailable(f"cannot load the CUDA driver: {exc}") from exc
                fn = lib.cuLaunchHostFunc
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _close_fn = ctypes.cast(ctypes.CDLL(None).close, ctypes.c_void_p).value
                _driver = fn
    rc = _driver(ctypes.c_void_p(stream_ptr), ctypes.c_void_p(_close_fn), ctypes.c_void_p(fd))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake(arg: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
    # Runs on CUDA's callback thread (with the GIL, taken by CuPy). Must not call CUDA.
    loop, fut = arg
    try:
        loop.call_soon_threadsafe(_settle, fut)
    except RuntimeError:  # the loop was closed meanwhile: nobody is waiting
        pass


async def _await_host_func(stream: Any, method: str, deadline: float | None,
                           what: str) -> None:
    await _arm(stream, method, deadline, what)


def _arm(stream: Any, method: str, deadline: float | None, what: str) -> Awaitable[None]:
    """Enqueue the ``pipe`` (or ``hostfunc``) signal on ``stream`` now; the awaitable
    completes when the stream reaches it (or raises at ``deadline``)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    if method != "pipe":
        stream.launch_host_func(_wake, (loop, fut))
        return _armed(fut, deadline, what, None)
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        _launch_close(int(stream.ptr), w)
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    # From here the write end belongs to the host function: never close it ourselves
    # (its number could be reused by then and the host function would close that).
    try:
        loop.add_reader(r, _settle, fut)
    except BaseException:
        os.close(r)
        raise
    return _armed(fut, deadline, what, r)


# ---------------------------------------------------------------------------- thread waits

#: Most waiter threads. A wait that finds them all busy uses the pipe instead (a shared
#: queue would order independent waits: one behind a kernel waiting for another
#: process's launch could hold back the wait that process needs).
MOST_WAITER_THREADS = 8
_jobs: queue.SimpleQueue[tuple[int, Any, int]] = queue.SimpleQueue()
_threads_lock = threading.Lock()
_threads = [0, 0]  # started, idle (waiting for a job)
_thread_events: dict[int, list[Any]] = {}  # device -> pooled events
_sync: list[Any] = []  # cuEventSynchronize, loaded once by the loop's thread


def _event_sync() -> Any:
    if not _sync:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuEventSynchronize
        except (OSError, AttributeError) as exc:
            raise CudaUnavailable(f"cannot load the CUDA driver: {exc}") from exc
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _sync.append(fn)
    return _sync[0]


def _serve(sync: Any) -> None:
    """A waiter thread: ``cuEventSynchronize`` each job's event through ctypes (the GIL is
    released meanwhile; the driver polls the event, so the thread keeps a core busy for
    the wait), then count itself idle and close its pipe's write end. A failed synchronize
    closes it too: the waiting side checks the work's own errors, and has a deadline."""
    import cupy as cp
    while True:
        device, event, fd = _jobs.get()
        try:
            cp.cuda.runtime.setDevice(device)  # (the device's primary context, current)
            sync(ctypes.c_void_p(int(event.ptr)))
        except Exception:  # the waiting side has a deadline
            pass
        finally:
            # (idle first, then the wake-up: the waiting side sees this thread idle when it
            # wakes, and a job given meanwhile is taken when the loop comes round)
            with _threads_lock:
                _threads[1] += 1
            with contextlib.suppress(OSError):
                os.close(fd)


def _reserve() -> bool:
    """Take an idle waiter thread, or start one; ``False`` when all are busy."""
    sync = _event_sync()
    with _threads_lock:
        if _threads[1] > 0:
            _threads[1] -= 1
            return True
        if _threads[0] >= MOST_WAITER_THREADS:
            return False
        _threads[0] += 1
    try:
        threading.Thread(target=_serve, args=(sync,), name="acoll-gpu-wait",
                         daemon=True).start()
    except BaseException:
        with _threads_lock:
            _threads[0] -= 1
        raise
    return True


def _arm_thread(stream: Any, deadline: float | None, what: str) -> Awaitable[None]:
    """Record an event on ``stream`` now; a waiter thread synchronizes it (spinning in the
    driver, without the GIL) and closes a pipe the loop watches. A blocking-sync event
    (the thread sleeps) measured no better than ``pipe`` for long waits (+208 against +198
    us at 2 ms, ``bench/results/session23_h200/wait/``): the driver's blocking wake-up is
    what is slow there. With every waiter thread busy, the pipe (or host function) does
    the wait."""
    import cupy as cp
    if not _reserve():
        return _arm(stream, "pipe" if _pipe_supported() else "hostfunc", deadline, what)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fds: tuple[int, int] | None = None
    try:
        device = getattr(stream, "device_id", -1)
        if device is None or device < 0:  # (CuPy's null and external streams say -1)
            device = cp.cuda.runtime.getDevice()
        device = int(device)
        pool = _thread_events.setdefault(device, [])
        with cp.cuda.Device(device):
            event = pool.pop() if pool else cp.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
        r, w = fds = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        loop.add_reader(r, _settle, fut)
    except BaseException:
        if fds is not None:
            os.close(fds[0])
            os.close(fds[1])
        with _threads_lock:
            _threads[1] += 1  # (the reserved thread stays idle)
        raise
    _jobs.put((device, event, w))  # (the write end is the thread's from here)
    return _pooled(_armed(fut, deadline, what, r), pool, event)


async def _pooled(wait: Awaitable[None], pool: list[Any], event: Any) -> None:
    await wait
    pool.append(event)  # (only once passed: a thread may still wait on a timed-out one)


# ------------------------------------------------------------------------------ query waits

async def _await_query(done: Any, method: str, deadline: float | None, what: str) -> None:
    """Poll ``done()`` (an event query) with spin and/or back-off sleeps."""
    loop = asyncio.get_running_loop()
    if method == "spin":
        stop = loop.time() + SPIN_S
        while loop.time() < stop:
            await asyncio.sleep(0)
            if done():
                return
    delay = POLL_MIN_S
    while not done():
        now = loop.time()
        if deadline is not None and now >= deadline:
            raise _timeout(what)
        await asyncio.sleep(delay if deadline is None else min(delay, deadline - now))
        delay = min(2 * delay, POLL_MAX_S)


# ---------------------------------------------------------------------------------- public

_side_streams: dict[int, list[Any]] = {}


async def wait_stream(stream: Any = None, *, deadline: float | None = None,
                      method: str | None = None) -> None:
    """Return once all work enqueued on ``stream`` so far has finished.

    ``stream``: a CuPy stream (``None``: CuPy's current stream). ``deadline``: loop time.
    ``method``: one of :data:`METHODS` (default :data:`DEFAULT_METHOD`).

    Raises:
        acoll.errors.TimeoutError: the work had not finished at ``deadline``.
        InvalidUsage: unknown method. CudaUnavailable: no CuPy.
    """
    cp = import_cupy()
    m = _method(method)
    st = cp.cuda.get_current_stream() if stream is None else stream
    what = f"GPU work on stream {st!r}"
    if st.done:
        return
    if m == "thread":
        await _arm_thread(st, deadline, what)
        return
    if m in ("pipe", "hostfunc"):
        await _await_host_func(st, m, deadline, what)
        return
    event = cp.cuda.Event(block=False, disable_timing=True)
    event.record(st)
    await _await_query(lambda: event.done, m, deadline, what)


async def wait_event(event: Any, *, deadline: float | None = None,
                     method: str | None = None) -> None:
    """Return once the work before ``event`` (a recorded CuPy event) has finished.

    For ``pipe``/``hostfunc`` a pooled side stream waits on the event and runs the host
    function. Same errors as :func:`wait_stream`.
    """
    cp = import_cupy()
    m = _method(method)
    what = f"GPU event {event!r}"
    if event.done:
        return
    if m not in ("pipe", "hostfunc", "thread"):
        await _await_query(lambda: event.done, m, deadline, what)
        return
    pool = _side_streams.setdefault(cp.cuda.runtime.getDevice(), [])
    side = pool.pop() if pool else cp.cuda.Stream(non_blocking=True)
    side.wait_event(event)
    if m == "thread":
        await _arm_thread(side, deadline, what)
    else:
        await _await_host_func(side, m, deadline, what)
    # Only a side stream with nothing pending goes back (a timed-out one may still hold a
    # host function behind a stuck event; it is dropped and freed once that completes).
    pool.append(side)


def arm_stream(stream: Any, *, deadline: float | None = None, what: str = ""
               ) -> Awaitable[None]:
    """Enqueue the ``pipe`` signal (``hostfunc`` where pipes are unsupported) on ``stream``
    *now*, and return an awaitable that completes when the stream reaches it.

    For callers that must enqueue under a given device (``with cupy.cuda.Device(k):``)
    and cannot hold that context across an ``await``: call it inside, await outside.
    """
    what = what or f"GPU work on stream {stream!r}"
    m = _method(None)
    if m == "thread":
        return _arm_thread(stream, deadline, what)
    return _arm(stream, "pipe" if m == "pipe" else "hostfunc", deadline, what)


async def _armed(fut: asyncio.Future[None], deadline: float | None, what: str,
                 fd: int | None) -> None:
    loop = asyncio.get_running_loop()

    def expire() -> None:
        if not fut.done():
            fut.set_exception(_timeout(what))

    timer = None if deadline is None else loop.call_at(deadline, expire)
    try:
        await fut
    finally:
        if timer is not None:
            timer.cancel()
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)
