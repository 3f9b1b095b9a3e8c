"""acoll-perf's collective table and its sweep, in process and without a network.

The sweep runs against an in-memory backend (every rank a task of one event loop, the
collectives computed with NumPy), so buffer sizes, in-place layouts, N/A modes and the
result check are tested apart from any transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from acoll import ReduceOp
from acoll.perf.backends.base import Backend, Op, OpArgs
from acoll.perf.colls import COLLECTIVES, COLLS, Coll, InPlace, Usage, Where
from acoll.perf.report import Result
from acoll.perf.sweep import Spec, sweep

# nccl-tests' PERFORMANCE.md: busbw = algbw * factor
NCCL_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def test_table_covers_every_collective_in_order() -> None:
    assert COLLECTIVES == ("all_reduce", "broadcast", "reduce", "all_gather",
                           "reduce_scatter", "all_to_all", "sendrecv", "barrier", "tcp")
    assert all(name == c.name for name, c in COLLS.items())


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8, 31])
def test_bus_factors(nranks: int) -> None:
    for name, c in COLLS.items():
        want = NCCL_FACTORS.get(name, lambda n: 1.0)(nranks)
        assert c.bus(nranks) == pytest.approx(want), name


@pytest.mark.parametrize(("name", "want"), [
    # 100 bytes of float32 on 3 ranks: count 25, block 8, blocks 24
    ("all_reduce", (25, 25, 25)), ("broadcast", (25, 25, 25)), ("reduce", (25, 25, 25)),
    ("all_gather", (8, 24, 8)), ("reduce_scatter", (24, 8, 8)), ("all_to_all", (24, 24, 8)),
    ("sendrecv", (25, 25, 25)), ("barrier", (0, 0, 0)), ("tcp", (25, 25, 25)),
])
def test_buffer_counts(name: str, want: tuple[int, int, int]) -> None:
    assert COLLS[name].counts(100, 4, 3) == want


def test_inplace_layouts() -> None:
    assert COLLS["all_gather"].inplace.offsets(2, 8) == (16, 0)
    assert COLLS["reduce_scatter"].inplace.offsets(2, 8) == (0, 16)
    for name in ("all_reduce", "broadcast", "reduce", "all_to_all", "sendrecv"):
        assert COLLS[name].inplace.offsets(2, 8) == (0, 0)
    assert COLLS["barrier"].inplace is COLLS["tcp"].inplace is InPlace.NONE


def test_forms_per_backend() -> None:
    for name in ("all_to_all", "sendrecv"):  # torch has no in-place form of these
        c = COLLS[name]
        assert c.has_form("acoll", True)
        assert not c.has_form("gloo", True)
        assert not c.has_form("nccl", True)
        assert c.has_form("gloo", False)
    assert not COLLS["tcp"].has_form("tcp", True)
    assert COLLS["tcp"].backends == ("tcp",)
    assert all(c.backends[0] == "acoll" for c in COLLS.values() if c.name != "tcp")


def test_rules_agree() -> None:
    for c in COLLS.values():
        if c.source is not None:  # reductions have no single source rank
            src, _ = c.source(np.arange(4, dtype=np.int64), Where(1, 4, 0, 2))
            assert (src is None) == c.reduces, c.name
        assert c.sized == (c.source is not None), c.name
    assert [c.name for c in COLLS.values() if c.rooted] == ["broadcast", "reduce"]
    assert [c.name for c in COLLS.values() if c.root_only] == ["reduce"]


def test_check_ranks() -> None:
    with pytest.raises(Usage, match="at least 2 ranks"):
        COLLS["sendrecv"].check_ranks(1, 0)
    with pytest.raises(Usage, match="root must be in"):
        COLLS["broadcast"].check_ranks(2, 2)
    COLLS["all_reduce"].check_ranks(1, 5)  # no root: any -r goes


# --- the sweep on an in-memory backend -------------------------------------------------------

class _World:
    """Ranks of one loop: :meth:`meet` returns every rank's contribution once all gave one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.items: dict[int, Any] = {}
        self.done = asyncio.Event()

    async def meet(self, rank: int, item: Any) -> list[Any]:
        items, done = self.items, self.done
        items[rank] = item
        if len(items) == self.n:
            self.items, self.done = {}, asyncio.Event()
            done.set()
        else:
            await done.wait()
        return [items[r] for r in range(self.n)]


