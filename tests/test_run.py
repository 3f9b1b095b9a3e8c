"""Tests of the acoll-run launcher, run as ``python -m acoll.run`` subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from acoll import run as acoll_run

PY = sys.executable


def launch(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "acoll.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (nobody may reap orphans here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_gone(pids: list[int], within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _wait_files(folder: Path, count: int, within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        files = sorted(folder.glob("*.pid"))
        if len(files) >= count and all(f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(folder.glob('*.pid')))} of {count} ranks started")


@pytest.fixture
def pid_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder where ranks record pids; whatever is still alive at the end is killed."""
    yield tmp_path
    for f in tmp_path.glob("*.pid"):
        text = f.read_text().strip()
        if text and _alive(int(text)):
            os.kill(int(text), signal.SIGKILL)


# Rank code writing its pid to {dir}/rank{R}.pid (atomically), then running BODY.
_RECORD = (
    "import os, signal, subprocess, sys, time\n"
    "r = int(os.environ['ACOLL_RANK'])\n"
    "def record(name, pid):\n"
    "    tmp = os.path.join(D, name + '.tmp')\n"
    "    open(tmp, 'w').write(str(pid))\n"
    "    os.replace(tmp, os.path.join(D, name + '.pid'))\n"
)


def rank_code(folder: Path, body: str) -> str:
    return f"D = {str(folder)!r}\n" + _RECORD + body


def test_all_ranks_succeed_with_env_and_prefixed_output() -> None:
    code = ("import json, os, sys\n"
            "keys = ['ACOLL_RANK', 'ACOLL_WORLD_SIZE', 'ACOLL_LOCAL_RANK', 'ACOLL_LOCAL_SIZE',"
            " 'ACOLL_COMM_ID']\n"
            "print(json.dumps({k: os.environ[k] for k in keys}))\n"
            "print('to stderr', os.environ['ACOLL_RANK'], file=sys.stderr)\n")
    res = launch("-n", "3", "--", PY, "-c", code)
    assert res.returncode == 0, res.stderr
    seen = {}
    for line in res.stdout.splitlines():
        prefix, _, payload = line.partition("] ")
        assert prefix.startswith("[rank ")
        env = json.loads(payload)
        assert prefix == f"[rank {env['ACOLL_RANK']}"
        seen[int(env["ACOLL_RANK"])] = env
    assert sorted(seen) == [0, 1, 2]
    comm_ids = {e["ACOLL_COMM_ID"] for e in seen.values()}
    assert len(comm_ids) == 1
    host, _, port = comm_ids.pop().rpartition(":")
    assert host == "127.0.0.1"
    assert 0 < int(port) < 65536
    for r, env in seen.items():
        assert env["ACOLL_WORLD_SIZE"] == env["ACOLL_LOCAL_SIZE"] == "3"
        assert env["ACOLL_LOCAL_RANK"] == str(r)
    assert sorted(res.stderr.splitlines()) == [f"[rank {r}] to stderr {r}" for r in range(3)]


def test_program_options_and_dash_dash_reach_the_rank() -> None:
    code = "import sys; print(sys.argv[1:])"
    res = launch("-n", "1", PY, "-c", code, "-n", "5", "--", "--timeout")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[rank 0] ['-n', '5', '--', '--timeout']\n"


def test_py_script_runs_with_the_launchers_python(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text("import os, sys; print(sys.executable == os.environ['EXPECT'], "
                      "sys.argv[1])\n")
    res = launch("-n", "2", str(script), "arg", env={**os.environ, "EXPECT": PY})
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank 0] True arg", "[rank 1] True arg"]


def test_comm_id_option_and_environment() -> None:
    code = "import os; print(os.environ['ACOLL_COMM_ID'])"
    res = launch("-n", "1", "--comm-id", "10.1.2.3:4567", "--", PY, "-c", code)
    assert res.stdout == "[rank 0] 10.1.2.3:4567\n"
    res = launch("-n", "1", "--", PY, "-c", code,
                 env={**os.environ, "ACOLL_COMM_ID": "10.9.9.9:99"})
    assert res.stdout == "[rank 0] 10.9.9.9:99\n"


def test_no_prefix() -> None:
    res = launch("-n", "2", "--no-prefix", "--", PY, "-c", "print('plain')")
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["plain", "plain"]


