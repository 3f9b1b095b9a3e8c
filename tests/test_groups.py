"""Groups across communicators (``acoll.group()``, ``ncclGroupStart/End``): one task
driving several ranks, nesting with ``comm.group()``, what the block's context covers,
and what happens when the block raises, the exit fails or is cancelled. Host buffers
here (ranks in one loop, over the in-process transport and over TCP); the GPU prepared
calls inside groups are in ``test_p2p_gpu.py``."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
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
                _all(others, outside), context=contextvars.Context())
            await asyncio.wait_for(task, QUICK)
            assert float(outside[0][0]) == 2.0 * n  # ran inside the block
            assert float(bufs[0][0]) == 1.0
        assert float(bufs[0][0]) == n
    finally:
        await asyncio.gather(*(c.close() for c in others))


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
    """close() in the group's own context is refused (it would wait for the group's calls
    to run, which wait for the block to exit)."""
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


# ---------------------------------------------------------------- review cases (helper 20)

async def test_an_exit_cancelled_before_its_runs_start_fails_the_communicators(
        comms: list[acoll.Communicator]) -> None:
    """Cancelled right after the exit made its tasks (before any ran a line): the ops
    were promised to the peers, so every communicator fails; none is left held."""
    bufs = [np.ones(8) for _ in comms]

    async def driver() -> None:
        async with acoll.group():
            for c in comms:
                await c.all_reduce(bufs[c.rank])

    async def cancel_soon(task: asyncio.Future[None]) -> None:
        task.cancel()

    task = asyncio.ensure_future(driver())
    canceller = asyncio.ensure_future(cancel_soon(task))
    with pytest.raises(asyncio.CancelledError):
        await task
    await canceller
    assert not any(c._exec.in_group for c in comms)
    assert all(isinstance(c.error, acoll.RemoteError) for c in comms), \
        [c.error for c in comms]
    with pytest.raises(acoll.RemoteError):
        await asyncio.wait_for(comms[0].all_reduce(np.ones(8)), QUICK)


async def test_a_group_object_is_entered_once_at_a_time_and_may_be_reused(
        comms: list[acoll.Communicator]) -> None:
    g = acoll.group()
    async with g:
        with pytest.raises(acoll.InvalidUsage, match="already open"):
            async with g:
                pass
    held = comms[0].group()
    bufs = [np.ones(8) for _ in comms]
    async with acoll.group(), held:  # held nested once...
        for c in comms:
            await c.all_reduce(bufs[c.rank])
    more = [np.ones(8) for _ in comms]
    async with held:  # ...then the outermost block
        for c in comms:
            await c.all_reduce(more[c.rank])
    n = len(comms)
    assert all(float(b[0]) == n for b in bufs + more)
    assert not any(c._exec.in_group for c in comms)


async def test_another_tasks_call_waits_for_the_group_then_runs(
        comms: list[acoll.Communicator]) -> None:
    """A task outside the group calling a communicator the group holds: its call is
    numbered after the group's and runs after them (it neither joins the group nor
    returns early); close() from another task waits the same way."""
    n = len(comms)
    bufs = [np.ones(8) for _ in comms]
    outside = [np.full(8, 2.0) for _ in comms]

    async def other() -> None:
        await asyncio.gather(*(c.all_reduce(outside[c.rank]) for c in comms))

    async with comms[0].group():
        for c in comms:
            await c.all_reduce(bufs[c.rank])
        assert not comms[0]._exec.idle
        task = asyncio.get_running_loop().create_task(other(),
                                                      context=contextvars.Context())
        done, _ = await asyncio.wait({task}, timeout=0.3)
        assert not done, "the other task's call returned while the group held its comm"
        assert float(outside[0][0]) == 2.0
    await asyncio.wait_for(task, QUICK)
    assert all(float(b[0]) == n for b in bufs)
    assert all(float(o[0]) == 2.0 * n for o in outside)


async def test_a_group_block_awaiting_an_outside_call_ends_at_the_deadline(
        comms: list[acoll.Communicator]) -> None:
    """A group block that awaits a call another task made on a communicator the group
    holds can never exit (that call waits for the block). The outside call's deadline
    (the communicator's timeout) turns the deadlock into a TimeoutError naming the
    group's block, for that call and the group's calls; peers learn it at once."""
    for c in comms:
        c.timeout = 1.0
    async def deadlocked() -> None:
        async with comms[0].group():
            for c in comms:
                await c.all_reduce(np.ones(8))
            task = asyncio.get_running_loop().create_task(
                comms[0].all_reduce(np.ones(8)), context=contextvars.Context())
            await task  # the user's mistake: the block waits for a call that waits for it

    t = time.monotonic()
    with pytest.raises(acoll.TimeoutError, match="group block of another task"):
        await deadlocked()
    assert time.monotonic() - t < QUICK
    for c in comms[1:]:  # (told by rank 0's failure notice)
        for _ in range(200):
            if c.error is not None:
                break
            await asyncio.sleep(0.025)
        assert isinstance(c.error, acoll.TimeoutError), c.error
        assert c.error.rank == 0, c.error
        assert "group block of another task" in str(c.error)
    with pytest.raises(acoll.TimeoutError, match="group block of another task"):
        await comms[0].barrier()


async def test_split_waiting_for_another_tasks_group_has_a_deadline(
        comms: list[acoll.Communicator]) -> None:
    """split() from another task waits for an open group to exit, but not forever. (Since
    session 56 split() is numbered like a collective, so the block that awaits it
    deadlocks as with any call, and the deadline fails the communicator as it does
    there: the peers wait for that number.)"""
    comms[0].timeout = 0.5

    async def deadlocked() -> None:
        async with comms[0].group():
            for c in comms:
                await c.all_reduce(np.ones(8))
            task = asyncio.get_running_loop().create_task(
                comms[0].split(0), context=contextvars.Context())
            await asyncio.wait_for(task, QUICK)

    t = time.monotonic()
    with pytest.raises(acoll.TimeoutError, match="group block of another task"):
        await deadlocked()
    assert time.monotonic() - t < QUICK
    assert isinstance(comms[0].error, acoll.TimeoutError)


async def _pair(timeout: float) -> list[acoll.Communicator]:
    uid = acoll.get_unique_id()
    comms = list(await asyncio.gather(*(acoll.init_rank(2, uid, r, timeout=DEADLINE)
                                        for r in range(2))))
    for c in comms:
        c.timeout = timeout
    return comms


@pytest.mark.parametrize("waiter", ["barrier", "split"])
async def test_the_wait_for_a_block_ends_when_it_exits_not_when_its_ops_run(
        waiter: str) -> None:
    """Review of the deadline above: the outside call's (or split's) deadline covers the
    wait for the block to exit only. Here the block exits after 1.5 s (under the 4 s
    timeout) and its op then waits until 4.5 s for the peer, inside its own deadline
    (5.5 s): everything completes, nobody blames the block."""
    comms = await _pair(4.0)

    async def rank0() -> object:
        async with comms[0].group():
            await comms[0].all_reduce(np.ones(8))
            call = comms[0].barrier() if waiter == "barrier" else comms[0].split(0)
            outside = asyncio.get_running_loop().create_task(
                call, context=contextvars.Context())  # type: ignore[arg-type]
            await asyncio.sleep(1.5)  # legitimate work inside the block
        return await outside

    async def rank1() -> object:
        await asyncio.sleep(4.5)
        await comms[1].all_reduce(np.ones(8))
        return await (comms[1].barrier() if waiter == "barrier" else comms[1].split(0))

    try:
        out = await asyncio.gather(rank0(), rank1(), return_exceptions=True)
        assert not any(isinstance(r, BaseException) for r in out), out
        for r in out:
            if isinstance(r, acoll.Communicator):
                r.abort()
        assert all(c.error is None for c in comms), [c.error for c in comms]
    finally:
        for c in comms:
            c.abort()


async def test_split_waits_for_the_group_open_at_its_call_not_for_a_later_one() -> None:
    """Second review: split() made while another task's (empty) block is open waited,
    once that block ended, for the group the same task opened right after it, so on
    that rank it ran after the next group's all_reduce and on the peer before it: both
    timed out. It waits only for the group open when it was called."""
    comms = await _pair(3.0)
    loop = asyncio.get_running_loop()
    bufs = [np.ones(4), np.ones(4)]

    async def rank0() -> None:
        async with comms[0].group():  # open, empty, while split is called
            split = loop.create_task(comms[0].split(0), context=contextvars.Context())
            await asyncio.sleep(0.2)
        async with comms[0].group():  # opened as the first one ends
            await comms[0].all_reduce(bufs[0])
            await asyncio.sleep(0.05)
        sub = await split
        assert sub is not None
        sub.abort()

    async def rank1() -> None:
        split = loop.create_task(comms[1].split(0))
        await asyncio.sleep(0.2)
        await comms[1].all_reduce(bufs[1])
        sub = await split
        assert sub is not None
        sub.abort()

    try:
        await asyncio.wait_for(asyncio.gather(rank0(), rank1()), QUICK)
        assert all(float(b[0]) == 2.0 for b in bufs)
        assert all(c.error is None for c in comms)
    finally:
        for c in comms:
            c.abort()


async def test_close_inside_a_block_while_another_task_closes_is_refused_at_once() -> None:
    """close() in a group block while another task's close() waits for that block: the
    block's close must be refused (InvalidUsage) at once, not wait for the other close."""
    comms = await _pair(DEADLINE)
    try:
        t = time.monotonic()
        with pytest.raises(acoll.InvalidUsage, match="inside a group"):  # noqa: PT012
            async with comms[0].group():
                await comms[0].all_reduce(np.ones(4))
                asyncio.get_running_loop().create_task(
                    comms[0].close(), context=contextvars.Context())
                await asyncio.sleep(0.05)
                await comms[0].close()
        assert time.monotonic() - t < QUICK
    finally:
        for c in comms:
            c.abort()


