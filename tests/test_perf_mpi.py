"""acoll-perf ``--vs mpi`` without MPI: refusals, the mpirun line and its deadlines, the calls
made on a stand-in MPI module, and the comparison built from an MPI result.

The runs under a real mpirun are in test_mpi.py (``make test-mpi``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from acoll import ReduceOp
from acoll.perf import cli
from acoll.perf.backends import mpi
from acoll.perf.backends.base import OpArgs
from acoll.perf.colls import COLLS
from acoll.perf.report import Record, Result, comparison, report

HAS_MPI4PY = cli.importlib.util.find_spec("mpi4py") is not None


# --------------------------------------------------------------------------- what MPI can run

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter"])
def test_16_bit_floats_are_refused_for_reductions(coll: str, dtype: str) -> None:
    why = mpi.refusal(COLLS[coll], dtype, ReduceOp.SUM)
    assert why is not None
    assert f"MPI has no {dtype} datatype to reduce" in why
    assert "-d float32" in why


@pytest.mark.parametrize("coll", ["all_gather", "broadcast", "all_to_all", "sendrecv"])
def test_16_bit_floats_move_as_integers(coll: str) -> None:
    assert mpi.refusal(COLLS[coll], "bfloat16", ReduceOp.SUM) is None
    assert mpi.refusal(COLLS[coll], "float16", ReduceOp.AVG) is None  # op unused


def test_other_refusals() -> None:
    why = mpi.refusal(COLLS["all_reduce"], "float32", ReduceOp.AVG)
    assert why is not None
    assert "no avg reduction" in why
    assert mpi.refusal(COLLS["all_reduce"], "int8", ReduceOp.MAX) is None
    assert mpi.refusal(COLLS["tcp"], "uint8", ReduceOp.SUM) == "MPI has no tcp to compare with"


def test_in_place_forms() -> None:
    # MPI's in-place reduce_scatter leaves the block at the buffer's start: N/A for MPI only
    assert not COLLS["reduce_scatter"].has_form("mpi", True)
    assert COLLS["reduce_scatter"].has_form("mpi", False)
    assert COLLS["reduce_scatter"].has_form("acoll", True)
    for name in ("all_reduce", "reduce", "all_gather", "all_to_all", "sendrecv", "broadcast"):
        assert COLLS[name].has_form("mpi", True), name


# --------------------------------------------------------------------------- the command line

def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["all_reduce", "-N", "2", "-d", "bfloat16"], "MPI has no bfloat16 datatype to reduce"),
    (["reduce", "-N", "2", "-d", "half"], "MPI has no float16 datatype to reduce"),
    (["all_reduce", "-N", "2", "-o", "avg"], "MPI has no avg reduction"),
    (["tcp", "-N", "2"], "--vs makes no sense with tcp"),
])
def test_refused_before_anything_starts(args: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _main([*args, "--vs", "mpi"], capsys)
    assert rc == 2
    assert message in err


def test_missing_mpi4py_names_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # find_spec now answers None
    rc, err = _main(["all_reduce", "-N", "2", "--vs", "mpi"], capsys)
    assert rc == 2
    assert "--vs mpi needs mpi4py" in err
    assert "pip install 'acoll[mpi]'" in err
    assert "openmpi-bin" in err


@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py not installed: the mpi4py check comes first")
def test_missing_mpirun_names_what_to_install(tmp_path: Path) -> None:
    # a subprocess: the check loads the MPI library, which this process should not
    env = {**os.environ, "PATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "acoll.perf", "all_reduce", "-N", "2",
                          "--vs", "mpi"], capture_output=True, text=True, timeout=60, env=env,
                         check=False)
    assert res.returncode == 2, res.stderr
    assert "needs mpirun, which is not on PATH" in res.stderr
    assert "apt-get install openmpi-bin" in res.stderr


@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py not installed: the mpi4py check comes first")
def test_ranks_of_another_launcher_are_not_mpi_processes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in {"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "2", "ACOLL_LOCAL_RANK": "0",
                 "ACOLL_LOCAL_SIZE": "2", "ACOLL_COMM_ID": "127.0.0.1:1"}.items():
        monkeypatch.setenv(k, v)
    rc, err = _main(["all_reduce", "--vs", "mpi"], capsys)
    assert rc == 2
    assert "started by acoll-run, so they are not MPI processes" in err


def test_rank_command_line_round_trips() -> None:
    o = cli._parse(["all_gather", "-N", "3", "-b", "1K", "-e", "4M", "-f", "4", "-n", "7",
                    "-w", "2", "-d", "bfloat16", "-r", "1", "--no-inplace", "--vs", "mpi"])
    back = cli._parse(cli._rank_args(o, "mpi", "/tmp/r.json", None))
    assert back.backend == "mpi"
    assert back.peer == "mpi"
    assert back.result_file == "/tmp/r.json"
    assert back.spec == o.spec


# --------------------------------------------------------------------------- mpirun

OMPI_VERSION = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.0\n"


def test_flavour() -> None:
    assert mpi.mpirun_flavour(OMPI_VERSION) == "openmpi"
    assert mpi.mpirun_flavour(HYDRA_VERSION) == "mpich"
    assert mpi.mpirun_flavour("") == "other"


def test_openmpi_command_as_root_and_not() -> None:
    prog = ["/py", "-m", "acoll.perf", "all_reduce"]
    cmd = mpi.mpirun_command("/usr/bin/mpirun", "openmpi", 4, prog, as_root=True,
                             extra=["--bind-to", "core"])
    assert cmd == ["/usr/bin/mpirun", "-np", "4", "--oversubscribe", "--allow-run-as-root",
                   "--bind-to", "core", *prog]
    cmd = mpi.mpirun_command("mpirun", "openmpi", 2, prog, as_root=False)
    assert cmd == ["mpirun", "-np", "2", "--oversubscribe", *prog]


def test_hydra_gets_no_open_mpi_options() -> None:
    cmd = mpi.mpirun_command("mpiexec", "mpich", 2, ["p"], as_root=True)
    assert cmd == ["mpiexec", "-np", "2", "p"]


def test_env_allows_root_only_when_root() -> None:
    base = {"PATH": "/bin", "X": "1"}
    assert mpi.mpirun_env(base, as_root=False) == base
    env = mpi.mpirun_env(base, as_root=True)
    assert env == {**base, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in base


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "fake-mpirun"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return [str(path)]


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_run_copies_output_and_exit_code(tmp_path: Path) -> None:
    cmd = _script(tmp_path, 'echo "one"; printf "two\\nthree"; exit 3\n')
    out, err = io.StringIO(), io.StringIO()
    assert mpi.run_mpirun(cmd, dict(os.environ), idle=30, out=out, err=err) == 3
    assert out.getvalue() == "one\ntwo\nthree"
    assert err.getvalue() == ""


def test_silent_job_is_stopped_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # a "rank" that ignores SIGTERM, then a job that prints one line and hangs
    cmd = _script(tmp_path, f"sh -c 'trap \"\" TERM; sleep 600' & echo $! > {pidfile}\n"
                            "echo started\nsleep 600\n")
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    rc = mpi.run_mpirun(cmd, dict(os.environ), idle=3.0, out=out, err=err)
    assert rc == mpi.EXIT_TIMEOUT
    assert time.monotonic() - t0 < 3.0 + 2 * 5.0 + 5.0
    assert out.getvalue() == "started\n"
    assert "the MPI job printed nothing for 3 s; stopping it" in err.getvalue()
    assert _gone(int(pidfile.read_text()))


def test_total_deadline(tmp_path: Path) -> None:
    cmd = _script(tmp_path, "while true; do echo tick; sleep 0.1; done\n")
    out, err = io.StringIO(), io.StringIO()
    rc = mpi.run_mpirun(cmd, dict(os.environ), idle=30, total=3.0, out=out, err=err)
    assert rc == mpi.EXIT_TIMEOUT
    assert "ran longer than 3 s" in err.getvalue()
    assert out.getvalue().startswith("tick\ntick\n")


def test_interrupt_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "job.pid"
    cmd = _script(tmp_path, f"echo $$ > {pidfile}; echo up; sleep 600\n")
    real_select = mpi.select.select

    def select(*args: Any) -> Any:  # Ctrl-C once the job has said something
        if pidfile.exists() and pidfile.read_text().strip():
            raise KeyboardInterrupt
        return real_select(*args)

    monkeypatch.setattr(mpi.select, "select", select)
    with pytest.raises(KeyboardInterrupt):
        mpi.run_mpirun(cmd, dict(os.environ), idle=30, out=io.StringIO(), err=io.StringIO())
    assert _gone(int(pidfile.read_text()))


# --------------------------------------------------------------------------- the calls

class _FakeComm:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> None:
            self.calls.append((name, args))
        return call


class _FakeMPI:
    """The part of mpi4py.MPI that MpiBackend uses; datatypes and ops are their names."""

    IN_PLACE = "IN_PLACE"
    THREAD_FUNNELED = 1
    OP_NULL = "OP_NULL"
    Exception = RuntimeError

    def __init__(self, rank: int, size: int) -> None:
        self.COMM_WORLD = _FakeComm(rank, size)
        for name in ("SUM", "PROD", "MAX", "MIN", "FLOAT", "DOUBLE", "UINT16_T", "INT8_T",
                     "UINT8_T", "INT32_T", "UINT32_T", "INT64_T", "UINT64_T"):
            setattr(self, name, name)

    def Is_initialized(self) -> bool:
        return True

    def Get_library_version(self) -> str:
        return "Fake MPI 1.0, for tests\n"


def _calls(coll: str, *, inplace: bool, rank: int = 1, size: int = 3,
           dtype: Any = "float32", op: ReduceOp = ReduceOp.SUM, root: int = 2,
           ) -> list[tuple[str, tuple[Any, ...]]]:
    fake = _FakeMPI(rank, size)
    backend = mpi.MpiBackend(mpi=fake)
    assert (backend.rank, backend.size, backend.name) == (rank, size, "mpi")
    assert backend.info["backend"] == "Fake MPI 1.0 (mpi4py, host buffers)"
    buf = np.zeros(12, dtype=np.float32 if dtype == "float32" else dtype)
    inp, out = (buf, buf) if inplace else (buf[:6], buf[6:])
    fn = backend.make_op(COLLS[coll], OpArgs(inplace, inp, out, op, root))
    assert fn is not None
    coro = fn()
    with pytest.raises(StopIteration):
        coro.send(None)
    backend.close()
    return [(name, tuple(_show(a) for a in args)) for name, args in fake.COMM_WORLD.calls]


def _show(arg: Any) -> Any:
    """A call argument as text: ``[buffer, type]`` specs as ``"<n> TYPE"``."""
    if isinstance(arg, list):
        return f"{arg[0].size} {arg[0].dtype.name} {arg[1]}"
    return arg


@pytest.mark.parametrize(("coll", "inplace", "rank", "expect"), [
    ("all_reduce", False, 1, ("Allreduce", ("6 float32 FLOAT", "6 float32 FLOAT", "SUM"))),
    ("all_reduce", True, 1, ("Allreduce", ("IN_PLACE", "12 float32 FLOAT", "SUM"))),
    ("broadcast", True, 1, ("Bcast", ("12 float32 FLOAT", 2))),
    ("reduce", False, 1, ("Reduce", ("6 float32 FLOAT", "6 float32 FLOAT", "SUM", 2))),
    # in place only the root passes IN_PLACE; the others send their buffer
    ("reduce", True, 2, ("Reduce", ("IN_PLACE", "12 float32 FLOAT", "SUM", 2))),
    ("reduce", True, 1, ("Reduce", ("12 float32 FLOAT", "12 float32 FLOAT", "SUM", 2))),
    ("all_gather", True, 1, ("Allgather", ("IN_PLACE", "12 float32 FLOAT"))),
    ("reduce_scatter", False, 1,
     ("Reduce_scatter_block", ("6 float32 FLOAT", "6 float32 FLOAT", "SUM"))),
    ("all_to_all", True, 1, ("Alltoall", ("IN_PLACE", "12 float32 FLOAT"))),
    ("sendrecv", False, 0, ("Sendrecv", ("6 float32 FLOAT", 1, 0, "6 float32 FLOAT", 2, 0))),
    ("sendrecv", True, 0, ("Sendrecv_replace", ("12 float32 FLOAT", 1, 0, 2, 0))),
    ("barrier", False, 1, ("Barrier", ())),
])
def test_calls(coll: str, inplace: bool, rank: int, expect: tuple[str, tuple[Any, ...]]) -> None:
    assert _calls(coll, inplace=inplace, rank=rank) == [expect]


def test_bfloat16_moves_as_uint16() -> None:
    import ml_dtypes

    got = _calls("all_gather", inplace=False, dtype=ml_dtypes.bfloat16)
    assert got == [("Allgather", ("6 uint16 UINT16_T", "6 uint16 UINT16_T"))]


def test_no_in_place_reduce_scatter() -> None:
    backend = mpi.MpiBackend(mpi=_FakeMPI(0, 2))
    buf = np.zeros(4, np.float32)
    assert backend.make_op(COLLS["reduce_scatter"],
                           OpArgs(True, buf, buf[2:], ReduceOp.SUM, 0)) is None


def test_deadline_ends_a_stuck_process(tmp_path: Path) -> None:
    code = ("import time\n"
            "from acoll.perf.backends import mpi\n"
            "from acoll.perf.colls import COLLS\n"
            "from acoll.perf.backends.base import OpArgs\n"
            "import numpy as np, sys\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_perf_mpi import _FakeMPI\n"
            "b = mpi.MpiBackend(0.5, mpi=_FakeMPI(0, 2))\n"
            "x = np.zeros(4, np.float32)\n"
            "b.make_op(COLLS['all_reduce'], OpArgs(True, x, x, 0, 0))\n"
            "time.sleep(30)  # a stuck op\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert time.monotonic() - t0 < 20
    assert res.returncode != 0
    assert "Timeout (0:00:00.500000)!" in res.stderr
    assert "time.sleep" in res.stderr or "<module>" in res.stderr


# --------------------------------------------------------------------------- the comparison

def _result(backend: str, times: dict[tuple[int, bool], float | None]) -> Result:
    recs = [Record(size, size // 4, "float32", "sum", -1, inplace, t,
                   None if t is None else size / t / 1e3,
                   None if t is None else size / t / 1e3 * 0.5, None if t is None else 0,
                   "" if t is not None else "not supported")
            for (size, inplace), t in times.items()]
    return Result(backend, {"collective": "reduce_scatter"}, recs, [])


def test_comparison_against_mpi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = _result("acoll", {(64, False): 10.0, (64, True): 8.0,
                             (1024, False): 20.0, (1024, True): 16.0})
    peer = _result("mpi", {(64, False): 5.0, (64, True): None,
                           (1024, False): 40.0, (1024, True): None})
    rows = comparison(mine, peer)
    # MPI has no in-place reduce_scatter: the out-of-place columns are compared
    assert [(r["size"], r["inplace"]) for r in rows] == [(64, False), (1024, False)]
    assert rows[0]["time_ratio"] == pytest.approx(0.5)
    assert rows[1]["busbw_ratio"] == pytest.approx(2.0)
    path = tmp_path / "r.json"
    report(mine, peer, argv=["reduce_scatter", "--vs", "mpi"], json_path=str(path),
           plot_path=None)
    text = capsys.readouterr().out
    assert "# acoll vs mpi" in text
    assert "busbw ratio acoll/mpi: geometric mean 1.00, min 0.50, max 2.00" in text
    doc = json.loads(path.read_text())
    assert doc["peer"]["backend"] == "mpi"
    assert doc["command"] == "acoll-perf reduce_scatter --vs mpi"
    assert len(doc["comparison"]) == 2

