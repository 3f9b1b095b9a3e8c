"""Test harness: every async test runs on plain asyncio (debug mode) and on uvloop, and
fails if anything reaches the loop's exception handler while it runs. Deadlines inside
acoll (``ACOLL_TIMEOUT``) are set below pytest-timeout's, so a stuck wait surfaces as an
acoll error naming what it waited for, not as a killed test. Behind them, three limits:
an async test is cancelled 20 s before pytest-timeout's limit (:func:`_guarded`);
pytest-timeout's SIGALRM ends a synchronous one; a watchdog thread ends the process 60 s
after that limit with every thread's stack (:func:`pytest_runtest_protocol`)."""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import inspect
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None

try:  # property tests: no per-example deadline (a slow machine's example is not a failure)
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass
else:
    _hypothesis_settings.register_profile("acoll", deadline=None)
    _hypothesis_settings.load_profile("acoll")

# The suite runs with acoll's defaults: settings of the calling shell would change what is
# tested (ACOLL_IB_DISABLE=1, say, fails the transport selection tests). ACOLL_TIMEOUT (the
# tests' deadlines) and ACOLL_TEST_* (the suite's own switches) are kept.
for _name in [k for k in os.environ if k.startswith("ACOLL_")]:
    if _name != "ACOLL_TIMEOUT" and not _name.startswith("ACOLL_TEST_"):
        del os.environ[_name]
# Ranks in tests talk over loopback only; subprocess tests pass their own environment.
os.environ.setdefault("ACOLL_SOCKET_IFNAME", "=lo")
os.environ.setdefault("ACOLL_TIMEOUT", "30")


# A backstop under pytest-timeout. Its signal method raises in the main thread, and an
# exception raised inside an event-loop callback goes to the loop's exception handler
# instead, so a test stuck in a busy loop can outlive its timeout (CI once waited 90
# minutes on one). faulthandler's watchdog is a C thread: past pytest-timeout's limit plus
# a margin it writes every thread's stack to a file and ends the process. Under xdist the
# controller names the crashed test, and prints these files at the end of the session.
_HANG_MARGIN_S = 60.0
_hang_dir: str | None = None  # the controller's; an xdist worker gets it in its workerinput


def pytest_configure(config: pytest.Config) -> None:
    global _hang_dir
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        _hang_dir = workerinput.get("acoll_hang_dir")
    else:
        _hang_dir = tempfile.mkdtemp(prefix="acoll-test-hangs-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput["acoll_hang_dir"] = _hang_dir


def _test_limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 120)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _hang_dir is None:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = os.path.join(_hang_dir, f"{worker}-{os.getpid()}.txt")
    with open(path, "w") as dump:
        dump.write(f"{item.nodeid} outlived {_test_limit(item)} s + {_HANG_MARGIN_S} s "
                   f"(started {time.strftime('%H:%M:%S')}); every thread's stack:\n")
        dump.flush()
        faulthandler.dump_traceback_later(_test_limit(item) + _HANG_MARGIN_S,
                                          file=dump, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    os.unlink(path)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller reports
        return
    if _hang_dir is None:
        return
    try:
        names = sorted(os.listdir(_hang_dir))
    except FileNotFoundError:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for name in names:
        with open(os.path.join(_hang_dir, name)) as dump:
            text = dump.read()
        if reporter is not None:
            reporter.write_line(f"--- test outlived its timeout ({name}) ---\n{text}")
    for name in names:
        os.unlink(os.path.join(_hang_dir, name))
    try:
        os.rmdir(_hang_dir)
    except OSError:
        pass


def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 1.0  # large buffers take a while to reduce; not an error
    return loop


if uvloop is not None:
    class _UvloopWithoutDebug(uvloop.Loop):  # type: ignore[misc, name-defined]
        """uvloop with its debug mode kept off (``asyncio_debug`` turns it on for every
        loop): it records a stack for every handle and future, which made the heaviest
        one-loop tests 10 times slower (22 s against 2) for nothing plain asyncio's debug
        mode, which the other run of each test has, does not already check."""

        def set_debug(self, enabled: bool) -> None:
            super().set_debug(False)


def pytest_asyncio_loop_factories(config: Any, item: Any
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": _debug_loop}
    if uvloop is not None:
        factories["uvloop"] = _UvloopWithoutDebug
    return factories


#: Seconds before pytest-timeout's limit at which an async test is cancelled: its waits end
#: with a traceback of where it stood, and run_ranks' clean-up has time to run.
_CANCEL_MARGIN_S = 20.0


def _guarded(test: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``test`` run under a deadline of ``seconds`` (a cancellation, which reaches the
    test at its await point), failing if anything reaches the loop's exception handler
    while it runs. pytest-timeout's SIGALRM alone is not enough for async tests: raised
    inside a loop callback, its exception goes to the exception handler (uvloop handles
    signals in a callback of its own), and a task whose next step it was about to
    schedule is left pending for good, so the test's clean-up then waits for ever."""

    @functools.wraps(test)
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        seen: list[dict[str, Any]] = []
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: seen.append(context))
        try:
            expired = False
            if sys.version_info >= (3, 11):
                try:
                    async with asyncio.timeout(seconds) as deadline:
                        result = await test(*args, **kwargs)
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    expired = True
            else:  # pragma: no cover - the suite runs on 3.11 and 3.12
                try:
                    result = await asyncio.wait_for(test(*args, **kwargs), seconds)
                except asyncio.TimeoutError:
                    expired = True
            if expired:
                pytest.fail(f"the test did not end within {seconds:g} s and was cancelled "
                            "(the traceback above shows where it waited)")
            # Let callbacks scheduled by closing connections run before judging.
            await asyncio.sleep(0)
        finally:
            loop.set_exception_handler(previous)
        if seen:
            details = "; ".join(f"{c.get('message')}: {c.get('exception')!r}" for c in seen)
            pytest.fail(f"the event loop's exception handler was called: {details}")
        return result

    return guarded


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.obj = _guarded(item.obj, max(_test_limit(item) - _CANCEL_MARGIN_S,
                                              _test_limit(item) / 2))
