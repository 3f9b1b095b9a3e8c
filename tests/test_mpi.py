"""Programs under a real ``mpirun`` (Open MPI): the seed example and ``init_from_env``.

Needs Open MPI's ``mpirun`` and mpi4py (``make test-mpi`` installs both). Without them these
tests are skipped with the reason, except when ``ACOLL_TEST_MPI=1`` (set by ``make test-mpi``):
then they fail, so that a broken set-up cannot pass for a green run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "examples" / "seed_program.py"
INIT_FROM_ENV = Path(__file__).resolve().parent / "mpi_init_from_env.py"
REQUIRED = os.environ.get("ACOLL_TEST_MPI") == "1"
# mpirun merges the ranks' output and may join two ranks' lines: match items, not lines.
_SEED_LINE = re.compile(r"rank \d+ of \d+ \(process \d+, local rank \d+, device \d+\): "
                        r"all_reduce of \d+ floats (?:ok|WRONG)")


def _missing() -> str | None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not installed (make test-mpi installs Debian's Open MPI)"
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mpirun --version failed: {exc}"
    if "Open MPI" not in version:
        return f"mpirun is not Open MPI's ({version.strip()[:60]!r})"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'acoll[mpi]')"
    return None


MISSING = _missing()
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=f"{MISSING}"),
]


@pytest.fixture(autouse=True)
def _mpi_present() -> None:
    if MISSING is not None:  # only reached with ACOLL_TEST_MPI=1
        pytest.fail(f"ACOLL_TEST_MPI=1 but {MISSING}")


def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus what Open MPI needs here."""
    drop = ("ACOLL_RANK", "ACOLL_COMM_ID", "ACOLL_COMM_SECRET", "RANK", "MASTER_ADDR",
            "MASTER_PORT", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("ACOLL_TIMEOUT", "30")
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def _mpirun_prefix(nprocs: int) -> list[str]:
    # --oversubscribe: more ranks than cores is fine here (CI has 2 cores)
    return ["mpirun", "--oversubscribe", "-np", str(nprocs)]


def mpirun(nprocs: int, args: Sequence[str], env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_mpirun_prefix(nprocs), sys.executable, *args],
                          capture_output=True, text=True, timeout=120,
                          env=_env() if env is None else env)


def test_seed_program_under_mpirun() -> None:
    res = mpirun(2, [str(SEED), "--count", str(1 << 20)])
    assert res.returncode == 0, res.stderr
    lines = sorted(_SEED_LINE.findall(res.stdout))
    assert lines == [
        f"rank 0 of 2 (process 0, local rank 0, device 0): all_reduce of {1 << 20} floats ok",
        f"rank 1 of 2 (process 1, local rank 1, device 0): all_reduce of {1 << 20} floats ok",
    ]
    assert "success: 2 processes x 1 devices" in res.stdout


def test_seed_program_several_devices_per_process() -> None:
    res = mpirun(2, [str(SEED), "--per-process", "2", "--count", "1000"])
    assert res.returncode == 0, res.stderr
    ok = [ln for ln in _SEED_LINE.findall(res.stdout) if ln.endswith("floats ok")]
    assert len(ok) == 4
    assert {ln.split(" (")[0] for ln in ok} == {f"rank {r} of 4" for r in range(4)}
    assert "success: 2 processes x 2 devices" in res.stdout


def _results(res: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert res.returncode == 0, res.stderr
    out = [json.loads(item) for item in re.findall(r"\{[^{}]*\}", res.stdout)]
    return sorted(out, key=lambda d: int(str(d["rank"])))


def test_init_from_env_single_host_needs_nothing_else() -> None:
    results = _results(mpirun(3, [str(INIT_FROM_ENV)]))
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["source"] == "openmpi"
        assert str(r["from"]).startswith("single host")
        assert str(r["comm_id"]).startswith("127.0.0.1:")
        assert r["sum"] == 6.0


def test_init_from_env_with_the_documented_export_line() -> None:
    # The README's line for jobs across hosts, verbatim but for the root's host and port.
    port = free_port()
    line = (f"export ACOLL_COMM_ID=127.0.0.1:{port}\n"
            f"export ACOLL_COMM_SECRET=$({shlex.quote(sys.executable)} -c "
            "'import os; print(os.urandom(32).hex())')\n"
            f"{shlex.join(_mpirun_prefix(2))} -x ACOLL_COMM_ID -x ACOLL_COMM_SECRET "
            f"{shlex.quote(sys.executable)} {shlex.quote(str(INIT_FROM_ENV))}\n")
    res = subprocess.run(["bash", "-ec", line], capture_output=True, text=True, timeout=120,
                         env=_env())
    results = _results(res)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["source"], r["from"]) == ("openmpi", "ACOLL_COMM_ID")
        assert r["comm_id"] == f"127.0.0.1:{port}"
        assert r["secret"] == 64  # forwarded by -x, never on the command line
        assert r["sum"] == 3.0


