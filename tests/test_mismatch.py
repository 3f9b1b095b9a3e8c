"""Ranks that disagree on what they run (issue 6.4): every case ends quickly in
``InvalidUsage`` naming the disagreement on every rank, and no rank returns success from
a call its peers did not make."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import acoll
from acoll.testing import run_ranks

Call = Callable[[acoll.Communicator], Awaitable[Any]]
QUICK = 5.0  # seconds: far below the deadline of the communicators below
DEADLINE = 30.0


async def _outcomes(n: int, calls: dict[int, Call], default: Call) -> list[BaseException]:
    """Run ``calls[rank]`` (else ``default``) on each of ``n`` ranks; return what each
    raised (asserting that none succeeded), within :data:`QUICK` seconds."""
    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(n, uid, r, timeout=DEADLINE)
                                   for r in range(n)))
    t = time.monotonic()
    try:
        results = await asyncio.gather(*(calls.get(c.rank, default)(c) for c in comms),
                                       return_exceptions=True)
    finally:
        for c in comms:
            c.abort()
    elapsed = time.monotonic() - t
    assert all(isinstance(r, BaseException) for r in results), \
        f"a rank returned success from a call its peers did not make: {results}"
    assert elapsed < QUICK, f"took {elapsed:.1f} s: detected at the deadline, not at once"
    return list(results)  # type: ignore[arg-type]


def _f32(n: int) -> Call:
    return lambda c: c.all_reduce(np.ones(n, np.float32))


async def test_counts_that_pick_different_algorithms() -> None:
    out = await _outcomes(2, {0: _f32(1000)}, _f32(100_000))
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("count 1000 vs 100000" in str(e) or "count 100000 vs 1000" in str(e)
               for e in out), out


@pytest.mark.parametrize("native", ["-1", "0"])
def test_counts_whose_algorithms_never_exchange_a_message(native: str) -> None:
    """Separate processes over TCP: rank 1's count picks recursive doubling, the others'
    the ring (the native one where it builds, ``ACOLL_NATIVE=-1``). Rank 1 first waits
    for rank 0 and the ring ranks for their previous rank, so no message of the op reaches
    a rank that could check it. Found by review: every rank waited for the deadline and
    then raised TimeoutError. The waiting ranks now send their descriptor to the silent
    peer after a second, and that peer names the difference."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    env.update(ACOLL_SHM_DISABLE="1", ACOLL_NET="socket", ACOLL_NATIVE=native)
    proc = subprocess.run(
        [sys.executable, "-m", "acoll.run", "-n", "3", "--", sys.executable,
         str(Path(__file__).parent / "mp_mismatch.py")],
        env=env, capture_output=True, text=True, timeout=90)
    lines = [ln for ln in proc.stdout.splitlines() if " after " in ln]
    assert len(lines) == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in lines:
        assert "InvalidUsage: all_reduce mismatch" in line, line
        assert "count 16384 vs 204800" in line or "count 204800 vs 16384" in line, line
        took = float(line.split(" after ")[1].split(" s:")[0])
        assert took < QUICK, f"detected at the deadline, not within seconds: {line}"


async def test_zero_elements_on_some_ranks() -> None:
    out = await _outcomes(4, {0: _f32(0), 1: _f32(0)}, _f32(5))
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("count" in str(e) for e in out), out


@pytest.mark.parametrize("other", ["broadcast", "all_gather", "barrier", "reduce",
                                   "reduce_scatter", "all_to_all"])
async def test_one_rank_in_another_collective(other: str) -> None:
    calls: dict[str, Call] = {
        "broadcast": lambda c: c.broadcast(np.ones(8, np.float32), root=1),
        "all_gather": lambda c: c.all_gather(np.ones(2, np.float32),
                                             np.ones(8, np.float32)),
        "barrier": lambda c: c.barrier(),
        "reduce": lambda c: c.reduce(np.ones(8, np.float32), root=2),
        "reduce_scatter": lambda c: c.reduce_scatter(np.ones(8, np.float32),
                                                     np.ones(2, np.float32)),
        "all_to_all": lambda c: c.all_to_all(np.ones(8, np.float32),
                                             np.ones(8, np.float32)),
    }
    out = await _outcomes(4, {3: calls[other]}, _f32(8))
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("mismatch" in str(e) for e in out), out


async def test_a_first_call_mismatch_among_8_ranks_is_named_on_every_rank() -> None:
    """Found by review: on the first call no connections exist yet; the rank that found
    the mismatch failed and stopped listening, and a rank still dialing it reported
    "cannot connect to rank k" or "rank k is gone" instead of the mismatch (6 of 32 rank
    outcomes in 4 trials). A refused dial now waits briefly for the failure notice, and
    a listener that stops because its rank failed closes the connections it made but
    never handed over with that notice."""
    for trial in range(6):
        odd = trial % 8
        out = await _outcomes(8, {odd: lambda c: c.all_gather(
            np.ones(4, np.float32), np.ones(32, np.float32))}, _f32(4))
        assert all(isinstance(e, acoll.InvalidUsage) for e in out), (trial, out)
        assert all("mismatch" in str(e) for e in out), (trial, out)