async def test_a_group_of_a_task_started_in_another_block_is_its_own(
        comms: list[acoll.Communicator]) -> None:
    """A child task started inside the parent's block opens its own group and uses it
    after the parent's block ended: it still drives every rank from one task."""
    bufs = [np.ones(8) for _ in comms]
    go = asyncio.Event()

    async def child() -> None:
        async with acoll.group():
            await go.wait()
            for c in comms:
                await c.all_reduce(bufs[c.rank])

    async with acoll.group():
        task = asyncio.ensure_future(child())
        await asyncio.sleep(0)
    go.set()
    await asyncio.wait_for(task, QUICK)
    assert all(float(b[0]) == len(comms) for b in bufs)


@pytest.mark.parametrize("comms", [2], indirect=True)
@pytest.mark.parametrize("send_at", ["before the recv", "during the block", "after it"])
async def test_a_recv_in_a_group_matches_a_plain_send(comms: list[acoll.Communicator],
                                                      send_at: str) -> None:
    """Rank 0 receives inside a group (then all-reduces); rank 1 sends plainly, then
    all-reduces: no order mismatch whenever its send arrives."""
    a, b = comms
    got = np.zeros(8)
    x = [np.ones(8), np.ones(8)]
    delay = {"before the recv": 0.0, "during the block": 0.1, "after it": 0.5}[send_at]

    async def rank0() -> None:
        if send_at == "before the recv":
            await asyncio.sleep(0.2)
        async with a.group():
            await a.recv(got, 1)
            await a.all_reduce(x[0])
            await asyncio.sleep(0.3)

    async def rank1() -> None:
        await asyncio.sleep(delay)
        await b.send(np.full(8, 5.0), 0)
        await b.all_reduce(x[1])

    await asyncio.wait_for(asyncio.gather(rank0(), rank1()), QUICK)
    assert float(got[0]) == 5.0
    assert [float(v[0]) for v in x] == [2.0, 2.0]


