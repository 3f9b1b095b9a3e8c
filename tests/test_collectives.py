"""Collective correctness against NumPy: ranks {1..5} x counts x dtypes x ops."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import acoll
from acoll._dtypes import BFLOAT16
from acoll.testing import run_ranks
from collective_cases import (
    ALL_DTYPES,
    ALL_OPS,
    COUNTS,
    assert_result,
    assert_same,
    check_all,
    make_input,
    reference,
)

HERE = Path(__file__).parent


#: 4 and 5 ranks add uneven splits and recursive-doubling folds, not new dtype code paths:
#: there, one dtype of each family (8-bit int, 16-bit float via float32, 64-bit) keeps
#: the suite's time in check; 1 to 3 ranks run every dtype.
_WIDE_DTYPES = [d for d in ALL_DTYPES
                if d.name in ("int8", "uint64", "bfloat16", "float32", "float64")]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5])
async def test_full_matrix_one_loop(nranks: int) -> None:
    dtypes = ALL_DTYPES if nranks <= 3 else _WIDE_DTYPES

    async def fn(comm: acoll.Communicator) -> int:
        return await check_all(comm, COUNTS, dtypes, ALL_OPS)

    results = await run_ranks(nranks, fn)
    assert len(set(results)) == 1
    assert results[0] > 0


@pytest.mark.parametrize("algo", ["ring", "rd", "direct", "hd"])
@pytest.mark.parametrize("nranks", [2, 3, 5, 6, 8])
async def test_allreduce_each_algorithm_any_size(algo: str, nranks: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every all-reduce algorithm gives exact results, whatever the size would pick."""
    monkeypatch.setenv("ACOLL_ALGO", f"all_reduce:{algo},broadcast:chain,reduce:tree")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")  # many chunks: exercises pipelining

    async def fn(comm: acoll.Communicator) -> None:
        for count in (0, 1, 5, 1023, 50001):
            for op in ALL_OPS:
                dt = np.dtype(np.float32)
                ins = [make_input(q, count, dt, op) for q in range(nranks)]
                out = np.empty(count, dt)
                await comm.all_reduce(ins[comm.rank], out, op=op)
                assert_result(out, reference(ins, op), op, nranks,
                              f"{algo} n={nranks} c={count} {op}")
                root = count % nranks
                buf = ins[comm.rank].copy()
                await comm.broadcast(buf, root=root)
                assert_same(buf, ins[root], f"broadcast n={nranks} c={count} root={root}")

    await run_ranks(nranks, fn)


@pytest.mark.parametrize(("algo", "nranks"), [("direct", 2), ("direct", 3), ("direct", 4),
                                               ("direct", 7), ("hd", 2), ("hd", 4), ("hd", 7),
                                               ("hd", 8)])