async def _send_then_barrier(c: acoll.Communicator) -> None:
    """A send completes once the bytes are handed over (eagerly, before the peer posts
    its recv); the sender learns of the disagreement at its next call."""
    await c.send(np.ones(8, np.float32), 1)
    await asyncio.sleep(0.5)
    await c.barrier()


async def test_one_rank_in_send_while_the_others_all_reduce() -> None:
    out = await _outcomes(4, {0: _send_then_barrier}, _f32(8))
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("send/recv" in str(e) for e in out), out


async def test_send_and_recv_issued_at_different_places() -> None:
    """Rank 0 sends before the all-reduce, rank 1 receives after it (an order that
    deadlocks with blocking sends): reported on the receiver, and on the sender at the
    latest at its next call."""
    async def sender(c: acoll.Communicator) -> None:
        await c.send(np.ones(4, np.float32), 1)
        try:
            await c.all_reduce(np.ones(4, np.float32))
        except acoll.InvalidUsage:
            raise
        await asyncio.sleep(0.5)
        await c.barrier()

    async def receiver(c: acoll.Communicator) -> None:
        await c.all_reduce(np.ones(4, np.float32))
        await c.recv(np.ones(4, np.float32), 0)

    out = await _outcomes(2, {0: sender, 1: receiver}, sender)
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("order" in str(e) or "issued after collective" in str(e) for e in out), out


async def test_recv_waiting_for_a_peer_that_moved_on() -> None:
    async def receiver(c: acoll.Communicator) -> None:
        await c.recv(np.ones(4, np.float32), 1)
        await c.all_reduce(np.ones(4, np.float32))

    async def other(c: acoll.Communicator) -> None:
        await c.all_reduce(np.ones(4, np.float32))
        await c.send(np.ones(4, np.float32), 0)

    out = await _outcomes(2, {0: receiver, 1: other}, other)
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out


@pytest.mark.parametrize(("first", "second", "n"), [("ring", "rd", 2), ("ring", "direct", 3),
                                                    ("direct", "rd", 3)])
async def test_different_algorithm_settings_are_named(first: str, second: str,
                                                      n: int) -> None:
    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(n, uid, r, timeout=DEADLINE)
                                   for r in range(n)))
    for c in comms:
        c._algo = first if c.rank == 0 else second
    t = time.monotonic()
    out = await asyncio.gather(*(c.all_reduce(np.ones(64 << 10, np.float32)) for c in comms),
                               return_exceptions=True)
    for c in comms:
        c.abort()
    assert time.monotonic() - t < QUICK
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("algorithm" in str(e) for e in out), out


@pytest.mark.parametrize("other", ["all_reduce", "broadcast", "barrier"])
async def test_split_against_another_call_is_named_at_once(other: str) -> None:
    """Found by review (session 56): split() takes no sequence number, so one rank in
    split() and another in a collective both waited for their deadlines (the split side
    naming "bootstrap tag 281474976710657"). split() now passes a barrier numbered like a
    collective first, whose messages say "split". (register() and a GPU deregister()
    do the same; across processes over the lane too: checked by hand, session 56.)"""
    calls: dict[str, Call] = {
        "all_reduce": _f32(8),
        "broadcast": lambda c: c.broadcast(np.ones(8, np.float32), root=0),
        "barrier": lambda c: c.barrier(),
    }
    out = await _outcomes(3, {1: lambda c: c.split(0)}, calls[other])
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("rank 1 is in split()" in str(e) or "while rank 1 is in split()" in str(e)
               for e in out), out


@pytest.mark.parametrize("late", [0.0, 0.3])
async def test_split_beside_another_tasks_call_in_the_same_order_completes(
        late: float) -> None:
    """Found by review (session 56): split()'s first barrier and its exchange took the
    communicator one after the other, so another task's all_reduce (called after split()
    on both ranks) ran between them on one rank but not on the other: a deadlock until
    the deadline. They run as one op now."""
    async def fn(comm: acoll.Communicator) -> np.ndarray:
        async def reduce() -> np.ndarray:
            await asyncio.sleep(0 if comm.rank == 0 else late)
            x = np.ones(4, np.float32)
            await comm.all_reduce(x)
            return x

        if comm.rank == 1:
            await asyncio.sleep(0.1)
        split = asyncio.ensure_future(comm.split(0))
        await asyncio.sleep(0)
        child, x = await asyncio.gather(split, reduce())
        assert child is not None
        other = await asyncio.gather(comm.split(comm.rank), comm.split(0))  # (two at once)
        for c in (child, *other):
            assert c is not None
            await c.close()
        return x

    t = time.monotonic()
    results = await run_ranks(2, fn, timeout=DEADLINE, together=True)
    assert time.monotonic() - t < QUICK
    assert all((x == 2).all() for x in results)


