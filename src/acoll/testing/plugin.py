"""pytest plugin (registered through the ``pytest11`` entry point).

Fixtures for users' own async tests:

- ``acoll_run_ranks``: :func:`acoll.testing.run_ranks`.
- ``acoll_loop_guard``: fails the test if anything reaches the running loop's exception
  handler (unretrieved task exceptions, callback errors) during the test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from . import run_ranks

__all__ = ["acoll_loop_guard", "acoll_run_ranks"]


@pytest.fixture
def acoll_run_ranks() -> Any:
    """The :func:`acoll.testing.run_ranks` helper."""
    return run_ranks


async def _guard() -> AsyncIterator[list[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)
    if seen:
        details = "; ".join(f"{c.get('message')}: {c.get('exception')!r}" for c in seen)
        pytest.fail(f"the event loop's exception handler was called: {details}")


try:
    import pytest_asyncio

    acoll_loop_guard = pytest_asyncio.fixture(_guard)
except ImportError:  # pragma: no cover - pytest-asyncio is in the test extra
    pass