# --- acoll-perf --vs mpi ----------------------------------------------------------------------

_PERF_SWEEP = ["-b", "8", "-e", "64K", "-f", "8", "-n", "2", "-w", "1"]
_PERF_SIZES = [8, 64, 512, 4096, 32768]


def _perf(args: Sequence[str], launcher: Sequence[str] = (),
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*launcher, sys.executable, "-m", "acoll.perf", *args],
                          capture_output=True, text=True, timeout=180, env=_env())


def test_perf_vs_mpi(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = _perf(["all_reduce", "-N", "2", *_PERF_SWEEP, "--vs", "mpi", "--json", str(out)])
    assert res.returncode == 0, res.stderr + res.stdout
    assert "# Open MPI v" in res.stdout  # the MPI table's header
    assert "# acoll vs mpi" in res.stdout
    assert "busbw ratio acoll/mpi" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["out_of_bounds"] == 0
    peer = doc["peer"]
    assert peer["backend"] == "mpi"
    assert peer["settings"]["nranks"] == 2
    assert peer["out_of_bounds"] == 0
    assert {(r["size"], r["inplace"]) for r in peer["records"]} == {
        (s, m) for s in _PERF_SIZES for m in (False, True)}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in peer["records"])
    assert [(c["size"], c["inplace"]) for c in doc["comparison"]] == [
        (s, True) for s in _PERF_SIZES]


def test_perf_vs_mpi_in_rounds(tmp_path: Path) -> None:
    """--rounds 2: acoll and MPI jobs alternate; the comparison gives per-round ratios."""
    out = tmp_path / "r.json"
    res = _perf(["all_reduce", "-N", "2", *_PERF_SWEEP, "--vs", "mpi", "--rounds", "2",
                 "--json", str(out)])
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.count("# Open MPI v") == 2
    assert "2 rounds, mpi and acoll alternating" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["settings"]["rounds"] == 2
    assert doc["peer"]["settings"]["rounds"] == 2
    for c in doc["comparison"]:
        assert len(c["round_ratios"]) == 2


@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "reduce", "all_gather",
                                  "reduce_scatter", "all_to_all", "sendrecv", "barrier"])
def test_perf_mpi_side_is_correct(coll: str, tmp_path: Path) -> None:
    """The MPI side alone (as -N starts it): 3 ranks, root 2, both modes checked."""
    out = tmp_path / "mpi.json"
    res = _perf([coll, *_PERF_SWEEP, "-r", "2", "-o", "max", "--backend", "mpi",
                 "--result-file", str(out)],
                launcher=[*_mpirun_prefix(3)])
    assert res.returncode == 0, res.stderr + res.stdout
    doc = json.loads(out.read_text())
    assert doc["backend"] == "mpi"
    assert doc["settings"]["nranks"] == 3
    recs = doc["records"]
    assert recs
    for r in recs:
        if coll == "reduce_scatter" and r["inplace"]:
            assert r["time_us"] is None  # MPI's in-place layout differs: N/A
            assert r["note"] == "not supported"
            continue
        assert r["time_us"] > 0, r
        assert r["wrong"] == (None if coll == "barrier" else 0), r
    assert any(r["inplace"] for r in recs) == (coll != "barrier")


def test_perf_vs_mpi_under_mpirun(tmp_path: Path) -> None:
    """Started by mpirun: the same processes sweep acoll, then MPI (bfloat16 moves as bits)."""
    out = tmp_path / "r.json"
    res = _perf(["all_gather", *_PERF_SWEEP, "-d", "bfloat16", "--vs", "mpi",
                 "--json", str(out)], launcher=_mpirun_prefix(2))
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.count("# acoll vs mpi") == 1  # rank 0 reports
    doc = json.loads(out.read_text())
    assert doc["settings"]["nranks"] == doc["peer"]["settings"]["nranks"] == 2
    assert doc["out_of_bounds"] == doc["peer"]["out_of_bounds"] == 0
    assert doc["peer"]["settings"]["dtype"] == "bfloat16"
    assert len(doc["comparison"]) == len(_PERF_SIZES)


def test_perf_vs_mpi_with_a_foreign_mpirun(tmp_path: Path) -> None:
    """An mpirun whose processes are not one job of mpi4py's MPI (each a singleton) is named."""
    fake = tmp_path / "mpirun"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\nshift 2\n'
                    '"$@" && "$@"\n')  # -np N, then the program twice: two singletons
    fake.chmod(0o755)
    env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}")
    res = subprocess.run([sys.executable, "-m", "acoll.perf", "all_reduce", "-N", "2",
                          "-b", "64", "-n", "1", "-w", "0", "--vs", "mpi"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 1, res.stderr + res.stdout
    assert "the mpi job ran as 1 ranks of one job, not 2" in res.stderr
