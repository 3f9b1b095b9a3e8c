"""The intra-host GPU path (issue 10) on real GPUs: marked ``gpu``, skipped where CuPy or
a device is missing (tests/test_p2p.py covers plans and sources without one).

- the domain forms where it should (ranks in one process: direct mode; across processes:
  copy mode through CUDA IPC; ranks sharing a GPU across processes: refused) and not
  where it should not (``ACOLL_P2P_DISABLE=1``);
- the collective matrix in copy mode with a small workspace (calls in several steps),
  unaligned buffers, groups mixing kernels, and the same matrix across two processes;
- failures: mismatched calls are reported by name on every rank; a rank that never
  arrives makes the others time out; a killed process makes the survivor fail with
  RemoteError long before the timeout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import acoll
from acoll._dtypes import BFLOAT16
from collective_cases import ALL_DTYPES, ALL_OPS, check_all, reference
from gpu_cases import NGPUS, NO_GPU_REASON, count_scale_launches, cp, to_device, to_host

HERE = Path(__file__).parent
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPUS < 1, reason=NO_GPU_REASON)]
two_gpus = pytest.mark.skipif(NGPUS < 2, reason=f"needs 2 GPUs, {NGPUS} visible")
_SOME = [d for d in ALL_DTYPES if d.name in ("uint8", "int64", "bfloat16", "float16",
                                            "float32", "float64")]


async def _form(devices: list[int], **kw: Any) -> list[acoll.Communicator]:
    uid = acoll.get_unique_id(ifname="=lo")
    n = len(devices)
    return list(await asyncio.gather(*(acoll.init_rank(n, uid, r, device=d, ifname="=lo",
                                                       **kw)
                                       for r, d in enumerate(devices))))


async def _close(comms: list[acoll.Communicator]) -> None:
    await asyncio.gather(*(c.close() for c in comms))


def _devices(n: int) -> list[int]:
    return [r % NGPUS for r in range(n)]


async def test_domain_forms_in_direct_mode_in_one_process() -> None:
    comms = await _form(_devices(2))
    try:
        for c in comms:
            assert c._p2p is not None
            assert c._p2p.direct
    finally:
        await _close(comms)


async def test_disabled_means_no_domain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_P2P_DISABLE", "1")
    comms = await _form(_devices(2))
    try:
        assert all(c._p2p is None for c in comms)
        x = [to_device(c.device or 0)(np.full(1000, c.rank + 1.0, np.float32)) for c in comms]
        await asyncio.gather(*(c.all_reduce(b) for c, b in zip(comms, x, strict=True)))
        assert all(float(to_host(b)[0]) == 3.0 for b in x)
    finally:
        await _close(comms)


@pytest.mark.parametrize("nranks", [2, 3])
async def test_average_scales_each_operand_in_the_kernels(
        nranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the P2P path a floating-point AVG runs no scaling kernel and allocates nothing:
    the reducing kernels scale each operand as they load it. The results are the
    reference's bits (inputs scaled by the rounded 1/n, summed in rank order, as the
    kernels sum), for all_reduce (one-shot and two-shot), reduce (root and not) and
    reduce_scatter, in place and not, first calls and prepared repeats; float16's 60000
    averages to a finite value."""
    launched = count_scale_launches(monkeypatch)
    comms = await _form(_devices(nranks))
    dtypes = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)]

    def inputs(rank: int, count: int, dt: Any) -> np.ndarray[Any, Any]:
        return (np.random.default_rng(rank + 7 * count).standard_normal(count)
                * 100).astype(dt)

    async def one(c: acoll.Communicator) -> list[str]:
        bad: list[str] = []
        n, r = c.size, c.rank
        dev = to_device(c.device or 0)

        def check(got: Any, want: np.ndarray[Any, Any], what: str) -> None:
            if to_host(got).tobytes() != want.tobytes():
                bad.append(what)

        for dt in dtypes:
            for count in (1, 4099, 300_001):  # (the last: two-shot)
                ins = [inputs(k, count, dt) for k in range(n)]
                want = reference(ins, acoll.AVG)
                for rep in range(2):  # (the second: a prepared call)
                    x, out = dev(ins[r]), dev(np.zeros(count, dt))
                    await c.all_reduce(x, out, op="avg")
                    check(out, want, f"all_reduce {dt} {count} {rep}")
                    check(x, ins[r], f"all_reduce {dt} {count} {rep} send")
                    await c.all_reduce(x, op=acoll.AVG)
                    check(x, want, f"all_reduce in place {dt} {count} {rep}")
                    res = dev(np.zeros(count, dt))
                    await c.reduce(dev(ins[r]), res, op="avg", root=n - 1)
                    if r == n - 1:
                        check(res, want, f"reduce {dt} {count} {rep}")
                whole = [inputs(k, count * n, dt) for k in range(n)]
                block = np.s_[r * count:(r + 1) * count]
                out = dev(np.zeros(count, dt))
                await c.reduce_scatter(dev(whole[r]), out, op="avg")
                check(out, reference([w[block] for w in whole], acoll.AVG),
                      f"reduce_scatter {dt} {count}")
        big = dev(np.full(4099, 60000, np.float16))
        await c.all_reduce(big, op="avg")
        if not np.isfinite(to_host(big)).all():
            bad.append("float16 60000")
        return bad

    try:
        assert all(c._p2p is not None for c in comms)
        assert await asyncio.gather(*(one(c) for c in comms)) == [[]] * nranks
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)
    assert launched == []


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("nranks", "direct"), [(2, "0"), (3, "0"), (4, "0"), (4, "1"),
                                               (8, "0"), (8, "1")])