async def test_direct_allreduce_in_place_and_uneven(algo: str, nranks: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct and halving-doubling all-reduces in place (each rank combines a block
    only once its own input there has been read or sent, so it never reads what it
    already overwrote), blocks and chunks of uneven sizes (halving-doubling: folded ranks
    with 7), every op and dtype; every rank gets the same bits."""
    monkeypatch.setenv("ACOLL_ALGO", f"all_reduce:{algo}")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    monkeypatch.setenv("ACOLL_RING_CHUNKS", "3")
    monkeypatch.setenv("ACOLL_HD_CHUNKS", "3")

    async def fn(comm: acoll.Communicator) -> list[bytes]:
        outs = []
        for dt in ALL_DTYPES:
            for count in (nranks - 1, 4099, 30011):
                for op in ALL_OPS:
                    if op == acoll.AVG and np.dtype(dt).kind in "iub":
                        continue  # (refused: an integer average would wrap)
                    ins = [make_input(q, count, dt, op) for q in range(nranks)]
                    buf = ins[comm.rank].copy()
                    await comm.all_reduce(buf, op=op)
                    assert_result(buf, reference(ins, op), op, nranks,
                                  f"{algo} n={nranks} {dt} {op}")
                    outs.append(buf.tobytes())
        return outs

    results = await run_ranks(nranks, fn)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("ring_chunks", ["0", "3"])
async def test_ring_chunk_limits(ring_chunks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring all_reduce, all_gather and reduce_scatter are exact with 4 KiB chunks always
    (``ACOLL_RING_CHUNKS=0``) and with segments cut into at most 3 chunks of any size
    (uneven last chunks), in place and not."""
    monkeypatch.setenv("ACOLL_ALGO", "all_reduce:ring")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    monkeypatch.setenv("ACOLL_RING_CHUNKS", ring_chunks)
    n = 3

    async def fn(comm: acoll.Communicator) -> None:
        assert comm.ring_chunks == int(ring_chunks)
        r = comm.rank
        for count in (0, 1, 1023, 5000, 50001):
            dt = np.dtype(np.float32)
            ins = [make_input(q, count * n, dt, acoll.SUM) for q in range(n)]
            out = np.empty(count * n, dt)
            await comm.all_reduce(ins[r], out)
            assert_same(out, reference(ins, acoll.SUM), f"all_reduce c={count}")
            mine = np.empty(count, dt)
            await comm.reduce_scatter(ins[r], mine)
            want = reference(ins, acoll.SUM)[r * count:(r + 1) * count]
            assert_same(mine, want, f"reduce_scatter c={count}")
            gathered = np.empty(count * n, dt)
            await comm.all_gather(ins[r][:count], gathered)
            assert_same(gathered, np.concatenate([x[:count] for x in ins]),
                        f"all_gather c={count}")

    await run_ranks(n, fn)


def test_ring_chunk_items_arithmetic() -> None:
    """The smallest chunk is ACOLL_CHUNK_SIZE; a larger segment is cut into at most
    ring_chunks chunks of at most ACOLL_RING_CHUNK_MAX; 0 turns the limit off."""
    from acoll._coll.algorithms import chunk_ranges, ring_chunk_items

    mib = 1 << 20
    assert ring_chunk_items(512 << 10, 8, 4 * mib, 4, mib) == 128 << 10  # 4 MiB: 8 x 512K
    assert ring_chunk_items(512 << 10, 8, 4 * mib, 4, 4 * mib) == 512 << 10  # 8 x 2 MiB
    assert ring_chunk_items(512 << 10, 8, 4 * mib, 4, 64 * mib) == mib  # capped: 4 MiB
    assert ring_chunk_items(512 << 10, 8, 64 << 10, 4, 64 * mib) == 128 << 10  # cap < base
    assert ring_chunk_items(512 << 10, 0, 4 * mib, 4, 4 * mib) == 128 << 10
    assert ring_chunk_items(4096, 3, 4 * mib, 4, 1000) == 1024  # (the floor: 1 KiB items)
    chunk = ring_chunk_items(4096, 3, 4 * mib, 4, 50001)
    assert chunk == 16667
    assert len(chunk_ranges(0, 50001, chunk)) == 3
    assert ring_chunk_items(1, 8, 8, 8, 0) == 1


async def test_grown_ring_chunks_stay_within_early_limit(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Chunks that arrive before their receive is posted (a late rank) are kept up to
    ACOLL_SOCKET_MAX_EARLY: ACOLL_RING_CHUNK_MAX keeps grown chunks under it (without the
    cap, 8 chunks of a 16 MiB segment were 2 MiB each and failed the connection)."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_SHM_DISABLE", "1")
    monkeypatch.setenv("ACOLL_ALGO", "all_reduce:ring")
    monkeypatch.setenv("ACOLL_SOCKET_MAX_EARLY", "1M")
    monkeypatch.setenv("ACOLL_RING_CHUNK_MAX", "1M")
    count = 8 << 20  # 32 MiB of float32: 16 MiB segments

    async def fn(comm: acoll.Communicator) -> None:
        x = np.ones(count, np.float32)
        out = np.empty_like(x)
        await comm.all_reduce(x, out)  # connections up
        if comm.rank == 1:
            await asyncio.sleep(0.3)  # rank 0's first chunks arrive before rank 1 posts
        await comm.all_reduce(x, out)
        assert (out == 2).all()

    await run_ranks(2, fn, timeout=30)


async def test_results_identical_on_every_rank_for_random_floats() -> None:
    """All ranks must hold bit-identical all-reduce results (as NCCL guarantees)."""

    async def fn(comm: acoll.Communicator) -> bytes:
        rng = np.random.default_rng(comm.rank)
        out = []
        for count in (3, 4097, 300001):
            x = rng.standard_normal(count).astype(np.float32)
            await comm.all_reduce(x)
            out.append(x.tobytes())
        return b"".join(out)

    results = await run_ranks(5, fn)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("algo", ["ring", "rd", "direct", "hd"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 5])
async def test_ties_and_nans_give_every_rank_the_same_bits(
        algo: str, nranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops commute in value but not in bits: MAX/MIN of +0 and -0 keep one operand,
    a sum of two NaNs one payload. Every algorithm still gives every rank the same bits
    (recursive doubling: both partners of an exchange put the lower rank's operand
    first), for float32, float16 and bfloat16, small and large counts."""
    monkeypatch.setenv("ACOLL_ALGO", f"all_reduce:{algo}")
    monkeypatch.setenv("ACOLL_CHUNK_SIZE", "4K")
    nans = {  # (each rank's own NaN: signs and payloads differ, some signalling)
        np.dtype(np.float32): (np.uint32, [0x7FC00001, 0xFFC00002, 0x7F800003, 0xFF900005,
                                           0x7FA00007]),
        np.dtype(np.float16): (np.uint16, [0x7E01, 0xFE02, 0x7D03, 0xFC05, 0x7C07]),
        BFLOAT16: (np.uint16, [0x7FC1, 0xFFC2, 0x7F83, 0xFF85, 0x7FC7])}

    async def fn(comm: acoll.Communicator) -> list[bytes]:
        got = []
        for dt, (raw, bits) in nans.items():
            for count in (16, 9001):
                zero = np.full(count, -0.0 if comm.rank % 2 else 0.0, dt)
                for op in (acoll.MAX, acoll.MIN):
                    x = zero.copy()
                    await comm.all_reduce(x, op=op)
                    got.append(x.tobytes())
                x = np.full(count, bits[comm.rank], raw).view(dt)
                assert np.isnan(x).all()
                await comm.all_reduce(x)
                got.append(x.tobytes())
        return got

    with np.errstate(invalid="ignore"):  # (NumPy's loops flag signalling NaNs)
        results = await run_ranks(nranks, fn)
    for r, res in enumerate(results):
        assert res == results[0], r


async def test_fp16_bf16_sum_close_to_float32_reference() -> None:
    async def fn(comm: acoll.Communicator) -> None:
        for dt in (np.float16, acoll._dtypes.BFLOAT16):
            rng = np.random.default_rng(7)
            base = [rng.standard_normal(5000).astype(np.float32) for _ in range(comm.size)]
            x = base[comm.rank].astype(dt)
            await comm.all_reduce(x)
            want = sum(b.astype(dt).astype(np.float32) for b in base)
            err = np.max(np.abs(x.astype(np.float32) - want) / (1 + np.abs(want)))
            assert err < (2e-2 if dt is np.float16 else 5e-2)

    await run_ranks(4, fn)


async def test_buffers_other_than_numpy() -> None:
    async def fn(comm: acoll.Communicator) -> None:
        import array

        a = array.array("f", [comm.rank + 1.0] * 10)
        await comm.all_reduce(a)
        assert list(a) == [3.0] * 10
        b = bytearray([comm.rank + 1] * 6)
        await comm.all_reduce(b, op="max")
        assert list(b) == [2] * 6

    await run_ranks(2, fn)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("nranks", [2, 3])
async def test_ndarray_subclasses_are_taken_as_flat_arrays(nranks: int) -> None:
    """Found by review: an np.matrix kept its 2-D shape when flattened, so all_gather
    failed to broadcast a row into a block, and a ring's segments were empty or whole
    (peers blamed for sending 0 bytes)."""
    async def fn(comm: acoll.Communicator) -> None:
        n, r = comm.size, comm.rank
        m = np.matrix(np.arange(6, dtype=np.float32) + r)
        out = np.matrix(np.zeros((1, 6 * n), np.float32))
        await comm.all_gather(m, out)
        assert np.array_equal(np.asarray(out).ravel(),
                              np.concatenate([np.arange(6, dtype=np.float32) + p
                                              for p in range(n)]))
        big = np.matrix(np.full((1, 100_000), r + 1.0, np.float32))
        await comm.all_reduce(big)  # (the ring's segments: slices of a flat view)
        assert np.all(np.asarray(big) == n * (n + 1) / 2)
        a2a = np.matrix(np.arange(3 * n, dtype=np.float32) + 100 * r)
        got = np.matrix(np.zeros((1, 3 * n), np.float32))
        await comm.all_to_all(a2a, got)
        assert np.array_equal(np.asarray(got).ravel(), np.concatenate(
            [np.arange(3 * r, 3 * r + 3, dtype=np.float32) + 100 * p for p in range(n)]))

    await run_ranks(nranks, fn)


@pytest.mark.parametrize("nranks", [2, 3, 5])
async def test_full_matrix_one_loop_over_tcp(nranks: int, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """The matrix again with the in-process transport off: ranks of one loop over TCP."""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    dtypes = ALL_DTYPES if nranks <= 3 else _WIDE_DTYPES

    async def fn(comm: acoll.Communicator) -> int:
        assert {comm.transport_name(p) for p in range(nranks) if p != comm.rank} == {"socket"}
        return await check_all(comm, COUNTS, dtypes, ALL_OPS)

    results = await run_ranks(nranks, fn)
    assert len(set(results)) == 1


async def test_ranks_of_one_loop_talk_in_process() -> None:
    async def fn(comm: acoll.Communicator) -> list[str | None]:
        return [comm.transport_name(p) for p in range(comm.size)]

    names = await run_ranks(3, fn)
    assert names == [[None, "inproc", "inproc"], ["inproc", None, "inproc"],
                     ["inproc", "inproc", None]]


@pytest.mark.parametrize(("inproc", "shm"), [(True, True), (True, False), (False, False)],
                         ids=["inproc+shm", "inproc+tcp", "tcp-only"])
def test_full_matrix_mixed_communicator(inproc: bool, shm: bool) -> None:
    """Five ranks in two processes (3 + 2): one communicator mixing the in-process
    transport (ranks of one process) with shared memory or TCP (across the processes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    env["ACOLL_SOCKET_IFNAME"] = "=lo"
    if not inproc:
        env["ACOLL_INPROC_DISABLE"] = "1"
    if not shm:
        env["ACOLL_SHM_DISABLE"] = "1"
    uid = acoll.get_unique_id(ifname="=lo")
    procs = [subprocess.Popen([sys.executable, str(HERE / "mp_mixed.py"), bytes(uid).hex(),
                               "5", ranks], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for ranks in ("0,2,4", "1,3")]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        outs.append(out)
    lines = sorted(line for out in outs for line in out.splitlines())
    assert len(lines) == 5, lines
    assert len({line.rsplit(":", 1)[1] for line in lines}) == 1  # same number of checks
    same = "inproc" if inproc else "socket"
    other = "shm" if shm else "socket"
    for line in lines:  # "rank R: via T0,T1,...: N checks passed"
        rank = int(line.split()[1].rstrip(":"))
        got = [None if v == "None" else v for v in line.split("via ")[1].split(":")[0].split(",")]
        # ranks of my parity live in my process
        assert got == [None if p == rank else (same if p % 2 == rank % 2 else other)
                       for p in range(5)], line


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_full_matrix_across_processes(shm: bool) -> None:
    """The same checks with every rank in its own process (acoll-run): over shared memory
    by default, over TCP with ``ACOLL_SHM_DISABLE=1``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    if not shm:
        env["ACOLL_SHM_DISABLE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "acoll.run", "-n", "3", "--", sys.executable,
         str(HERE / "mp_collectives.py")],
        env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("checks passed") == 3, proc.stdout
    expect = "shm" if shm else "socket"
    for line in proc.stdout.splitlines():
        if "checks passed" in line:  # "rank R via T0,T1,T2: N checks passed"
            names = line.split(" via ")[1].split(":")[0].split(",")
            assert sorted(names) == ["None", expect, expect], line


@pytest.mark.parametrize("nranks", [2, 4, 6, 8, 16])
def test_halving_doubling_plan_orders_agree(nranks: int) -> None:
    """Every halving-doubling partner sends in the order its peer waits: in each
    reduce-scatter round what rank a sends to b is, block for block, what b waits for from
    a, and b waits first for the blocks it forwards next; in the all-gather, what a rank
    spreads (its own block, then each round's in arrival order) is what each later
    partner waits for. The blocks kept end as the rank's own; every block arrives once."""
    from types import SimpleNamespace

    from acoll._coll.algorithms import HalvingDoublingAllReduce
    from acoll._dtypes import DTYPE_BY_CODE
    from acoll._memory.host import HostSpace

    mem = HostSpace()
    f32 = next(d for d in DTYPE_BY_CODE.values() if d.name == "float32")
    plans = []
    for r in range(nranks):
        ctx = SimpleNamespace(n=nranks, rank=r, chunk_bytes=64, hd_chunks=2, stage=None,
                              ring_chunk_max=1 << 20,
                              scratch=lambda count, dtype, slot=0: mem.empty(count, dtype))
        buf = mem.empty(1000, f32)
        plans.append(HalvingDoublingAllReduce(ctx, buf, buf, acoll.SUM))  # type: ignore[arg-type]
    p = plans[0].p
    byv = {pl.real.index(r): pl for r, pl in enumerate(plans) if pl.role != "even"}
    assert sorted(byv) == list(range(p))
    for v, pl in byv.items():
        got: list[int] = []
        for i, (u, give, keep) in enumerate(pl.rs):
            peer = byv[u]
            assert peer.rs[i][0] == v
            assert peer.rs[i][2] == give  # the partner waits in the order this rank sends
            got += keep
            if i + 1 < len(pl.rs):  # what is forwarded next comes first, in order
                assert keep[:len(pl.rs[i + 1][1])] == pl.rs[i + 1][1]
        spread = [v]
        for j, (u, blks) in enumerate(pl.ag):
            assert byv[u].ag[j][1] == spread[:len(blks)] == spread  # held before round j
            spread += blks
        assert sorted(spread) == list(range(p))
    rounds = plans[0].rounds
    assert rounds == p.bit_length() - 1


async def test_halving_doubling_chunk_settings_that_differ_fail_at_once() -> None:
    """Ranks whose chunk settings differ (here ACOLL_HD_CHUNKS) send their first chunks
    under the same steps, so the sizes disagree and every rank is told at once instead of
    waiting for messages that never come."""
    loop = asyncio.get_running_loop()

    async def fn(comm: acoll.Communicator) -> tuple[str, float]:
        comm._algo = "all_reduce:hd"
        comm.hd_chunks = 1 if comm.rank % 2 else 4
        comm.chunk_bytes = 4096
        t0 = loop.time()
        with pytest.raises(acoll.InvalidUsage) as info:
            await comm.all_reduce(np.ones(1 << 16, np.float32))
        return str(info.value), loop.time() - t0

    results = await run_ranks(4, fn, timeout=30)
    for message, took in results:
        assert took < 10, (message, took)
        assert "bytes where rank" in message or "mismatch" in message, message


def test_halving_doubling_refuses_more_steps_than_a_call_has() -> None:
    """Tiny chunks on many ranks would need message steps past the tag's 32 bits: the
    call is refused by name instead of running into the sequence number's bits."""
    from types import SimpleNamespace

    from acoll._coll.algorithms import HalvingDoublingAllReduce

    def plan(count: int) -> None:
        ctx = SimpleNamespace(n=128, rank=0, chunk_bytes=4, hd_chunks=0, stage=None,
                              ring_chunk_max=1 << 20,
                              scratch=lambda count, dtype, slot=0: None)
        buf = SimpleNamespace(count=count, itemsize=4, dtype=None)
        HalvingDoublingAllReduce(ctx, buf, buf, acoll.SUM)  # type: ignore[arg-type]

    with pytest.raises(acoll.InvalidUsage, match="ACOLL_CHUNK_SIZE"):
        plan(1 << 28)  # 2**21 one-item chunks per block, 2048 steps each
    with pytest.raises(TypeError):  # (well inside: planning goes on, to the fake scratch)
        plan(1 << 20)


def test_algo_setting_bare_names_apply_where_they_exist() -> None:
    """``ACOLL_ALGO=hd`` forces the all-reduce and leaves broadcast and reduce to the
    tuner; a bare name no collective has, or a collective given one it lacks, is refused
    by name."""
    from acoll._coll import algorithms as al

    assert al.choose("all_reduce", 1 << 20, 4, "hd", 64 << 10) is al.HalvingDoublingAllReduce
    assert al.choose("broadcast", 1 << 20, 4, "hd", 64 << 10) is al.ChainBroadcast
    assert al.choose("reduce", 8, 4, "rabenseifner", 64 << 10) is al.TreeReduce
    assert al.choose("broadcast", 8, 4, "chain", 64 << 10) is al.ChainBroadcast
    assert al.choose("all_reduce", 8, 4, "ring,broadcast:tree", 64 << 10) is al.RingAllReduce
    with pytest.raises(acoll.InvalidUsage, match="no collective has an algorithm 'bogus'"):
        al.choose("broadcast", 8, 4, "bogus", 64 << 10)
    with pytest.raises(acoll.InvalidUsage, match="broadcast has no algorithm 'hd'"):
        al.choose("broadcast", 8, 4, "broadcast:hd", 64 << 10)
