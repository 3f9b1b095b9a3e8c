"""The intra-host GPU path without a GPU: step plans, descriptors, the launch order of a
group, and the kernel sources (compiled with nvcc for sm_90 when it is installed)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from acoll._cuda import p2p_kernels as pk
from acoll._cuda.p2p_kernels import Mode
from acoll._dtypes import DTYPE_NAMES, DTYPES, dtype_code
from acoll._p2p.ops import Sequencer
from acoll._p2p.plan import Piece, blocks_for, describe, pack_sig, plan
from acoll.errors import RemoteError

MiB = 1 << 20


def _plan(mode: int, count: int, *, itemsize: int = 4, n: int = 2, rank: int = 0,
          root: int = 0, capacity: int = MiB, direct: bool = False) -> list:
    return plan(mode, count, itemsize, n, rank, root, capacity=None if direct else capacity,
                most_blocks=64)


def test_all_reduce_steps_cover_the_buffer_in_workspace_sized_pieces() -> None:
    count = 600_001  # float32: 2.4 MB > 1 MiB workspace -> 3 steps
    steps = _plan(Mode.ALL_REDUCE_TWO_SHOT, count)
    assert [s.index for s in steps] == [0, 1, 2]
    assert sum(s.n for s in steps) == count
    assert [s.in_off for s in steps] == [0, 262144, 524288]
    for s in steps:
        assert s.n * 4 <= MiB
        assert s.in_off % 4 == 0  # 16-byte aligned step starts
        assert s.pieces == (Piece(0, s.in_off, s.n),)


def test_without_capacity_a_call_is_one_step() -> None:
    """Direct mode: ranks read user buffers in place (they skip the pieces)."""
    steps = _plan(Mode.ALL_REDUCE_TWO_SHOT, 10_000_000, direct=True)
    assert len(steps) == 1
    assert steps[0].n == 10_000_000


def test_reduce_scatter_and_all_to_all_copy_every_rank_block() -> None:
    count, n = 100_000, 4
    for mode in (Mode.REDUCE_SCATTER, Mode.ALL_TO_ALL):
        steps = _plan(mode, count, n=n)
        assert sum(s.n for s in steps) == count
        for s in steps:
            assert s.n * 4 * n <= MiB
            assert s.src_stride == s.n
            assert s.user_stride == count
            assert s.pieces == tuple(Piece(q * s.n, q * count + s.in_off, s.n)
                                     for q in range(n))
        assert all(s.out_stride == (count if mode == Mode.ALL_TO_ALL else 0) for s in steps)
        direct = _plan(mode, count, n=n, direct=True)
        assert len(direct) == 1
        assert direct[0].user_stride == count


def test_broadcast_only_the_root_copies() -> None:
    assert _plan(Mode.BROADCAST, 1000, rank=1, root=1)[0].pieces == (Piece(0, 0, 1000),)
    assert _plan(Mode.BROADCAST, 1000, rank=0, root=1)[0].pieces == ()


def test_all_gather_strides_by_the_block() -> None:
    steps = _plan(Mode.ALL_GATHER, 500_000)
    assert all(s.out_stride == 500_000 for s in steps)
    assert sum(s.n for s in steps) == 500_000


def test_plans_agree_across_ranks_except_root_copies() -> None:
    for mode in (Mode.ALL_REDUCE_ONE_SHOT, Mode.REDUCE, Mode.ALL_GATHER, Mode.ALL_TO_ALL):
        a = [(s.n, s.blocks, s.index) for s in _plan(mode, 777_777, n=3, rank=0)]
        b = [(s.n, s.blocks, s.index) for s in _plan(mode, 777_777, n=3, rank=2)]
        assert a == b


def test_empty_and_tiny() -> None:
    assert _plan(Mode.ALL_REDUCE_ONE_SHOT, 0) == []
    (s,) = _plan(Mode.ALL_REDUCE_ONE_SHOT, 1, itemsize=1)
    assert s.n == 1
    assert s.blocks == 1
    with pytest.raises(ValueError, match="workspace"):
        _plan(Mode.ALL_TO_ALL, 10, n=32, capacity=256)


def test_blocks_grow_with_bytes_up_to_the_limit() -> None:
    assert blocks_for(8, 64) == 1
    assert blocks_for(1 * MiB, 64) == 64
    assert blocks_for(1 * MiB, 16) == 16
    assert blocks_for(1 << 30, 1000) == pk.MAX_BLOCKS


def test_descriptors_name_the_call() -> None:
    names = {dtype_code(dt): DTYPE_NAMES[dt] for dt in DTYPES}
    f32 = dtype_code(np.dtype(np.float32))
    sig = pack_sig(Mode.BROADCAST, f32, 0, 3, 7)
    assert describe(sig, 1024, names) == "broadcast of 1024 x float32, root 3, step 7"
    sig = pack_sig(Mode.ALL_REDUCE_TWO_SHOT, f32, 2, 0, 0)
    assert describe(sig, 5, names) == "all_reduce of 5 x float32, op 2, step 0"
    assert pack_sig(Mode.ALL_GATHER, f32, 0, 0, 1) != pack_sig(Mode.ALL_GATHER, f32, 0, 0, 2)


async def test_sequencer_launches_in_ticket_order() -> None:
    seq = Sequencer()
    order: list[int] = []
    tickets = [seq.ticket() for _ in range(4)]

    async def op(t: int, delay: float) -> None:
        await asyncio.sleep(delay)  # e.g. a kernel compiling
        await seq.turn(t)
        order.append(t)
        seq.done(t)

    await asyncio.gather(*(op(t, d) for t, d in zip(tickets, [0.03, 0.0, 0.02, 0.01],
                                                     strict=True)))
    assert order == tickets


def test_sequencer_is_idle_only_with_nothing_pending() -> None:
    seq = Sequencer()
    assert seq.idle
    first, second = seq.ticket(), seq.ticket()
    assert not seq.idle
    seq.done(second)  # out of order: the first still waits
    assert not seq.idle
    seq.done(first)
    assert seq.idle
    seq.fail(RemoteError("gone", 1))
    assert not seq.idle


async def test_local_launches_run_together_in_rank_order() -> None:
    from acoll._p2p.domain import LocalLaunch
    local = LocalLaunch(3)
    ran: list[int] = []
    first = local.submit(0, 2, lambda: ran.append(2))
    second = local.submit(0, 0, lambda: ran.append(0))
    assert first is not None
    assert second is not None
    assert ran == []
    assert local.submit(0, 1, lambda: ran.append(1)) is None  # the last one launches
    assert ran == [0, 1, 2]
    assert first.done()
    assert second.done()


async def test_local_launches_wait_while_a_kernel_module_loads() -> None:
    """While another thread loads a kernel module (it holds the kernel lock), the ranks'
    launches wait, all of them, the last rank included, and run in rank order once the
    load ended: a load waits for running kernels, so a first rank's kernel spinning for
    the next rank's could otherwise hold the next launch until the kernel's timeout."""
    import threading

    from acoll._p2p import domain
    local = domain.LocalLaunch(2)
    ran: list[int] = []
    release = threading.Event()
    holding = threading.Event()

    def load() -> None:
        with domain._kernels_lock:
            holding.set()
            release.wait(5)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert holding.wait(5)
        first = local.submit(7, 0, lambda: ran.append(0))
        last = local.submit(7, 1, lambda: ran.append(1))
        assert first is not None
        assert last is not None
        await asyncio.sleep(0.01)
        assert ran == []
        release.set()
        await asyncio.wait_for(asyncio.gather(first, last), 5)
        assert ran == [0, 1]
        assert local.pending == {}
    finally:
        release.set()
        loader.join()
    # A rank that withdrew meanwhile (its wait expired) leaves the others waiting for
    # their own deadlines, never a launch of some ranks only.
    with domain._kernels_lock:
        a = local.submit(8, 0, lambda: ran.append(10))
        b = local.submit(8, 1, lambda: ran.append(11))
        local.withdraw(8, 0)
    await asyncio.sleep(0.01)
    assert ran == [0, 1]
    assert a is not None
    assert b is not None
    assert not b.done()


async def test_sequencer_failure_wakes_waiters() -> None:
    seq = Sequencer()
    seq.ticket()  # never done: an op abandoned when its communicator failed
    later = seq.ticket()
    waiter = asyncio.ensure_future(seq.turn(later))
    await asyncio.sleep(0)
    seq.fail(RemoteError("rank 1 is gone", 1))
    with pytest.raises(RemoteError):
        await asyncio.wait_for(waiter, 1)
    with pytest.raises(RemoteError):
        await seq.turn(seq.ticket())


def test_sources_cover_every_op_and_dtype() -> None:
    names = set()
    for dt in DTYPES:
        for op in ("sum", "prod", "max", "min", "avg"):
            src = pk.reduce_source(op, dt)
            assert src.name in src.code
            assert "extern \"C\"" in src.code
            names.add(src.name)
    assert len(names) == len(DTYPES) * 5
    # floating-point AVG scales each operand as it loads it (no division); integer AVG
    # divides the sum
    for dt in ("float16", "bfloat16", "float32", "float64"):
        code = pk.reduce_source("avg", dt).code
        assert "acoll_scale(" in code, dt
        assert "acoll_fin" not in code, dt
        assert "__ddiv_rn(1.0, (double)n)" in code, dt
    assert "acoll_fin" in pk.reduce_source("avg", "int32").code
    assert "acoll_scale(" not in pk.reduce_source("avg", "int32").code
    assert "acoll_fin" not in pk.reduce_source("sum", "float16").code
    assert "acoll_scale(" not in pk.reduce_source("sum", "float16").code
    assert pk.copy_source().dtype is None


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed: P2P kernels not compile-checked")
@pytest.mark.timeout(600)
def test_sources_compile_for_sm90(tmp_path: Path) -> None:
    """The P2P kernels compile: the copy kernel and one reducing kernel per element-type
    family and op shape (float32 arithmetic, 16-bit floats through float32, AVG's
    per-operand scaling on every floating-point dtype, float64, wrapping integers with
    AVG's division, comparisons); the GPU tests run them all."""
    srcs = [pk.copy_source()] + [pk.reduce_source(op, dt) for op, dt in (
        ("sum", "float32"), ("avg", "bfloat16"), ("max", "float16"), ("prod", "float64"),
        ("avg", "int64"), ("min", "uint8"), ("avg", "float16"), ("avg", "float32"),
        ("avg", "float64"))]
    procs = []
    for src in srcs:
        path = tmp_path / f"{src.name}.cu"
        path.write_text(src.code)
        procs.append((src.name, subprocess.Popen(
            [str(NVCC), "-arch=sm_90", "-std=c++17", "--fmad=false", "-c", str(path), "-o",
             str(tmp_path / f"{src.name}.o")], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)))
        if len(procs) >= 4:
            name, p = procs.pop(0)
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"{name}: {out}"
    for name, p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}: {out}"


async def test_register_on_a_host_communicator_is_a_no_op() -> None:
    import acoll
    from acoll.testing import run_ranks

    async def fn(comm: acoll.Communicator) -> int:
        x = np.ones(100, np.float32)
        reg = await comm.register(x)
        assert isinstance(reg, acoll.Registration)
        await comm.all_reduce(x)
        await comm.deregister(reg)
        return reg.index

    assert await run_ranks(2, fn) == [-1, -1]

    async def misuse(comm: acoll.Communicator) -> None:
        # (its own call: a misuse is announced to every rank, which would fail a peer
        # still inside an earlier collective call)
        with pytest.raises(acoll.InvalidUsage, match="Registration"):
            await comm.deregister("nope")  # type: ignore[arg-type]

    await run_ranks(2, misuse)
