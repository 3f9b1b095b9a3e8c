"""Groups across communicators (``acoll.group()``, ``ncclGroupStart/End``): one task
driving several ranks, nesting with ``comm.group()``, what the block's context covers,
and what happens when the block raises, the exit fails or is cancelled. Host buffers
here (ranks in one loop, over the in-process transport and over TCP); the GPU prepared
calls inside groups are in ``test_p2p_gpu.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

import acoll

DEADLINE = 30.0
QUICK = 5.0


@pytest.fixture(params=[2, 3])
async def comms(request: pytest.FixtureRequest) -> AsyncIterator[list[acoll.Communicator]]:
    n = request.param
    uid = acoll.get_unique_id()
    made = await asyncio.gather(*(acoll.init_rank(n, uid, r, timeout=DEADLINE)
                                  for r in range(n)))
    yield list(made)
    if all(c.error is None for c in made):
        await asyncio.wait_for(asyncio.gather(*(c.close() for c in made)), QUICK)
    for c in made:
        c.abort()


def _ins(n: int, count: int = 1001) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(-50, 50, count).astype(np.float64) for _ in range(n)]


async def test_one_task_drives_every_rank(comms: list[acoll.Communicator]) -> None:
    """The seed program's pattern: one task, one call per rank, all collectives."""
    n = len(comms)
    ins = _ins(n)
    total = np.sum(ins, axis=0)
    bufs = [x.copy() for x in ins]
    gathered = [np.empty(n * 7) for _ in comms]
    scattered = [np.empty(7) for _ in comms]
    bcast = [np.full(5, float(c.rank)) for c in comms]
    reduced = [np.zeros(1001) for _ in comms]
    a2a = [np.empty(n * 3) for _ in comms]
    ring = [np.empty(1001) for _ in comms]
    async with acoll.group():
        for c in comms:
            r = c.rank
            await c.all_reduce(bufs[r])
            await c.all_gather(np.full(7, float(r)), gathered[r])
            await c.reduce_scatter(np.arange(n * 7, dtype=np.float64), scattered[r])
            await c.broadcast(bcast[r], root=n - 1)
            await c.reduce(ins[r], reduced[r], op=acoll.MAX, root=0)
            await c.all_to_all(np.arange(n * 3, dtype=np.float64) + 100 * r, a2a[r])
            await c.send(ins[r], (r + 1) % n)
            await c.recv(ring[r], (r - 1) % n)
            await c.barrier()
        # Nothing ran yet: the calls only joined the group.
        assert not np.array_equal(bufs[0], total)
    for c in comms:
        r = c.rank
        np.testing.assert_array_equal(bufs[r], total)
        np.testing.assert_array_equal(gathered[r], np.repeat(np.arange(n, dtype=float), 7))
        np.testing.assert_array_equal(scattered[r], n * np.arange(r * 7, r * 7 + 7.0))
        np.testing.assert_array_equal(bcast[r], np.full(5, float(n - 1)))
        np.testing.assert_array_equal(ring[r], ins[(r - 1) % n])
        np.testing.assert_array_equal(
            a2a[r], np.concatenate([np.arange(r * 3, r * 3 + 3.0) + 100 * p
                                    for p in range(n)]))
    np.testing.assert_array_equal(reduced[0], np.max(ins, axis=0))
    # After the block, calls run as plain calls again.
    again = [x.copy() for x in ins]
    await asyncio.gather(*(c.all_reduce(again[c.rank]) for c in comms))
    np.testing.assert_array_equal(again[0], total)


@pytest.mark.parametrize("comms", [2], indirect=True)
async def test_without_a_group_one_task_would_wait_for_itself(
        comms: list[acoll.Communicator]) -> None:
    """The control for the test above: the same calls made one after the other outside
    a group cannot complete (rank 0 waits for rank 1, whose call is never made)."""
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(comms[0].all_reduce(np.ones(8)), 0.5)
    for c in comms:
        c.abort()


async def test_groups_nest_and_run_at_the_outermost_exit(
        comms: list[acoll.Communicator]) -> None:
    n = len(comms)
    bufs = [np.full(16, float(c.rank + 1)) for c in comms]
    more = [np.full(4, 1.0) for _ in comms]
    async with acoll.group():
        for c in comms:
            async with c.group():  # joins the outer group
                await c.all_reduce(bufs[c.rank])
            async with acoll.group():
                await c.all_reduce(more[c.rank])
        assert bufs[0][0] == 1.0  # the inner blocks ran nothing
    want = n * (n + 1) / 2
    assert all(float(b[0]) == want for b in bufs)
    assert all(float(m[0]) == n for m in more)


async def test_comm_group_spans_other_communicators(comms: list[acoll.Communicator]) -> None:
    """``comm.group()`` is a group across communicators, as ``ncclGroupStart`` is."""
    bufs = [np.ones(8) for _ in comms]
    async with comms[0].group():
        for c in comms:
            await c.all_reduce(bufs[c.rank])
    assert all(float(b[0]) == len(comms) for b in bufs)


