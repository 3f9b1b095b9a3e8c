"""Send/recv to self inside a group (:mod:`acoll._comm.selfp2p`): how it pairs, and every
way to misuse it, each named at once. The data paths (all-to-all-v loops including the
caller's own rank, on every transport and memory space) are in collective_cases.py's
matrix, which every collective test runs."""

from __future__ import annotations

import asyncio
import contextvars
import time

import numpy as np
import pytest

import acoll
from acoll.testing import run_ranks

QUICK = 5.0


async def test_one_rank_sends_to_itself_in_a_group() -> None:
    """The README's ring example with one rank: its neighbour is itself."""
    async def fn(comm: acoll.Communicator) -> list[float]:
        x = np.arange(6, dtype=np.float32)
        got = np.zeros(6, np.float32)
        async with comm.group():
            await comm.recv(got, 0)  # (the recv may come first)
            await comm.send(x, 0)
        return got.tolist()

    assert await run_ranks(1, fn) == [list(range(6))]


async def test_pairs_follow_call_order_and_the_same_buffer_is_a_no_op() -> None:
    async def fn(comm: acoll.Communicator) -> None:
        r = comm.rank
        a, b = np.full(3, 10.0 + r), np.full(5, 20.0 + r)
        got_a, got_b = np.zeros(3), np.zeros(5)
        same = np.full(4, 7.0)
        peer_in, peer_out = np.full(2, float(r)), np.zeros(2)
        async with comm.group():
            await comm.send(a, r)
            await comm.send(peer_in, 1 - r)
            await comm.send(b, r)
            await comm.recv(got_a, r)
            await comm.recv(peer_out, 1 - r)
            await comm.recv(got_b, r)
            await comm.send(same, r)
            await comm.recv(same, r)
        assert got_a.tolist() == [10.0 + r] * 3
        assert got_b.tolist() == [20.0 + r] * 5
        assert peer_out.tolist() == [1.0 - r] * 2
        assert same.tolist() == [7.0] * 4
        await comm.all_reduce(np.ones(3))  # still usable, in step with the peer

    await run_ranks(2, fn)


async def test_outside_a_group_it_is_refused_at_once_and_the_peer_hears() -> None:
    async def fn(comm: acoll.Communicator) -> str:
        if comm.rank == 0:
            with pytest.raises(acoll.InvalidUsage, match="to self on rank 0 outside a group"):
                await comm.send(np.ones(4), 0)
            return "raised"
        with pytest.raises(acoll.InvalidUsage, match="rank 0 made an invalid"):
            await comm.all_reduce(np.ones(4))
        return "told"

    t = time.monotonic()
    assert await run_ranks(2, fn, timeout=20) == ["raised", "told"]
    assert time.monotonic() - t < QUICK


@pytest.mark.parametrize(("recv", "match"), [
    (lambda: np.zeros(5, np.float32), "count 4 vs 5"),
    (lambda: np.zeros(4, np.float64), "dtype float32 vs float64"),
])
async def test_a_recv_unlike_its_send_is_named_at_the_call(recv: object, match: str) -> None:
    async def fn(comm: acoll.Communicator) -> None:
        async def group() -> None:
            async with comm.group():
                await comm.send(np.ones(4, np.float32), 0)
                await comm.recv(recv(), 0)  # type: ignore[operator]

        with pytest.raises(acoll.InvalidUsage, match=f"send/recv to self #0 on rank 0.*{match}"):
            await group()

    await run_ranks(1, fn)


async def test_overlapping_buffers_are_refused() -> None:
    async def fn(comm: acoll.Communicator) -> None:
        x = np.zeros(8, np.float32)

        async def group() -> None:
            async with comm.group():
                await comm.send(x[:4], 0)
                await comm.recv(x[2:6], 0)

        with pytest.raises(acoll.InvalidUsage, match="overlap"):
            await group()

    await run_ranks(1, fn)


