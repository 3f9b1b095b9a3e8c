"""Test harness: every async test runs on plain asyncio (debug mode) and on uvloop, and
fails if anything reaches the loop's exception handler. Deadlines inside acoll
(``ACOLL_TIMEOUT``) are set below pytest-timeout's, so a stuck wait surfaces as an acoll
error naming what it waited for, not as a killed test."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Callable, Mapping
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


def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 1.0  # large buffers take a while to reduce; not an error
    return loop


def pytest_asyncio_loop_factories(config: Any, item: Any
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": _debug_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        func = getattr(item, "function", None)
        if func is not None and inspect.iscoroutinefunction(func):
            item.add_marker(pytest.mark.usefixtures("loop_guard"))


@pytest.fixture
async def loop_guard() -> AsyncIterator[None]:
    """Fail the test if the running loop's exception handler is called."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield
    # Let callbacks scheduled by closing connections run before judging.
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    if seen:
        details = "; ".join(f"{c.get('message')}: {c.get('exception')!r}" for c in seen)
        pytest.fail(f"the event loop's exception handler was called: {details}")