async def test_a_task_started_in_the_block_joins_and_one_outliving_it_does_not(
        comms: list[acoll.Communicator]) -> None:
    n = len(comms)
    bufs = [np.ones(8) for _ in comms]
    late = [np.ones(8) for _ in comms]
    release = asyncio.Event()

    async def later(c: acoll.Communicator) -> None:
        await release.wait()  # runs after the group ended: a plain call
        await c.all_reduce(late[c.rank])

    async with acoll.group():
        joined = [asyncio.ensure_future(c.all_reduce(bufs[c.rank])) for c in comms]
        await asyncio.gather(*joined)  # they return at once: joined, not run
        assert float(bufs[0][0]) == 1.0
        afterwards = [asyncio.ensure_future(later(c)) for c in comms]
    assert all(float(b[0]) == n for b in bufs)
    release.set()
    await asyncio.wait_for(asyncio.gather(*afterwards), QUICK)
    assert all(float(b[0]) == n for b in late)


async def test_other_tasks_are_not_in_the_group(comms: list[acoll.Communicator]) -> None:
    """A group belongs to its task's context: another task's calls run as usual, even
    while the group is open (the group's ops on other communicators wait for its exit)."""
    n = len(comms)
    uid = acoll.get_unique_id()
    others = await asyncio.gather(*(acoll.init_rank(n, uid, r, timeout=DEADLINE)
                                    for r in range(n)))
    try:
        bufs = [np.ones(8) for _ in comms]
        outside = [np.full(8, 2.0) for _ in comms]
        async with acoll.group():
            for c in comms:
                await c.all_reduce(bufs[c.rank])
            # Another task, made with a context of its own (no group in it).
            task = asyncio.get_running_loop().create_task(
                _all(others, outside), context=_fresh_context())
            await asyncio.wait_for(task, QUICK)
            assert float(outside[0][0]) == 2.0 * n  # ran inside the block
            assert float(bufs[0][0]) == 1.0
        assert float(bufs[0][0]) == n
    finally:
        await asyncio.gather(*(c.close() for c in others))


def _fresh_context():  # type: ignore[no-untyped-def]
    import contextvars
    return contextvars.Context()


async def _all(comms: list[acoll.Communicator], bufs: list[np.ndarray]) -> None:
    await asyncio.gather(*(c.all_reduce(bufs[c.rank]) for c in comms))


async def test_a_raising_block_runs_nothing_and_fails_its_communicators(
        comms: list[acoll.Communicator]) -> None:
    bufs = [np.ones(8) for _ in comms]
    t = time.monotonic()

    async def block() -> None:
        async with acoll.group():
            for c in comms:
                await c.all_reduce(bufs[c.rank])
            raise KeyError("user code failed")

    with pytest.raises(KeyError):
        await block()
    assert time.monotonic() - t < QUICK
    assert float(bufs[0][0]) == 1.0
    for c in comms:
        assert isinstance(c.error, acoll.RemoteError), c.error
        assert "cancelled group" in str(c.error)
        with pytest.raises(acoll.RemoteError):
            await c.all_reduce(np.ones(8))


async def test_a_raising_block_with_no_calls_fails_nothing(
        comms: list[acoll.Communicator]) -> None:
    with pytest.raises(KeyError):
        async with acoll.group():
            raise KeyError("before any call")
    assert all(c.error is None for c in comms)
    bufs = [np.ones(8) for _ in comms]
    await asyncio.gather(*(c.all_reduce(bufs[c.rank]) for c in comms))


async def test_the_exit_raises_the_first_error_and_every_rank_learns_it(
        comms: list[acoll.Communicator]) -> None:
    t = time.monotonic()

    async def block() -> None:
        async with acoll.group():
            for c in comms:
                await c.all_reduce(np.ones(8 if c.rank else 9))

    with pytest.raises(acoll.InvalidUsage, match="count"):
        await block()
    assert time.monotonic() - t < QUICK
    assert all(isinstance(c.error, acoll.InvalidUsage) for c in comms)


async def test_a_cancelled_exit_fails_the_communicators_and_does_not_hang(
        comms: list[acoll.Communicator]) -> None:
    missing = comms[-1]

    async def driver() -> None:
        async with acoll.group():
            for c in comms:
                if c is not missing:  # a rank's call is never made: the exit waits
                    await c.all_reduce(np.ones(8))

    task = asyncio.ensure_future(driver())
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
    t = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t < QUICK
    for c in comms:
        if c is not missing:
            assert isinstance(c.error, acoll.RemoteError), c.error
    with pytest.raises(acoll.RemoteError):  # told by its peers, at once
        await asyncio.wait_for(missing.all_reduce(np.ones(8)), QUICK)


async def test_close_inside_a_group_is_refused(comms: list[acoll.Communicator]) -> None:
    bufs = [np.ones(8) for _ in comms]
    async with acoll.group():
        for c in comms:
            await c.all_reduce(bufs[c.rank])
        with pytest.raises(acoll.InvalidUsage, match="inside a group"):
            await comms[0].close()
    assert all(float(b[0]) == len(comms) for b in bufs)
    assert all(c.error is None for c in comms)


async def test_a_group_on_a_failed_communicator_is_refused(
        comms: list[acoll.Communicator]) -> None:
    comms[0].abort()
    with pytest.raises(acoll.ClosedError):
        async with comms[0].group():
            pass
    with pytest.raises(acoll.ClosedError):
        async with acoll.group():
            await comms[0].all_reduce(np.ones(8))
    for c in comms[1:]:
        c.abort()