class _Local(Backend):
    """Collectives computed with NumPy on copies of every rank's input."""

    def __init__(self, world: _World, rank: int, *, name: str = "local",
                 refuse: str | None = None) -> None:
        super().__init__()
        self.world, self.name, self.rank, self.size = world, name, rank, world.n
        self.info = {"backend": "local", "net": "none", "loop": "asyncio", "chunk": "-"}
        self.refuse = refuse

    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        rank, n = self.rank, self.size
        inp: npt.NDArray[Any] = args.out if coll.one_buffer else args.inp
        out: npt.NDArray[Any] = args.out
        if args.inplace:  # the layouts libraries expect (nccl-tests', acoll's, torch's)
            shift = (args.inp.ctypes.data - out.ctypes.data) // out.itemsize
            want = {"all_gather": rank * len(args.inp), "reduce_scatter": -rank * len(out)}
            assert shift == want.get(coll.name, 0), (coll.name, shift)

        async def run() -> None:
            if coll.name == self.refuse:
                raise NotImplementedError(f"{coll.name}: refused\nsecond line")
            ins = await self.world.meet(rank, inp.copy())
            if coll.name == "barrier":
                return
            total = np.sum(ins, axis=0, dtype=inp.dtype)
            per = len(out) // n if coll.name == "all_to_all" else 0
            result = {
                "all_reduce": lambda: total,
                "reduce": lambda: total if rank == args.root else out,
                "broadcast": lambda: ins[args.root],
                "all_gather": lambda: np.concatenate(ins),
                "reduce_scatter": lambda: total[rank * len(out):(rank + 1) * len(out)],
                "all_to_all": lambda: np.concatenate([x[rank * per:(rank + 1) * per]
                                                      for x in ins]),
                "sendrecv": lambda: ins[(rank - 1) % n],
            }[coll.name]()
            out[...] = result
        return run

    def unsupported(self, exc: BaseException) -> bool:
        return isinstance(exc, NotImplementedError)

    async def barrier(self) -> None:
        await self.world.meet(self.rank, None)

    async def all_reduce_scalar(self, value: float, op: ReduceOp) -> float:
        vals = await self.world.meet(self.rank, value)
        return float({ReduceOp.MAX: max, ReduceOp.MIN: min}.get(op, sum)(vals))

    async def broadcast_scalar(self, value: float) -> float:
        return float((await self.world.meet(self.rank, value))[0])


def _spec(coll: str, **kw: Any) -> Spec:
    base: dict[str, Any] = {"minbytes": 8, "maxbytes": 4096, "factor": 8.0, "stepbytes": 0,
                            "iters": 2, "warmup": 1, "dtype": "int32", "op": "sum",
                            "root": 1, "check": True, "average": 3, "inplace": True}
    return Spec(coll, **{**base, **kw})


async def _run(spec: Spec, n: int, **kw: Any) -> list[Result]:
    world = _World(n)
    return list(await asyncio.gather(*(sweep(_Local(world, r, **kw), spec) for r in range(n))))


@pytest.mark.parametrize("coll", [c for c in COLLECTIVES if c != "tcp"])
@pytest.mark.parametrize("dtype", ["int32", "float32"])
async def test_sweep_checks_every_layout(coll: str, dtype: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    n = 3
    results = await _run(_spec(coll, dtype=dtype), n)
    res = results[0]
    c = COLLS[coll]
    assert res.settings["collective"] == coll
    assert res.settings["nranks"] == n
    sizes = [0] if coll == "barrier" else [8, 64, 512, 4096]
    modes = (False,) if coll == "barrier" else (False, True)
    assert [(r.size, r.count, r.inplace) for r in res.records] == [
        (max(sc, rc) * 4, pc, m) for s in sizes for sc, rc, pc in [c.counts(s, 4, n)]
        for m in modes]
    for r in res.records:
        assert r.time_us is not None
        assert r.time_us > 0
        assert r.wrong == (None if coll == "barrier" else 0)
        assert r.root == (1 if c.rooted else -1)
        assert r.redop == ("sum" if c.reduces else "none")
    assert res.wrong == 0
    out = capsys.readouterr().out
    assert out.count("# Out of bounds values : 0") == 1  # rank 0 prints, once


async def test_sweep_counts_wrong_elements(capsys: pytest.CaptureFixture[str]) -> None:
    res = (await _run(_spec("all_gather", inject_error=True), 2))[0]
    assert all(r.wrong == 1 for r in res.records)
    assert "FAILED" in capsys.readouterr().out


async def test_sweep_na_modes(capsys: pytest.CaptureFixture[str]) -> None:
    # a backend named gloo has no in-place all_to_all: N/A, the out-of-place column measured
    res = (await _run(_spec("all_to_all"), 2, name="gloo"))[0]
    assert [r.time_us is None for r in res.records] == [False, True] * 4
    assert res.notes == ["in-place all_to_all is not measured with gloo (no such form)"]
    # an op refused at its first run (unsupported()): N/A with the first line of the error
    res = (await _run(_spec("all_reduce", inplace=False), 2, refuse="all_reduce"))[0]
    assert all(r.time_us is None and r.note.startswith("not supported") for r in res.records)
    assert res.notes == ["out-of-place all_reduce not supported by local: all_reduce: refused"]
    assert "N/A" in capsys.readouterr().out


async def test_sweep_refuses_too_few_ranks() -> None:
    with pytest.raises(Usage, match="at least 2 ranks"):
        await _run(_spec("sendrecv"), 1)