async def test_send_and_recv_first_in_a_group_carry_no_order_stamp(
        comms: list[acoll.Communicator]) -> None:
    """send/recv as a communicator's first call in a group join it (their stamp says
    'anywhere in the group'), and a ring exchange of one task completes."""
    n = len(comms)
    ins = [np.full(4, float(r)) for r in range(n)]
    outs = [np.empty(4) for _ in range(n)]
    async with acoll.group():
        for c in comms:
            await c.recv(outs[c.rank], (c.rank - 1) % n)
            assert c._exec.in_group
            await c.send(ins[c.rank], (c.rank + 1) % n)
            await c.all_reduce(ins[c.rank])
    for r in range(n):
        assert float(outs[r][0]) == float((r - 1) % n)


@pytest.mark.parametrize("what", ["split", "register", "deregister"])
async def test_calls_that_cannot_be_queued_are_refused_inside_a_group(
        comms: list[acoll.Communicator], what: str) -> None:
    reg = await asyncio.gather(*(c.register(np.ones(4)) for c in comms))
    call = {"split": lambda: comms[0].split(0),
            "register": lambda: comms[0].register(np.ones(4)),
            "deregister": lambda: comms[0].deregister(reg[0])}[what]
    t = time.monotonic()
    async with acoll.group():
        with pytest.raises(acoll.InvalidUsage, match="inside a group"):
            await call()
    assert time.monotonic() - t < QUICK
    assert all(c.error is None for c in comms)