def test_partial_and_long_lines_are_prefixed() -> None:
    code = ("import sys\n"
            "sys.stdout.write('a' * 200000 + '\\nlast-no-newline')\n")
    res = launch("-n", "1", "--", PY, "-c", code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert all(line.startswith("[rank 0] ") for line in lines)
    assert "".join(line.removeprefix("[rank 0] ") for line in lines[:-1]) == "a" * 200000
    assert lines[-1] == "[rank 0] last-no-newline"


def test_heavy_output_does_not_block() -> None:
    code = ("import sys\n"
            "for i in range(100000): sys.stdout.write(f'line {i}\\n')\n"
            "sys.stderr.write('x' * 3000000)\n")
    res = launch("-n", "2", "--", PY, "-c", code, timeout=60)
    assert res.returncode == 0
    assert res.stdout.count("\n") == 200000


def test_failing_rank_stops_the_others(pid_dir: Path) -> None:
    body = ("record(f'rank{r}', os.getpid())\n"
            "if r == 1:\n"
            "    while len([f for f in os.listdir(D) if f.endswith('.pid')]) < 3:\n"
            "        time.sleep(0.02)\n"
            "    sys.exit(3)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    res = launch("-n", "3", "--", PY, "-c", rank_code(pid_dir, body))
    elapsed = time.monotonic() - start
    assert res.returncode == 3
    assert elapsed < 15
    assert "rank 1" in res.stderr
    assert "exited with code 3" in res.stderr
    pids = [int(f.read_text()) for f in pid_dir.glob("*.pid")]
    assert len(pids) == 3
    assert _wait_gone(pids) == []


def test_sigkilled_rank_gives_137_and_kills_grandchildren(pid_dir: Path) -> None:
    body = ("child = subprocess.Popen(['sleep', '60'])\n"
            "record(f'child{r}', child.pid)\n"
            "record(f'rank{r}', os.getpid())\n"
            "if r == 2:\n"
            "    while len([f for f in os.listdir(D) if f.endswith('.pid')]) < 6:\n"
            "        time.sleep(0.02)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(60)\n")
    res = launch("-n", "3", "--", PY, "-c", rank_code(pid_dir, body))
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 2" in res.stderr
    assert "SIGKILL" in res.stderr
    pids = [int(f.read_text()) for f in pid_dir.glob("*.pid")]
    assert len(pids) == 6
    assert _wait_gone(pids) == []


def test_rank_ignoring_sigterm_is_killed_after_grace(pid_dir: Path) -> None:
    body = ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "record(f'rank{r}', os.getpid())\n"
            "if r == 1:\n"
            "    while len([f for f in os.listdir(D) if f.endswith('.pid')]) < 2:\n"
            "        time.sleep(0.02)\n"
            "    sys.exit(5)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    res = launch("-n", "2", "--grace", "0.5", "--", PY, "-c", rank_code(pid_dir, body))
    assert res.returncode == 5
    assert time.monotonic() - start < 15
    assert _wait_gone([int(f.read_text()) for f in pid_dir.glob("*.pid")]) == []


def test_timeout_exits_124(pid_dir: Path) -> None:
    body = "record(f'rank{r}', os.getpid())\ntime.sleep(60)\n"
    start = time.monotonic()
    res = launch("-n", "3", "--timeout", "2", "--", PY, "-c", rank_code(pid_dir, body))
    assert res.returncode == 124
    assert time.monotonic() - start < 15
    assert "timed out" in res.stderr
    assert _wait_gone([int(f.read_text()) for f in pid_dir.glob("*.pid")]) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_is_forwarded(pid_dir: Path, sig: signal.Signals) -> None:
    body = ("record(f'rank{r}', os.getpid())\n"
            "try:\n"
            "    time.sleep(60)\n"
            "finally:\n"
            "    record(f'exit{r}', 0)\n")
    with subprocess.Popen([PY, "-m", "acoll.run", "-n", "3", "--", PY, "-c",
                           rank_code(pid_dir, body)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            pids = _wait_files(pid_dir, 3)
            proc.send_signal(sig)
            _out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 128 + sig
    assert sig.name in err
    assert _wait_gone(pids) == []
    if sig == signal.SIGINT:  # Python ranks saw KeyboardInterrupt and ran their finally
        assert len(list(pid_dir.glob("exit*.pid"))) == 3


def test_second_signal_kills_at_once(pid_dir: Path) -> None:
    body = ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "record(f'rank{r}', os.getpid())\n"
            "time.sleep(60)\n")
    with subprocess.Popen([PY, "-m", "acoll.run", "-n", "2", "--grace", "60", "--", PY, "-c",
                           rank_code(pid_dir, body)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            pids = _wait_files(pid_dir, 2)
            proc.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)  # the ranks ignore it; the grace period is long
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=15)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert _wait_gone(pids) == []


def test_escaped_grandchild_holding_the_pipe_does_not_hang(pid_dir: Path) -> None:
    body = ("child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
            "record('escaped', child.pid)\n"
            "print('done')\n")
    start = time.monotonic()
    res = launch("-n", "1", "--", PY, "-c", rank_code(pid_dir, body))
    assert res.returncode == 0
    assert res.stdout == "[rank 0] done\n"
    assert time.monotonic() - start < 15


def test_missing_program_exits_127() -> None:
    res = launch("-n", "2", "--", "/nonexistent/acoll-prog")
    assert res.returncode == 127
    assert "cannot start rank 0" in res.stderr


@pytest.mark.parametrize("argv", [
    ["-n", "0", "prog"],
    ["-n", "x", "prog"],
    ["-n", "2"],
    ["prog"],
    ["-n", "2", "--timeout", "0", "prog"],
    ["-n", "2", "--comm-id", "nohostport", "prog"],
    ["-n", "2", "--bogus", "prog"],
    ["-n", "2", "--timeout", "prog"],
])
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert acoll_run.main(argv) == 2
    assert "usage: acoll-run" in capsys.readouterr().err


def test_invalid_comm_id_in_environment(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ACOLL_COMM_ID", "not-an-address")
    assert acoll_run.main(["-n", "1", "prog"]) == 2
    assert "ACOLL_COMM_ID" in capsys.readouterr().err


def test_usage_error_from_the_command_line() -> None:
    res = launch("-n", "0", "--", PY, "-c", "pass")
    assert res.returncode == 2
    assert "-n/--nranks: must be >= 1" in res.stderr