async def test_close_while_the_others_are_in_a_collective() -> None:
    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(3, uid, r, timeout=DEADLINE)
                                   for r in range(3)))
    t = time.monotonic()
    out = await asyncio.gather(comms[0].close(), *(c.all_reduce(np.ones(8)) for c in comms[1:]),
                               return_exceptions=True)
    for c in comms:
        c.abort()
    assert time.monotonic() - t < QUICK
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("rank 0 closed the communicator while rank" in str(e) for e in out[1:]), out


async def test_close_that_cannot_complete_raises() -> None:
    """Issue 7: closing two ranks one after the other in one task used to wait for the
    deadline and then return as if it had worked."""
    async def fn(comm: acoll.Communicator) -> None:
        return None

    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(2, uid, r, timeout=30) for r in range(2)))
    for c in comms:  # (formed with more: a slow machine)
        c.timeout = 1.0
    with pytest.raises(acoll.TimeoutError, match="waiting for rank 1"):
        await comms[0].close()
    for _ in range(200):  # (told by rank 0)
        if comms[1].error is not None:
            break
        await asyncio.sleep(0.025)
    assert isinstance(comms[1].error, acoll.TimeoutError)
    t = time.monotonic()
    await comms[1].close()  # a failed communicator is released at once, without raising
    assert time.monotonic() - t < 0.9  # (not its 1 s deadline)
    assert await run_ranks(1, fn) == [None]


async def test_unawaited_posted_receive_mismatch_fails_at_once() -> None:
    """A size error on a receive the algorithm has not reached yet is acted on at once."""
    out = await _outcomes(2, {0: _f32(3 << 20)}, _f32((3 << 20) + 4096))
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out


# ------------------------------------------------------------------ legitimate p2p programs
async def test_recv_queued_behind_another_recv_is_not_a_mismatch() -> None:
    """A send that arrives while the matching recv still waits behind another recv (the
    communicator runs calls one at a time) is legitimate."""
    async def fn(comm: acoll.Communicator) -> float:
        x = np.full(4, float(comm.rank), np.float32)
        if comm.rank == 0:
            await comm.send(x, 1)
            await asyncio.sleep(0.3)
        elif comm.rank == 1:
            await asyncio.sleep(0.1)
            a, b = np.empty(4, np.float32), np.empty(4, np.float32)
            await asyncio.gather(comm.recv(a, 2), comm.recv(b, 0))
            x = a + b
        else:
            await asyncio.sleep(1.0)
            await comm.send(x, 1)
        await comm.barrier()
        return float(x[0])

    assert await run_ranks(3, fn, timeout=DEADLINE) == [0.0, 2.0, 2.0]


@pytest.mark.parametrize("layout", ["plain-vs-group", "groups-differ", "group-vs-plain"])
async def test_groups_may_differ_between_ranks(layout: str) -> None:
    """NCCL lets ranks group their calls differently; the same calls in the same order."""
    async def fn(comm: acoll.Communicator) -> float:
        x = np.ones(4, np.float32)
        y = np.full(4, 2.0, np.float32)  # not x: in a group the send runs beside the reduce
        buf = np.zeros(4, np.float32)
        p2p = ((lambda: comm.send(y, 1)) if comm.rank == 0 else (lambda: comm.recv(buf, 0)))
        plain = (layout == "plain-vs-group" and comm.rank == 0) or (
            layout == "group-vs-plain" and comm.rank == 1)
        if plain:
            await comm.all_reduce(x)
            await p2p()
        elif layout == "groups-differ" and comm.rank == 0:
            async with comm.group():
                await comm.all_reduce(x)
            async with comm.group():
                await p2p()
        else:
            async with comm.group():
                await comm.all_reduce(x)
                await p2p()
        return float(buf[0] if comm.rank == 1 else x[0])

    assert await run_ranks(2, fn, timeout=DEADLINE) == [2.0, 2.0]


async def test_send_never_received_is_reported() -> None:
    """A send whose recv is never posted used to vanish while both ranks returned ok."""
    async def sender(c: acoll.Communicator) -> None:
        await c.send(np.ones(4, np.float32), 1)
        await c.barrier()
        await asyncio.sleep(0.3)
        await c.barrier()

    async def bystander(c: acoll.Communicator) -> None:
        await asyncio.sleep(0.2)
        await c.barrier()
        await asyncio.sleep(0.3)
        await c.barrier()

    out = await _outcomes(2, {0: sender, 1: bystander}, bystander)
    assert all(isinstance(e, acoll.InvalidUsage) for e in out), out
    assert all("send/recv order mismatch" in str(e) for e in out), out