async def test_idle_is_false_inside_a_group(comms: list[acoll.Communicator]) -> None:
    """The fast paths (lane, via-host, P2P) start a call at once only when the executor
    is idle: never inside a group, whose calls must queue."""
    ex = comms[0]._exec
    assert (ex.idle, ex.quiet) == (True, True)
    async with acoll.group():
        assert not ex.idle
        assert ex.quiet  # (no op of this communicator in the group yet)
        await comms[0].barrier()
        assert not ex.quiet
        for c in comms[1:]:
            await c.barrier()
    assert (ex.idle, ex.quiet) == (True, True)


# ------------------------------------------------------- second review cases (helper 21)

@pytest.mark.parametrize("comms", [2], indirect=True)
async def test_calls_from_other_tasks_keep_their_call_order_around_a_group(
        comms: list[acoll.Communicator]) -> None:
    """Rank 0: a group holds c0 while another task calls (first), then a third task calls
    right as the group's ops take the lock (second). Rank 1 makes the same calls plainly
    in that order. Each call must meet its counterpart: first 1 + 1, second 100 + 100
    (numbered when waking, the second call took the first's number and the sums swapped)."""
    c0, c1 = comms
    loop = asyncio.get_running_loop()
    g = [np.ones(4), np.ones(4)]
    first = [np.ones(4), np.ones(4)]
    second = [np.full(4, 100.0), np.full(4, 100.0)]

    async def rank1() -> None:
        for buf in (g[1], first[1], second[1]):
            await c1.all_reduce(buf)

    async def call_first() -> None:
        await c0.all_reduce(first[0])

    async def call_second() -> None:
        while c0._exec._owner is not None:  # (lands right as the group's ops take the lock)
            await asyncio.sleep(0)
        await c0.all_reduce(second[0])

    r1 = loop.create_task(rank1(), context=contextvars.Context())
    async with c0.group():
        await c0.all_reduce(g[0])
        t1 = loop.create_task(call_first(), context=contextvars.Context())
        await asyncio.sleep(0.05)
        assert not t1.done()  # (it waits for the group to run)
        t2 = loop.create_task(call_second(), context=contextvars.Context())
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(t1, t2, r1), QUICK)
    assert [float(b[0]) for b in g + first] == [2.0] * 4
    assert [float(b[0]) for b in second] == [200.0, 200.0]


@pytest.mark.parametrize("comms", [2], indirect=True)
async def test_a_group_object_is_not_entered_again_while_its_exit_runs(
        comms: list[acoll.Communicator]) -> None:
    c0, c1 = comms
    loop = asyncio.get_running_loop()
    p, x = [np.ones(4), np.ones(4)], [np.ones(4), np.ones(4)]
    g = c0.group()

    async def plain() -> None:  # holds c0's lock until rank 1 calls
        await c0.all_reduce(p[0])

    async def block() -> None:
        async with g:
            await c0.all_reduce(x[0])

    async def again() -> None:
        async with g:
            pass

    async def rank1() -> None:
        await asyncio.sleep(0.3)
        for buf in (p[1], x[1]):
            await c1.all_reduce(buf)

    tasks = [loop.create_task(f(), context=contextvars.Context()) for f in (plain, block)]
    await asyncio.sleep(0.05)  # block() is in its exit, waiting for c0's lock
    with pytest.raises(acoll.InvalidUsage, match="already open"):
        await loop.create_task(again(), context=contextvars.Context())
    await asyncio.wait_for(asyncio.gather(*tasks, rank1()), QUICK)
    assert [float(b[0]) for b in p + x] == [2.0] * 4
    assert c0.error is None