@pytest.mark.parametrize("half", ["send", "recv"])
async def test_a_half_without_its_other_half_fails_the_group_on_every_rank(half: str) -> None:
    """Rank 0 queues one half of a pair only: its group fails naming it before any of its
    calls ran (found by review: its all_reduce ran, and a peer of a small one returned
    while rank 0 failed), and rank 1, in that all_reduce, hears at once."""
    async def fn(comm: acoll.Communicator) -> str:
        x = np.ones(4)
        if comm.rank == 0:
            async def group() -> None:
                async with comm.group():
                    await comm.all_reduce(x)
                    await (comm.send(x, 0) if half == "send" else comm.recv(x, 0))

            with pytest.raises(acoll.InvalidUsage,
                               match=f"{half} (to|from) self #0 on rank 0 has no"):
                await group()
            return "raised"
        # (none of rank 0's group ran: not its all_reduce either)
        with pytest.raises(acoll.InvalidUsage, match=f"{half} (to|from) self #0 on rank 0"):
            await comm.all_reduce(x)
        return "told"

    t = time.monotonic()
    assert await run_ranks(2, fn, timeout=20) == ["raised", "told"]
    assert time.monotonic() - t < QUICK


async def test_halves_in_two_groups_are_refused() -> None:
    """The first group runs with a send whose recv is in the next group: refused (it
    would wait for a recv that runs only after it)."""
    async def fn(comm: acoll.Communicator) -> None:
        x = np.ones(4)
        with pytest.raises(acoll.InvalidUsage, match="no recv from self"):
            async with comm.group():
                await comm.send(x, 0)
        with pytest.raises(acoll.AcollError):
            async with comm.group():
                await comm.recv(x, 0)

    await run_ranks(1, fn)


async def test_a_call_from_another_task_joins_the_group_holding_the_communicator() -> None:
    """A recv from self made by another task while this task's group holds the
    communicator joins that group's queue (as any call from another context does), so
    it pairs with the group's send."""
    async def fn(comm: acoll.Communicator) -> list[float]:
        x = np.full(3, 5.0)
        got = np.zeros(3)
        async with comm.group():
            await comm.send(x, 0)
            later = asyncio.create_task(comm.recv(got, 0), context=contextvars.Context())
            await asyncio.sleep(0)
        await asyncio.wait_for(later, QUICK)
        return got.tolist()

    assert await run_ranks(1, fn) == [[5.0] * 3]


async def test_a_failure_ends_a_recv_waiting_for_its_send() -> None:
    """The recv from self runs first and waits for its send's op to start; that op fails
    before it does (here: made to raise, as a broken stream would): the wait ends with
    the communicator's error at once, not at the deadline."""
    async def fn(comm: acoll.Communicator) -> None:
        from acoll._comm import selfp2p

        real = selfp2p.SelfSend.run

        async def broken(self: selfp2p.SelfSend) -> None:
            await asyncio.sleep(0.05)
            raise acoll.TransportError("the stream broke")

        selfp2p.SelfSend.run = broken  # type: ignore[method-assign]
        try:
            async def group() -> None:
                async with comm.group():
                    await comm.recv(np.zeros(2), 0)
                    await comm.send(np.ones(2), 0)

            t = time.monotonic()
            with pytest.raises(acoll.TransportError, match="the stream broke"):
                await group()
            assert time.monotonic() - t < QUICK
        finally:
            selfp2p.SelfSend.run = real  # type: ignore[method-assign]
        assert comm.error is not None

    await run_ranks(1, fn)


async def test_a_cancelled_send_recv_is_named_as_such() -> None:
    """A send/recv's op number is its tag's (2147483648 and up): the peers' message said
    "cancelled send_recv #2147483648" (review, session 57). It says "a send/recv"."""
    async def fn(comm: acoll.Communicator) -> str:
        if comm.rank == 0:
            task = asyncio.ensure_future(comm.recv(np.zeros(4), 1))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return "cancelled"
        with pytest.raises(acoll.RemoteError) as info:
            await comm.all_reduce(np.ones(4))
        assert "rank 0 cancelled a send/recv; the communicator was aborted" in str(info.value)
        assert "#" not in str(info.value)
        return "told"

    assert await run_ranks(2, fn, timeout=20) == ["cancelled", "told"]


async def test_a_cancelled_group_led_by_a_send_recv_names_no_tag_number() -> None:
    """(Review, session 57: "cancelled group #2147483648", the send/recv's tag number.)"""
    async def fn(comm: acoll.Communicator) -> str:
        comm._exec.cancelled("group", (1 << 31) | 5)
        return str(comm.error)

    [message] = await run_ranks(1, fn)
    assert message == "rank 0 cancelled group; the communicator was aborted"
