"""Test harness: every async test runs on plain asyncio (debug mode) and on uvloop, and
fails if anything reaches the loop's exception handler while it runs. Deadlines inside
acoll (``ACOLL_TIMEOUT``) are set below pytest-timeout's, so a stuck wait surfaces as an
acoll error naming what it waited for, not as a killed test. Behind them, three limits:
an async test is cancelled 20 s before pytest-timeout's limit (:func:`_guarded`);
pytest-timeout's SIGALRM ends a synchronous one; a watchdog thread ends the process 60 s
after that limit with every thread's stack (:func:`pytest_runtest_protocol`)."""

from __future__ import annotations

import asyncio
import contextlib
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
_HANG_MARGIN_S = float(os.environ.get("ACOLL_TEST_HANG_MARGIN", "60"))
_hang_dir: str | None = None  # the controller's; an xdist worker gets it in its workerinput
_STACKS_MARK = "most recent call first"  # (in every stack faulthandler writes)


def pytest_configure(config: pytest.Config) -> None:
    global _hang_dir
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        _hang_dir = workerinput.get("acoll_hang_dir")
    elif not (config.option.help or config.option.version or config.option.collectonly):
        _hang_dir = tempfile.mkdtemp(prefix="acoll-test-hangs-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _hang_dir is not None and not hasattr(config, "workerinput"):
        try:
            os.rmdir(_hang_dir)  # (only if empty: a dump nobody printed stays)
        except OSError:
            pass


def pytest_report_header(config: pytest.Config) -> str | None:
    if _hang_dir is None:
        return None
    return (f"acoll watchdog: a test running {_HANG_MARGIN_S:g} s past its timeout ends the "
            f"process; every thread's stack goes to {_hang_dir}")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput["acoll_hang_dir"] = _hang_dir


def _test_limit(item: pytest.Item) -> float | None:
    """The item's time limit as pytest-timeout reads it (marker, --timeout,
    PYTEST_TIMEOUT, ini), or ``None`` where it has none."""
    try:
        from pytest_timeout import _get_item_settings
        limit = _get_item_settings(item).timeout
    except Exception:  # pragma: no cover - pytest-timeout's private helper changed
        marker = item.get_closest_marker("timeout")
        limit = marker.args[0] if marker is not None and marker.args else (
            item.config.getini("timeout"))
    return float(limit) if limit else None


class _Watchdog:
    """faulthandler's watchdog for the item running: armed as it starts, and again with
    the time left as its teardown starts (pytest's faulthandler plugin and pytest-timeout
    cancel it when set-up or call fails, and the teardown after a failure is where a test
    can hang)."""

    dump: Any = None
    ends_at = 0.0

    def arm(self) -> None:
        if self.dump is not None:
            left = max(self.ends_at - time.monotonic(), 1.0)
            faulthandler.dump_traceback_later(left, file=self.dump, exit=True)


_watchdog = _Watchdog()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    limit = _test_limit(item)
    if _hang_dir is None or limit is None:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = os.path.join(_hang_dir, f"{worker}-{os.getpid()}.txt")
    try:
        dump = open(path, "w")  # noqa: SIM115 - closed below, around the yield
    except OSError:  # (its folder removed under the run: no watchdog, no failure)
        yield
        return
    with dump:
        dump.write(f"{item.nodeid} (started {time.strftime('%H:%M:%S')}, its limit "
                   f"{limit:g} s)\n")
        dump.flush()
        _watchdog.dump, _watchdog.ends_at = dump, time.monotonic() + limit + _HANG_MARGIN_S
        _watchdog.arm()
        try:
            yield
        finally:
            _watchdog.dump = None
            faulthandler.cancel_dump_traceback_later()
    with contextlib.suppress(OSError):
        os.unlink(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    _watchdog.arm()  # (a failed set-up or call cancelled it; teardown always follows)
    yield


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
        try:
            with open(os.path.join(_hang_dir, name)) as dump:
                text = dump.read()
            os.unlink(os.path.join(_hang_dir, name))
        except OSError:
            continue
        if reporter is not None:
            what = (f"outlived its timeout by {_HANG_MARGIN_S:g} s: the watchdog ended its "
                    "process" if _STACKS_MARK in text else
                    "was running when its process ended (not the watchdog: no stacks)")
            reporter.write_line("")
            reporter.write_line(f"--- a test {what} ({name}) ---\n{text}")


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


def _guarded(test: Callable[..., Any], seconds: float | None) -> Callable[..., Any]:
    """``test`` run under a deadline of ``seconds`` (a cancellation, which reaches the
    test at its await point), failing if anything reaches the loop's exception handler
    while it runs. pytest-timeout's SIGALRM alone is not enough for async tests: raised
    inside a loop callback, its exception goes to the exception handler (uvloop handles
    signals in a callback of its own), and a task whose next step it was about to
    schedule is left pending for good, so the test's clean-up then waits for ever.
    (Async fixtures run outside it: their set-up and teardown are not checked.)"""

    @functools.wraps(test)
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        seen: list[dict[str, Any]] = []
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: seen.append(context))

        def reports() -> str:
            return "; ".join(f"{c.get('message')}: {c.get('exception')!r}" for c in seen)

        try:
            result = await _with_deadline(test(*args, **kwargs), seconds)
            # Let callbacks scheduled by closing connections run before judging.
            await asyncio.sleep(0)
        except BaseException as exc:
            if seen and hasattr(exc, "add_note"):  # (3.11+: shown with the failure)
                exc.add_note(f"the event loop's exception handler was called too: "
                             f"{reports()}")
            raise
        finally:
            loop.set_exception_handler(previous)
        if seen:
            pytest.fail(f"the event loop's exception handler was called: {reports()}")
        return result

    return guarded


async def _with_deadline(run: Any, seconds: float | None) -> Any:
    """``await run``, failing the test (chained to where it waited) past ``seconds``."""
    if seconds is None:
        return await run
    message = (f"the test did not end within {seconds:g} s and was cancelled (the "
               "exception above shows where it waited)")
    if sys.version_info >= (3, 11):
        try:
            async with asyncio.timeout(seconds) as deadline:
                return await run
        except TimeoutError:
            if deadline.expired():
                pytest.fail(message)
            raise
    loop = asyncio.get_running_loop()  # pragma: no cover - the suite runs on 3.11, 3.12
    began = loop.time()
    try:
        return await asyncio.wait_for(run, seconds)
    except asyncio.TimeoutError:
        if loop.time() - began >= seconds:
            pytest.fail(message)
        raise


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            limit = _test_limit(item) or 0.0
            item.obj = _guarded(item.obj, max(limit - _CANCEL_MARGIN_S, limit / 2)
                                if limit else None)
