"""AVG as NCCL computes it: floating-point inputs are scaled by the rounded 1/n, then
summed (so an average never overflows where the sum would); integers are summed, then
divided. Ranks in one loop here; the lane, zero-copy and native-ring paths between
processes are in tests/test_lane.py (``test_float16_average_never_overflows...``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import acoll
from acoll import _communicator
from acoll._dtypes import BFLOAT16, avg_factor
from acoll.testing import run_ranks
from collective_cases import assert_same, reference
from fake_device import FakeDeviceSpace, to_dev, to_host


def _want(count: int, n: int, value: float, dt: Any) -> np.ndarray[Any, Any]:
    return reference([np.full(count, value, dt)] * n, acoll.AVG)


@pytest.mark.parametrize("algo", ["ring", "rd", "direct", "hd"])
@pytest.mark.parametrize("nranks", [2, 3])
async def test_float16_average_is_finite_where_the_sum_overflows(
        algo: str, nranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """60000 on every rank: the float16 sum is inf, the average is not (NCCL gives
    60000 for 2 ranks, the scaled terms' sum for 3), on every algorithm, in place and
    not, in a group, for all_reduce, reduce and reduce_scatter; sends untouched."""
    monkeypatch.setenv("ACOLL_ALGO", f"all_reduce:{algo},reduce:tree")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    dt = np.dtype(np.float16)

    async def fn(comm: acoll.Communicator) -> list[str]:
        n, r = comm.size, comm.rank
        bad = []
        for count in (1, 3001, 40_003):
            want = _want(count, n, 60000, dt)
            assert np.isfinite(want).all()
            send = np.full(count, 60000, dt)
            send.setflags(write=False)  # (a write to it would raise)
            out = np.zeros(count, dt)
            await comm.all_reduce(send, out, op=acoll.AVG)
            bad += [] if np.array_equal(out, want) else [f"all_reduce {count}"]
            buf = send.copy()
            await comm.all_reduce(buf, op="avg")
            bad += [] if np.array_equal(buf, want) else [f"all_reduce in place {count}"]
            res = np.zeros(count, dt)
            await comm.reduce(send, res, op=acoll.AVG, root=1)
            if r == 1:
                bad += [] if np.array_equal(res, want) else [f"reduce {count}"]
            whole = np.full(n * count, 60000, dt)
            await comm.reduce_scatter(whole, whole[r * count:(r + 1) * count], op=acoll.AVG)
            bad += [] if np.array_equal(whole[r * count:(r + 1) * count], want) else [
                f"reduce_scatter in place {count}"]
            rest = np.delete(whole, np.s_[r * count:(r + 1) * count])
            bad += [] if (rest == 60000).all() else [f"reduce_scatter others {count}"]
            bufs = [send.copy() for _ in range(3)]
            async with comm.group():
                for b in bufs:
                    await comm.all_reduce(b, op=acoll.AVG)
            bad += [] if all(np.array_equal(b, want) for b in bufs) else [f"group {count}"]
        return bad

    assert await run_ranks(nranks, fn) == [[]] * nranks


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
async def test_each_input_is_scaled_by_the_rounded_factor_then_summed(dtype: str) -> None:
    """Random inputs, 2 ranks (one addition, so no order): the result is exactly
    x0 * f + x1 * f with f the dtype's rounded 1/2, and also for 3 ranks against the
    order-free bound; integer AVG divides the sum (truncating)."""
    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)

    def inputs(rank: int) -> np.ndarray[Any, Any]:
        return (np.random.default_rng(rank).standard_normal(5000) * 100).astype(dt)

    async def fn(comm: acoll.Communicator) -> np.ndarray[Any, Any]:
        x = inputs(comm.rank)
        await comm.all_reduce(x, op=acoll.AVG)
        return x

    got = await run_ranks(2, fn)
    f = avg_factor(dt, 2)
    want = (inputs(0) * f + inputs(1) * f).astype(dt)
    assert_same(got[0], want, "2 ranks")
    assert_same(got[1], want, "2 ranks, rank 1")

    async def ints(comm: acoll.Communicator) -> np.ndarray[Any, Any]:
        x = np.array([7, -7, 5, -5, 1], np.int32) + comm.rank
        await comm.all_reduce(x, op=acoll.AVG)
        return x

    assert (await run_ranks(3, ints))[2].tolist() == [8, -6, 6, -4, 2]


async def test_average_against_sum_is_still_named_a_mismatch() -> None:
    """A scaled AVG runs a SUM, but every rank still sees the other's op as AVG."""

    async def fn(comm: acoll.Communicator) -> str:
        comm.timeout = 10
        x = np.ones(1000, np.float32)
        try:
            await comm.all_reduce(x, op=acoll.AVG if comm.rank == 0 else acoll.SUM)
        except acoll.AcollError as exc:
            return str(exc)
        return "no error"

    msgs = await run_ranks(2, fn)
    for m in msgs:
        assert "AVG" in m, msgs
        assert "SUM" in m, msgs


async def test_device_average_is_scaled_on_the_callers_stream_at_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device communicator (the fake device of tests/fake_device.py) the scaling is
    enqueued at the call on the caller's stream, ahead of the op's start on it, in a
    group too (before the group's ops run); results as on the host. A small all_reduce
    on the direct path (up to 64 KiB, nothing queued) enqueues no scaling: it scales its
    page-locked copy on the host (the next test)."""
    made: list[FakeDeviceSpace] = []

    def make(device: int) -> FakeDeviceSpace:
        made.append(FakeDeviceSpace(device))
        return made[-1]

    monkeypatch.setattr(_communicator, "device_space", make)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_MAX", "64K")  # (past it: the device's own path)
    dt = np.dtype(np.float16)
    count = 40_013  # (80 KB: past the direct path's 64 KiB)

    async def fn(comm: acoll.Communicator) -> list[Any]:
        n = comm.size
        assert isinstance(comm.mem, FakeDeviceSpace)
        space = comm.mem
        want = _want(count, n, 60000, dt)
        x = to_dev(0)(np.full(count, 60000, dt))
        await comm.all_reduce(x, op=acoll.AVG, stream="s1")
        first = list(space.events)
        space.events.clear()
        y = to_dev(0)(np.full(n * 4099, 60000, dt))
        out = to_dev(0)(np.zeros(4099, dt))
        async with comm.group():
            await comm.reduce_scatter(y, out, op=acoll.AVG, stream="s2")
            in_group = list(space.events)
        return [first, in_group, np.array_equal(to_host(x), want),
                np.array_equal(to_host(out), want[:4099]), (to_host(y) == 60000).all()]

    for first, in_group, ok_ar, ok_rs, send_kept in await run_ranks(3, fn, device=0):
        assert first[0] == ("scale", "s1"), first  # (before the op's own stream work)
        assert in_group == [("scale", "s2")], in_group
        assert ok_ar
        assert ok_rs
        assert send_kept


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("nranks", [2, 3])
async def test_small_device_average_scales_its_host_copy_only(
        dtype: str, nranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device AVG all_reduce of up to 64 KiB made while nothing is queued (the direct
    path through a page-locked copy) puts no scaling on any stream: the copy is scaled
    on the host once downloaded, then summed. Random inputs: the same bits as the same
    call in a group (ordered after the stream by events: scaled on the stream at the
    call, then the same algorithm), and with 2 ranks (one addition) as the reference;
    out of place (the send buffer kept) and in place, with and without stream=, repeated
    (the plan reused); float16's 60000 averages to a finite value."""
    monkeypatch.setattr(_communicator, "device_space", FakeDeviceSpace)
    monkeypatch.setenv("ACOLL_GPU_VIA_HOST_MAX", "64K")
    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    counts = [1, 7, 4099, (64 << 10) // dt.itemsize]

    def inputs(rank: int, count: int) -> np.ndarray[Any, Any]:
        return (np.random.default_rng(rank + 10 * count).standard_normal(count)
                * 100).astype(dt)

    async def dev(comm: acoll.Communicator) -> list[Any]:
        assert isinstance(comm.mem, FakeDeviceSpace)
        space, got = comm.mem, []
        for count in counts:
            mine = inputs(comm.rank, count)
            results = []
            for stream in (None, "s1", None):
                send = to_dev(0)(mine)
                out = to_dev(0)(np.zeros(count, dt))
                await comm.all_reduce(send, out, op=acoll.AVG, stream=stream)
                assert np.array_equal(to_host(send), mine)
                x = to_dev(0)(mine)
                await comm.all_reduce(x, op=acoll.AVG, stream=stream)
                results += [to_host(out).tobytes(), to_host(x).tobytes()]
            assert [e for e in space.events if e[0] == "scale"] == []
            grouped = to_dev(0)(mine)
            async with comm.group():
                await comm.all_reduce(grouped, op=acoll.AVG)
            assert [e for e in space.events if e[0] == "scale"] == [("scale", None)]
            space.events.clear()
            assert results == [to_host(grouped).tobytes()] * len(results), count
            got.append(results[0])
        if dt == np.float16:
            big = to_dev(0)(np.full(4101, 60000, dt))
            await comm.all_reduce(big, op=acoll.AVG)
            assert np.array_equal(to_host(big), _want(4101, comm.size, 60000, dt))
        assert len(comm._via_plans) == len(counts) + (dt == np.float16)
        return got

    got = await run_ranks(nranks, dev, device=0)
    assert all(g == got[0] for g in got)
    if nranks == 2:
        for k, count in enumerate(counts):
            want = reference([inputs(r, count) for r in range(2)], acoll.AVG)
            assert got[0][k] == want.tobytes(), count


async def test_scaled_copies_of_their_own_are_reused_and_few() -> None:
    """reduce_scatter / non-root reduce AVG scale into host memory of their own: reused
    (the smallest idle one that fits), at most two kept, none after close."""

    async def fn(comm: acoll.Communicator) -> list[Any]:
        n = comm.size
        seen = []
        # (largest first: the smallest kept one is then not first in the list)
        outs = [np.empty(1000 * (4 - k), np.float32) for k in range(4)]
        async with comm.group():
            for out in outs:
                await comm.reduce_scatter(np.ones(n * out.size, np.float32), out,
                                          op=acoll.AVG)
        seen.append(sorted(a.nbytes for a in comm._avg_spares))
        assert all(np.array_equal(o, np.ones_like(o)) for o in outs)
        small = np.empty(10, np.float32)
        before = {id(a) for a in comm._avg_spares}
        await comm.reduce_scatter(np.ones(n * 10, np.float32), small, op=acoll.AVG)
        seen.append({id(a) for a in comm._avg_spares} == before)  # (reused, none new)
        await comm.reduce(np.ones(5, np.float32), None, op=acoll.AVG, root=1)
        await comm.close()
        seen.append(len(comm._avg_spares))
        return seen

    for sizes, reused, after_close in await run_ranks(2, fn):
        assert sizes == [3 * 8000, 4 * 8000]  # (the two largest of the group's four)
        assert reused
        assert after_close == 0