@pytest.mark.parametrize("comms", [2], indirect=True)
@pytest.mark.parametrize("what", ["send", "all_reduce"])
async def test_a_call_cancelled_while_queued_behind_a_group_fails_the_communicator(
        comms: list[acoll.Communicator], what: str) -> None:
    """A call from another task on a communicator a group holds has its number (and, for
    a send, its place among the sends to that peer): cancelling it fails the communicator
    on every rank, as for any queued call, instead of leaving the ranks out of step."""
    c0, c1 = comms
    loop = asyncio.get_running_loop()

    async def call() -> None:
        if what == "send":
            await c0.send(np.ones(4), 1)
        else:
            await c0.all_reduce(np.ones(4))

    async def block() -> None:
        async with c0.group():
            await c0.all_reduce(np.ones(4))
            task = loop.create_task(call(), context=contextvars.Context())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert isinstance(c0.error, acoll.RemoteError)

    with pytest.raises(acoll.RemoteError, match="cancelled"):  # (the group's exit)
        await block()
    with pytest.raises(acoll.AcollError):
        await asyncio.wait_for(c1.all_reduce(np.ones(4)), QUICK)


async def test_a_call_inside_a_group_on_a_communicator_another_group_holds_is_refused(
        comms: list[acoll.Communicator]) -> None:
    loop = asyncio.get_running_loop()
    bufs = [np.ones(8) for _ in comms]
    caught: list[BaseException] = []

    async def other_group() -> None:
        try:
            async with acoll.group():
                await comms[0].all_reduce(np.ones(8))
        except BaseException as exc:
            caught.append(exc)

    async def block() -> None:
        async with acoll.group():
            for c in comms:
                await c.all_reduce(bufs[c.rank])
            await loop.create_task(other_group(), context=contextvars.Context())

    # An invalid call fails its communicator on every rank (its peers would wait for
    # it), so the holding group's exit reports it too.
    with pytest.raises(acoll.InvalidUsage, match="another task's group"):
        await asyncio.wait_for(block(), QUICK)
    assert len(caught) == 1
    assert isinstance(caught[0], acoll.InvalidUsage)
    assert "another task's group" in str(caught[0])


@pytest.mark.parametrize("kind", ["comm", "acoll"])
@pytest.mark.parametrize("steps", [1, 2])
async def test_a_group_exit_cancelled_before_its_ops_step_fails_the_communicator(
        kind: str, steps: int) -> None:
    """Found by review: a cancellation that reached a group's exit after it took the lock
    but before its ops took their first step (the gather's tasks never ran a line) left
    the communicator healthy, its numbers spent, and the peers waiting in the group until
    the deadline. Now it fails, and the peers hear at once."""
    n, timeout = 3, 20.0
    uid = acoll.get_unique_id(ifname="=lo")
    comms = await asyncio.gather(*(acoll.init_rank(n, uid, r, timeout=timeout)
                                   for r in range(n)))
    subs = await asyncio.gather(*(c.split(0) for c in comms))

    async def op(comm: acoll.Communicator, sub: acoll.Communicator) -> None:
        x, y = np.ones(1 << 12, np.float32), np.ones(1 << 12, np.float32)
        if kind == "comm":
            async with comm.group():
                await comm.all_reduce(x)
                await comm.all_reduce(y)
        else:
            async with acoll.group():
                await comm.all_reduce(x)
                await sub.all_reduce(y)

    async def one(comm: acoll.Communicator, sub: acoll.Communicator) -> float:
        task = asyncio.ensure_future(op(comm, sub))
        if comm.rank == 0:
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
        start = time.monotonic()
        with contextlib.suppress(BaseException):
            await task
        return time.monotonic() - start

    try:
        waited = await asyncio.gather(*(one(c, s) for c, s in zip(comms, subs, strict=True)))
        if comms[0].error is None:  # (the ops ran before the cancel landed: nothing to see)
            assert all(c.error is None for c in comms)
            pytest.skip(f"the group's ops had run after {steps} steps")
        assert max(waited) < timeout / 4, waited
    finally:
        for c in comms + subs:
            c.abort()