async def test_matrix_copy_mode_in_steps(nranks: int, direct: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy mode (as across processes) with a 1 MiB workspace: the 2.4 MB cases take
    several steps; reduce_scatter/all_to_all split the workspace between ranks. With 4
    and 8 ranks (2 or 4 per GPU on a 2-GPU host, all on one GPU on a 1-GPU host: what
    the lent hosts allow of issue 13) also in direct mode."""
    monkeypatch.setenv("ACOLL_P2P_DIRECT", direct)
    monkeypatch.setenv("ACOLL_P2P_BUFFER", "1M")
    comms = await _form(_devices(nranks))
    try:
        assert all(c._p2p is not None and c._p2p.direct == (direct == "1") for c in comms)
        counts = [1, 7, 1000, 600_001]
        results = await asyncio.gather(*(
            check_all(c, counts, _SOME, ALL_OPS, dev=to_device(c.device or 0), host=to_host)
            for c in comms))
        assert len(set(results)) == 1
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("direct", ["1", "0"])
async def test_unaligned_buffers(direct: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers starting 2 bytes past a 16-byte boundary take the scalar path."""
    monkeypatch.setenv("ACOLL_P2P_DIRECT", direct)
    comms = await _form(_devices(2))
    try:
        async def one(c: acoll.Communicator) -> None:
            # (a device context must not be held across an await: the other rank's
            # coroutine, on this thread, switches the current device)
            with cp.cuda.Device(c.device):
                base = (cp.arange(100_001) % 7).astype(cp.float16)
                x = base[1:]  # 2-byte offset
                want = (cp.asnumpy(x).astype(np.float32) * 2).astype(np.float16)
            await c.all_reduce(x)
            with cp.cuda.Device(c.device):
                assert np.array_equal(cp.asnumpy(x), want)
                out = cp.zeros(2 * 100_000 + 1, cp.float16)[1:]
            await c.all_gather(base[1:], out)
            with cp.cuda.Device(c.device):
                got = cp.asnumpy(out)
            assert np.array_equal(got[:100_000], got[100_000:])
        await asyncio.gather(*(one(c) for c in comms))
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


async def test_group_of_different_kernels_keeps_order() -> None:
    """A group issuing float16 and float32 all-reduces (kernels compiled at different
    moments) still launches them in call order on every rank."""
    comms = await _form(_devices(2))
    try:
        async def one(c: acoll.Communicator) -> list[float]:
            with cp.cuda.Device(c.device):
                bufs = [cp.full(4096, c.rank + 1 + k, dt) for k, dt in
                        enumerate([cp.float16, cp.float32, cp.float64, cp.float16])]
            async with c.group():
                for b in bufs:
                    await c.all_reduce(b)
            await c.mem.settle()
            return [float(to_host(b)[0]) for b in bufs]
        got = await asyncio.gather(*(one(c) for c in comms))
        assert got[0] == got[1] == [3.0, 5.0, 7.0, 9.0]
    finally:
        await _close(comms)


async def test_mismatched_calls_are_named_on_every_rank() -> None:
    comms = await _form(_devices(2), timeout=20)
    sizes = [1000, 2000]
    try:
        async def one(c: acoll.Communicator) -> BaseException | None:
            with cp.cuda.Device(c.device):
                x = cp.ones(sizes[c.rank], cp.float32)
            try:
                await c.all_reduce(x)
            except acoll.AcollError as exc:
                return exc
            return None
        t0 = time.monotonic()
        errs = await asyncio.gather(*(one(c) for c in comms))
        assert time.monotonic() - t0 < 10
        for err in errs:
            assert isinstance(err, acoll.InvalidUsage), err
            assert "mismatched" in str(err)
            assert "all_reduce of" in str(err)
        assert "2000 x float32" in str(errs[0])
        assert "1000 x float32" in str(errs[1])
    finally:
        for c in comms:
            c.abort()


async def test_rank_that_never_arrives_times_out() -> None:
    comms = await _form(_devices(2), timeout=3)
    try:
        with cp.cuda.Device(comms[0].device):
            x = cp.ones(1 << 20, cp.float32)
        t0 = time.monotonic()
        with pytest.raises(acoll.TimeoutError):
            await comms[0].all_reduce(x)
        took = time.monotonic() - t0
        assert 2.5 < took < 8, took
        # The other rank learns it at its next call.
        with cp.cuda.Device(comms[1].device):
            y = cp.ones(1 << 20, cp.float32)
        with pytest.raises(acoll.AcollError):
            await asyncio.wait_for(comms[1].all_reduce(y), 10)
    finally:
        for c in comms:
            c.abort()


def _hits(c: acoll.Communicator) -> int:
    assert c._prepared is not None
    return c._prepared.hits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("count", [1000, 600_001])
@pytest.mark.parametrize("native", ["1", "0"])
async def test_repeated_calls_run_prepared_and_exact(direct: str, count: int, native: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective called again on the same buffers runs prepared (prepared.hits
    counts them), with new data each round and exact results: one-shot and two-shot,
    in place and not, and (copy mode, 1 MiB workspace) calls in several steps; launched
    through the native launcher and through Python."""
    monkeypatch.setenv("ACOLL_P2P_DIRECT", direct)
    monkeypatch.setenv("ACOLL_P2P_BUFFER", "1M")
    monkeypatch.setenv("ACOLL_P2P_NATIVE", native)
    comms = await _form(_devices(2))
    n = len(comms)
    for c in comms:
        assert c._p2p is not None
        assert (c._p2p.launcher is not None) == (native == "1"), "native launcher"
    try:
        async def one(c: acoll.Communicator) -> int:
            r = c.rank
            with cp.cuda.Device(c.device):
                base = cp.arange(count, dtype=cp.float32) % 1000
                x, inplace, out = cp.empty_like(base), cp.empty_like(base), cp.empty_like(base)
                gathered = cp.empty(n * count, cp.float32)
                block = cp.empty(count // n * n, cp.float32)
                part = cp.empty(count // n, cp.float32)
                a2a = cp.empty(count // n * n, cp.float32)
            host = np.arange(count, dtype=np.float32) % 1000
            for k in range(4):
                with cp.cuda.Device(c.device):
                    x[...] = base + (r + k)
                    inplace[...] = base * (r + 1) + k
                    block[...] = base[:block.size] + r
                await c.all_reduce(x, out)
                await c.all_reduce(inplace, op="max")
                await c.all_gather(x, gathered)
                await c.reduce_scatter(block, part)
                await c.broadcast(x, root=1)
                await c.reduce(inplace, out, root=0, op="min")
                await c.all_to_all(block, a2a)
                with cp.cuda.Device(c.device):
                    got = {name: cp.asnumpy(v) for name, v in [
                        ("inplace", inplace), ("out", out), ("gathered", gathered),
                        ("part", part), ("x", x), ("a2a", a2a)]}
                want_sum = sum(host + (q + k) for q in range(n))
                want_max = host * n + k
                assert np.array_equal(got["inplace"], want_max), (k, "max")
                assert np.array_equal(got["x"], host + (1 + k)), (k, "broadcast")
                if r == 0:  # reduce's min of the max results (equal on every rank)
                    assert np.array_equal(got["out"], want_max), (k, "reduce")
                else:  # all_reduce's sum, untouched by reduce off the root
                    assert np.array_equal(got["out"], want_sum), (k, "sum")
                assert np.array_equal(got["gathered"].reshape(n, count),
                                      np.stack([host + (q + k) for q in range(n)])), k
                m = count // n
                blk = host[:m * n]
                assert np.array_equal(got["part"], (sum(blk + q for q in range(n)))[
                    r * m:(r + 1) * m]), (k, "reduce_scatter")
                assert np.array_equal(got["a2a"].reshape(n, m),
                                      np.stack([(blk + q)[r * m:(r + 1) * m]
                                                for q in range(n)])), (k, "all_to_all")
            return _hits(c)
        hits = await asyncio.gather(*(one(c) for c in comms))
        assert all(h >= 3 * 7 for h in hits), hits
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


@pytest.mark.timeout(200)
async def test_prepared_calls_on_alternating_streams_keep_launch_order() -> None:
    """In-place all_reduces alternating between two streams (and the current stream) of
    each rank: each launch follows the rank's previous one, so every call doubles the
    previous result exactly."""
    comms = await _form(_devices(2))
    rounds = 12
    try:
        async def one(c: acoll.Communicator) -> float:
            with cp.cuda.Device(c.device):
                x = cp.ones(4 << 20, cp.float32)  # two-shot, 16 MiB
                streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
                cp.cuda.get_current_stream().synchronize()
            for k in range(rounds):
                await c.all_reduce(x, stream=None if k % 3 == 2 else streams[k % 2])
            with cp.cuda.Device(c.device):
                for st in streams:
                    st.synchronize()
                got = cp.asnumpy(x)
            assert _hits(c) >= rounds - 1
            assert np.all(got == got[0]), got
            return float(got[0])
        got = await asyncio.gather(*(one(c) for c in comms))
        assert got == [2.0 ** rounds] * 2
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


@pytest.mark.timeout(120)
async def test_prepared_calls_of_ranks_sharing_a_gpu_share_no_stream() -> None:
    """Two ranks on one GPU, called on the device's default stream, then on one stream
    object passed to both: each rank's kernel goes to a stream of its own (on a shared
    stream the first kernel would wait for its peer queued behind it until the timeout)."""
    comms = await _form([0, 0], timeout=10)
    try:
        assert all(c._p2p is not None and c._p2p.shares_gpu for c in comms)
        with cp.cuda.Device(0):
            xs = [cp.ones(1 << 18, cp.float32) for _ in comms]
            shared = cp.cuda.Stream(non_blocking=True)
            cp.cuda.get_current_stream().synchronize()
        for _ in range(4):
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        for _ in range(4):
            await asyncio.gather(*(c.all_reduce(x, stream=shared)
                                   for c, x in zip(comms, xs, strict=True)))
        with cp.cuda.Device(0):
            shared.synchronize()
            got = [cp.asnumpy(x) for x in xs]
        assert not any(c._p2p is None or c._p2p.failed for c in comms)
        assert all(_hits(c) >= 6 for c in comms)
        assert all(bool((g == 2.0 ** 8).all()) for g in got), [g[:4] for g in got]
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


async def test_prepared_calls_keep_no_array_alive() -> None:
    import gc
    import weakref
    comms = await _form(_devices(2))

    async def call(c: acoll.Communicator, x: Any) -> None:
        await c.all_reduce(x)  # (returns None: gather's result holds no array)

    try:
        for calls, hits in [(1, 0), (2, 1)]:  # learned only; then run prepared too
            xs = [to_device(c.device or 0)(np.ones(1000 * calls, np.float32)) for c in comms]
            for _ in range(calls):
                await asyncio.gather(*(call(c, x) for c, x in zip(comms, xs, strict=True)))
            assert all(_hits(c) == hits for c in comms)
            refs = [weakref.ref(x) for x in xs]
            del xs
            gc.collect()
            alive = [ref() for ref in refs if ref() is not None]
            assert not alive, (calls, [[type(h).__name__ + ":" + repr(h)[:120] for h in
                                        gc.get_referrers(a)] for a in alive])
    finally:
        await _close(comms)


async def test_prepared_calls_without_stream_leave_the_callers_stream_alone() -> None:
    """Without stream= a prepared kernel goes to the communicator's stream (after an event
    on the caller's), as on the general route: the caller's stream, which the application
    may share between communicators, never waits for a kernel spinning for its peers. A
    root that is not an int never keys a prepared call."""
    comms = await _form(_devices(2))
    try:
        xs = [to_device(c.device or 0)(np.ones(1000, np.float32)) for c in comms]
        for _ in range(3):
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        for c in comms:
            assert _hits(c) == 2
            assert c._p2p is not None
            assert c._p2p._last_ptr == c._p2p.space.stream.ptr
            assert c._prepared is not None
            assert c._prepared.key("broadcast", xs[0], None, None, np.int64(1)) is None
    finally:
        await _close(comms)


@pytest.mark.timeout(120)
async def test_close_waits_for_prepared_kernels_on_callers_streams(
        caplog: pytest.LogCaptureFixture) -> None:
    """A prepared call with stream= leaves its kernel on the caller's stream behind 200 ms
    of other work; close() must wait for it before it frees the workspace (not keep the
    workspace because a kernel still runs)."""
    import logging

    from acoll._cuda.spin import spin
    caplog.set_level(logging.INFO, logger="acoll")
    comms = await _form(_devices(2))
    streams = []
    for c in comms:
        with cp.cuda.Device(c.device):
            streams.append(cp.cuda.Stream(non_blocking=True))
    xs = [to_device(c.device or 0)(np.ones(1 << 16, np.float32)) for c in comms]
    for c in comms:  # (the copies to the device are on the default stream, which the
        with cp.cuda.Device(c.device):  # non-blocking streams above do not wait for)
            cp.cuda.get_current_stream().synchronize()
    try:
        for k in range(2):
            if k:
                for c, st in zip(comms, streams, strict=True):
                    with cp.cuda.Device(c.device):
                        spin(0.2, st)
            await asyncio.gather(*(c.all_reduce(x, stream=st)
                                   for c, x, st in zip(comms, xs, streams, strict=True)))
        assert all(_hits(c) == 1 for c in comms)
        assert all(c._p2p is not None and c._p2p.busy for c in comms)
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)
    assert "workspace kept" not in caplog.text
    for c, st, x in zip(comms, streams, xs, strict=True):
        with cp.cuda.Device(c.device):
            st.synchronize()
            assert bool((x == 4).all())


@pytest.mark.timeout(120)
async def test_two_prepared_calls_of_one_rank_in_flight_fail_at_once_on_abort() -> None:
    """Two calls of rank 0 waiting for rank 1 (which makes neither): the first prepared,
    the second behind it (one launch of a rank waits for the other local ranks at a
    time); abort() ends both at once, not at the 30 s timeout."""
    comms = await _form(_devices(2), timeout=30)
    try:
        pairs = [[to_device(c.device or 0)(np.ones(n, np.float32)) for c in comms]
                 for n in (1000, 2000)]
        for xs in pairs:
            for _ in range(2):
                await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs,
                                                                       strict=True)))
        hits = _hits(comms[0])
        tasks = [asyncio.ensure_future(comms[0].all_reduce(xs[0])) for xs in pairs]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)
        assert _hits(comms[0]) == hits + 1  # the second waits its turn
        t0 = time.monotonic()
        comms[0].abort()
        done, _ = await asyncio.wait(tasks, timeout=5)
        assert len(done) == 2, time.monotonic() - t0
        assert all(isinstance(t.exception(), acoll.AcollError) for t in tasks)
    finally:
        for c in comms:
            c.abort()


class _BrokenLauncher:
    """The native launcher, its driver's cuLaunchKernel failing (700, illegal address)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def run(self, jobs: Any, n: int) -> int:
        for k in range(n):
            jobs[k].result, jobs[k].failed_at = 700, 4
        return n


@pytest.mark.parametrize("route", ["prepared", "native", "general"])
async def test_a_failed_cuda_call_at_launch_fails_the_communicator(
        route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA call that fails while rank 0 enqueues a P2P call (injected) is a
    TransportError there, naming the path, with the CUDA error as its cause (or, from
    the native launcher, naming the driver call and its CUresult); the communicator
    fails, and rank 1 learns it (an error, not a hang)."""
    comms = await _form(_devices(2), timeout=20)
    try:
        xs = [to_device(c.device or 0)(np.ones(1000, np.float32)) for c in comms]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        dom = comms[0]._p2p
        assert dom is not None

        def broken(*args: Any, **kw: Any) -> None:
            raise cp.cuda.runtime.CUDARuntimeError(700)  # cudaErrorIllegalAddress

        if route == "native":  # both ranks (one process: their launches are one C call)
            from acoll._cuda.launcher import load
            real = load()
            assert real is not None, "the native launcher did not load"
            broken_launcher = _BrokenLauncher(real)
            for c in comms:
                d = c._p2p
                assert d is not None
                monkeypatch.setattr(d, "ctx", real.primary_context(d.device))
                monkeypatch.setattr(d, "launcher", broken_launcher)
        else:
            monkeypatch.setattr(dom, "launcher", None)
            monkeypatch.setattr(dom, "launch_prepared" if route == "prepared" else "launch",
                                broken)
        if route == "general":
            comms[0]._prepared = None
        t0 = time.monotonic()
        got = await asyncio.gather(*(asyncio.wait_for(c.all_reduce(x), 15)
                                     for c, x in zip(comms, xs, strict=True)),
                                   return_exceptions=True)
        assert time.monotonic() - t0 < 12
        assert isinstance(got[0], acoll.TransportError), got
        assert "peer-to-peer" in str(got[0])
        if route == "native":
            assert "cuLaunchKernel returned CUresult 700" in str(got[0])
        else:
            assert isinstance(got[0].__cause__, cp.cuda.runtime.CUDARuntimeError)
        assert isinstance(got[1], acoll.AcollError), got
        assert comms[0].error is not None
    finally:
        for c in comms:
            c.abort()


async def test_a_closed_domain_is_never_read() -> None:
    comms = await _form(_devices(2))
    await _close(comms)
    for c in comms:
        dom = c._p2p
        assert dom is not None
        assert dom.failed
        with pytest.raises(acoll.ClosedError):
            dom.check()


@pytest.mark.timeout(120)
async def test_a_rooted_call_queued_on_one_rank_and_idle_on_the_other() -> None:
    """broadcast and reduce (rooted: on the general route the ranks agree on the call over
    the network) made while rank 0's executor is busy (its lock held for 0.2 s) and rank
    1's idle: rank 0 runs the call through its queue, rank 1 at once. The kernels check
    that both run the same call; an agreement on rank 0 would wait for rank 1, which
    takes no part in it, until the 10 s timeout."""
    comms = await _form(_devices(2), timeout=10)
    try:
        xs = [to_device(c.device or 0)(np.full(1000, c.rank + 1.0, np.float32))
              for c in comms]
        lock = comms[0]._exec.lock

        async def release_later() -> None:
            await asyncio.sleep(0.2)
            lock.release()

        for call in ("broadcast", "reduce", "broadcast"):
            await lock.acquire()
            t0 = time.monotonic()
            if call == "broadcast":
                calls = [c.broadcast(x, root=1) for c, x in zip(comms, xs, strict=True)]
            else:
                calls = [c.reduce(x, root=0) for c, x in zip(comms, xs, strict=True)]
            await asyncio.gather(*calls, release_later())
            assert time.monotonic() - t0 < 5, call
        # broadcast from rank 1: 2 everywhere; reduce to rank 0 in place: 4 there; then
        # rank 1's 2 everywhere again
        assert [float(to_host(x)[0]) for x in xs] == [2.0, 2.0]
    finally:
        for c in comms:
            c.abort()


async def test_prepared_calls_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_P2P_PREPARED", "0")
    comms = await _form(_devices(2))
    try:
        assert all(c._p2p is not None and c._prepared is None for c in comms)
        x = [to_device(c.device or 0)(np.full(100, c.rank + 1.0, np.float32)) for c in comms]
        for _ in range(3):
            await asyncio.gather(*(c.all_reduce(b) for c, b in zip(comms, x, strict=True)))
        assert [float(to_host(b)[0]) for b in x] == [12.0, 12.0]
    finally:
        await _close(comms)


async def test_a_prepared_call_against_another_call_is_named() -> None:
    comms = await _form(_devices(2), timeout=20)
    try:
        async def one(c: acoll.Communicator) -> BaseException | None:
            with cp.cuda.Device(c.device):
                x = cp.ones(1000, cp.float32)
                y = cp.ones(2000, cp.float32)
            await c.all_reduce(x)
            await c.all_reduce(x)
            hits = _hits(c)
            try:
                await c.all_reduce(x if c.rank == 0 else y)  # rank 0: prepared
            except acoll.AcollError as exc:
                assert _hits(c) == hits + (c.rank == 0)
                return exc
            return None
        t0 = time.monotonic()
        errs = await asyncio.gather(*(one(c) for c in comms))
        assert time.monotonic() - t0 < 10
        for err in errs:
            assert isinstance(err, acoll.InvalidUsage), err
            assert "mismatched" in str(err)
        assert "2000 x float32" in str(errs[0])
        assert "1000 x float32" in str(errs[1])
    finally:
        for c in comms:
            c.abort()


async def test_a_prepared_call_the_other_rank_never_makes_times_out() -> None:
    comms = await _form(_devices(2), timeout=3)
    try:
        xs = [to_device(c.device or 0)(np.ones(1 << 16, np.float32)) for c in comms]
        for _ in range(2):
            await asyncio.gather(*(c.all_reduce(b) for c, b in zip(comms, xs, strict=True)))
        hits = _hits(comms[0])
        t0 = time.monotonic()
        with pytest.raises(acoll.TimeoutError):
            await comms[0].all_reduce(xs[0])
        assert _hits(comms[0]) == hits + 1
        assert 2.5 < time.monotonic() - t0 < 8
        with pytest.raises(acoll.AcollError):
            await asyncio.wait_for(comms[1].all_reduce(xs[1]), 10)
    finally:
        for c in comms:
            c.abort()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["devices", "one gpu", "8 ranks"])
async def test_one_task_drives_every_rank_through_a_group(where: str) -> None:
    """The seed program's pattern on GPUs: one task calls every rank inside
    ``acoll.group()``, every collective exact, in place and not, one-shot and two-shot;
    ranks sharing one GPU too, and 8 ranks on the GPUs there are (issue 13's pattern,
    as far as the lent hosts allow). Repeated calls run prepared where they can
    (launched at the call, awaited at the exit, no task per rank)."""
    devices = {"devices": _devices(2), "one gpu": [0, 0], "8 ranks": _devices(8)}[where]
    comms = await _form(devices)
    n = len(comms)
    rounds = 6
    try:
        bufs: dict[int, dict[str, Any]] = {}
        for c in comms:
            with cp.cuda.Device(c.device):
                bufs[c.rank] = {"small": cp.empty(1000, cp.float32),
                                "big": cp.empty(600_001, cp.float32),
                                "out": cp.empty(600_001, cp.float32),
                                "gathered": cp.empty(1000 * n, cp.float32),
                                "part": cp.empty(1000, cp.float32)}
                cp.cuda.get_current_stream().synchronize()
        for k in range(rounds):
            for c in comms:
                b = bufs[c.rank]
                with cp.cuda.Device(c.device):
                    b["small"].fill(c.rank + k)
                    b["big"].fill(c.rank + 2 * k)
            async with acoll.group():
                for c in comms:
                    b = bufs[c.rank]
                    await c.all_reduce(b["small"])
                    await c.all_reduce(b["big"], b["out"], op="max")
                    await c.all_gather(b["small"], b["gathered"])
                    await c.reduce_scatter(b["gathered"], b["part"])
            for c in comms:
                b = bufs[c.rank]
                with cp.cuda.Device(c.device):
                    small = cp.asnumpy(b["small"])
                    out = cp.asnumpy(b["out"])
                    part = cp.asnumpy(b["part"])
                want = sum(q + k for q in range(n))
                assert bool((small == want).all()), (k, small[:4])
                assert bool((out == n - 1 + 2 * k).all()), (k, out[:4])
                assert bool((part == n * want).all()), (k, part[:4])
        # A rank's first call of a round runs prepared; its later ones wait for that
        # launch's ticket (the other rank has not called yet: the launch waits for it)
        # and join the group on the general route. The last rank to call launches the
        # pair at its own call and may run its second call prepared as well.
        hits = [_hits(c) for c in comms]
        assert all(h >= rounds - 1 for h in hits), hits
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


@pytest.mark.timeout(120)
async def test_a_group_raising_after_a_prepared_launch_fails_fast() -> None:
    """Rank 0's prepared call waits in the group for rank 1's, which the block never
    makes: the block raises, both communicators fail at once (no wait for the timeout),
    and nothing is left waiting."""
    comms = await _form(_devices(2), timeout=20)
    try:
        xs = [to_device(c.device or 0)(np.ones(1 << 12, np.float32)) for c in comms]
        for _ in range(2):
            await asyncio.gather(*(c.all_reduce(b) for c, b in zip(comms, xs, strict=True)))
        hits = _hits(comms[0])
        t0 = time.monotonic()

        async def block() -> None:
            async with acoll.group():
                await comms[0].all_reduce(xs[0])
                raise KeyError("user code failed")

        with pytest.raises(KeyError):
            await block()
        assert _hits(comms[0]) == hits + 1
        assert time.monotonic() - t0 < 5
        assert isinstance(comms[0].error, acoll.RemoteError), comms[0].error
        with pytest.raises(acoll.AcollError):
            await asyncio.wait_for(comms[1].all_reduce(xs[1]), 5)
    finally:
        for c in comms:
            c.abort()


@pytest.mark.timeout(120)
async def test_a_group_mixing_prepared_and_general_calls_keeps_their_order() -> None:
    """In one group, a prepared call on one communicator and general-route calls on the
    other (first seen: not prepared yet; then a new buffer) meet at the exit; repeated
    in-place sums double exactly each round."""
    comms = await _form(_devices(2))
    try:
        with cp.cuda.Device(comms[0].device):
            a = cp.ones(1 << 10, cp.float32)
        with cp.cuda.Device(comms[1].device):
            b = cp.ones(1 << 10, cp.float32)
            cp.cuda.get_current_stream().synchronize()
        await asyncio.gather(comms[0].all_reduce(a), comms[1].all_reduce(b))  # learned
        for k in range(3):
            with cp.cuda.Device(comms[1].device):
                fresh = b.copy()  # a new address: the general route on rank 1
                cp.cuda.get_current_stream().synchronize()
            async with acoll.group():
                await comms[0].all_reduce(a)
                await comms[1].all_reduce(fresh)
            with cp.cuda.Device(comms[1].device):
                b = fresh
            with cp.cuda.Device(comms[0].device):
                assert float(cp.asnumpy(a)[0]) == 2.0 ** (k + 2), k
            with cp.cuda.Device(comms[1].device):
                assert bool((cp.asnumpy(b) == 2.0 ** (k + 2)).all()), k
    except BaseException:
        for c in comms:
            c.abort()
        raise
    await _close(comms)


def _run_pair(script: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    return subprocess.run([sys.executable, "-m", "acoll.run", "-n", "2", "--", sys.executable,
                           str(HERE / script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@two_gpus
@pytest.mark.timeout(300)
def test_matrix_across_processes_over_cuda_ipc() -> None:
    proc = _run_pair("mp_p2p.py", "matrix", timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("copy mode") == 2, proc.stdout
    assert proc.stdout.count("checks passed") == 2, proc.stdout


@two_gpus
@pytest.mark.timeout(200)
def test_prepared_calls_across_processes_follow_registrations() -> None:
    proc = _run_pair("mp_p2p.py", "prepared", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("prepared calls exact") == 2, proc.stdout


@two_gpus
@pytest.mark.timeout(200)
def test_registered_buffers_are_read_in_place_across_processes() -> None:
    proc = _run_pair("mp_p2p.py", "registered", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("registered calls exact, 0 bytes copied") == 2, proc.stdout


def test_ranks_sharing_a_gpu_across_processes_do_not_form_a_domain() -> None:
    env_gpu = "0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    env["CUDA_VISIBLE_DEVICES"] = env_gpu
    proc = subprocess.run([sys.executable, "-m", "acoll.run", "-n", "2", "--", sys.executable,
                           str(HERE / "mp_p2p.py"), "probe"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("no domain") == 2, proc.stdout


@two_gpus
@pytest.mark.timeout(120)
def test_killed_process_fails_the_survivor_fast() -> None:
    t0 = time.monotonic()
    proc = _run_pair("mp_p2p.py", "kill", timeout=100)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert "survivor: RemoteError" in out, out[-3000:]
    assert took < 40, took  # the communicator timeout there is 60 s
