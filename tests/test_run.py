"""Tests of the acoll-run launcher, run as ``python -m acoll.run`` subprocesses."""

from __future__ import annotations

import asyncio
import builtins
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


def tmp_path_of(pid_dir: Path) -> Path:
    """An empty folder beside ``pid_dir``, for a job's $TMPDIR."""
    scratch = pid_dir / "tmpdir"
    scratch.mkdir()
    return scratch


def _job(folder: Path, body: str, *launcher_args: str,
         env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The launcher running ``rank_code(folder, body)`` on each rank, output piped."""
    return subprocess.Popen([PY, "-m", "acoll.run", *launcher_args, "--", PY, "-c",
                             rank_code(folder, body)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


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
    # Ranks write straight to the launcher's stdout: one write per line (print() makes two
    # when Python's output is unbuffered, and two ranks' writes may then interleave).
    res = launch("-n", "2", "--no-prefix", "--", PY, "-c",
                 "import sys; sys.stdout.write('plain\\n')")
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
    body = ("try:\n"  # (recorded inside: the signal is sent once every rank recorded)
            "    record(f'rank{r}', os.getpid())\n"
            "    time.sleep(60)\n"
            "finally:\n"
            "    record(f'exit{r}', 0)\n")
    with _job(pid_dir, body, "-n", "3") as proc:
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_do_not_outlive_a_launcher_killed_with_sigkill(pid_dir: Path) -> None:
    """Found by review (session 56): ranks run in sessions of their own, so a launcher
    killed with SIGKILL (the OOM killer, ``timeout -s KILL``) left them running for ever.
    Each rank now gets SIGTERM when its launcher dies."""
    body = ("record(f'rank{r}', os.getpid())\n"
            "time.sleep(60)\n")
    scratch = tmp_path_of(pid_dir)
    with _job(pid_dir, body, "-n", "2", env={**os.environ, "TMPDIR": str(scratch)}) as proc:
        try:
            pids = _wait_files(pid_dir, 2)
            proc.kill()
            proc.communicate(timeout=15)
        finally:
            proc.kill()
    assert _wait_gone(pids, within=10) == []
    # Nothing of the launcher's is left behind: before session 57 its report folder
    # stayed under $TMPDIR (its exit reports are memfds now).
    assert list(scratch.iterdir()) == []


def test_second_signal_kills_at_once(pid_dir: Path) -> None:
    body = ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "record(f'rank{r}', os.getpid())\n"
            "time.sleep(60)\n")
    with _job(pid_dir, body, "-n", "2", "--grace", "60") as proc:
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


# --- blame: the first rank to fail, not the first to exit -----------------------------------

# Ranks 0 and 1 fail *because* rank 2 left (an uncaught RemoteError naming it) and exit at
# once; rank 2 exits 7 a moment later, as a real rank does while its interpreter shuts down.
_CONSEQUENCE = (
    "import os, sys, time\n"
    "from acoll.errors import RemoteError\n"
    "r = int(os.environ['ACOLL_RANK'])\n"
    "mark = os.path.join(D, 'left')\n"
    "def pid_of(k):\n"
    "    try:\n"
    "        return int(open(os.path.join(D, f'{k}.pid')).read())\n"
    "    except (OSError, ValueError):\n"
    "        return None\n"
    "deadline = time.monotonic() + 60\n"
    "if r == 2:\n"
    "    # Ranks start at different times on a loaded machine: wait until 0 and 1 run, tell\n"
    "    # them to fail, and exit only once the launcher has reaped both (their /proc entry\n"
    "    # is gone), so that they really exited first.\n"
    "    while None in (pid_of(0), pid_of(1)) and time.monotonic() < deadline:\n"
    "        time.sleep(0.01)\n"
    "    open(mark, 'w').close()\n"
    "    while time.monotonic() < deadline and any(\n"
    "            os.path.exists(f'/proc/{pid_of(k)}') for k in (0, 1)):\n"
    "        time.sleep(0.01)\n"
    "    time.sleep(0.2)\n"
    "    sys.exit(7)\n"
    "with open(os.path.join(D, f'{r}.tmp'), 'w') as f:\n"
    "    f.write(str(os.getpid()))\n"
    "os.rename(os.path.join(D, f'{r}.tmp'), os.path.join(D, f'{r}.pid'))\n"
    "while not os.path.exists(mark) and time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
    "raise RemoteError('rank 2 is gone', 2)\n"
)


def test_rank_exiting_after_its_peers_is_still_blamed(tmp_path: Path) -> None:
    for attempt in range(2):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        res = launch("-n", "3", "--", PY, "-c", f"D = {str(folder)!r}\n" + _CONSEQUENCE)
        assert res.returncode == 7, res.stderr
        [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("acoll-run:")]
        assert line.startswith("acoll-run: rank 2 (pid "), line
        assert "exited with code 7" in line
        assert "after losing a peer" in line  # ranks 0 and 1 really exited first


def test_consequential_failure_is_blamed_when_nobody_else_failed(tmp_path: Path) -> None:
    # Rank 1 ends cleanly; rank 0 then fails naming it: rank 0's own code is the job's.
    code = ("import os, sys\n"
            "from acoll.errors import RemoteError\n"
            "if os.environ['ACOLL_RANK'] == '0':\n"
            "    raise RemoteError('rank 1 is gone', 1)\n")
    start = time.monotonic()
    res = launch("-n", "2", "--", PY, "-c", code)
    assert res.returncode == 1
    assert "rank 0 (pid" in res.stderr
    assert "exited with code 1 after losing rank 1" in res.stderr
    assert time.monotonic() - start < acoll_run._BLAME_WAIT_S + 10


def test_consequential_failure_waits_only_briefly_for_a_live_peer(pid_dir: Path) -> None:
    # Rank 1 stays alive: rank 0's failure is blamed after the bounded wait, then 1 stopped.
    body = ("record(f'rank{r}', os.getpid())\n"
            "if r == 0:\n"
            "    from acoll.errors import RemoteError\n"
            "    raise RemoteError('rank 1 is gone', 1)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    res = launch("-n", "2", "--", PY, "-c", rank_code(pid_dir, body))
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert "rank 0 (pid" in res.stderr
    assert "after losing rank 1; stopping the other 1 rank" in res.stderr
    # (the named rank is alive: the wait is _BLAME_WAIT_NAMED_S; the rest is two interpreters
    # starting, 2 s alone on the 2-core VM, 5.6 s beside two busy loops, and up to 19 s
    # beside test_run.py's other jobs under xdist (session 57): far from rank 1's 60 s)
    assert acoll_run._BLAME_WAIT_NAMED_S <= elapsed < acoll_run._BLAME_WAIT_NAMED_S + 35
    assert _wait_gone([int(f.read_text()) for f in pid_dir.glob("*.pid")]) == []


# The scenario with real communicators: the last rank leaves with sys.exit(7) inside
# ``async with``; the others fail in their next all_reduce. Several jobs at once, so that
# some of them see the peers exit first (they did in 3 to 6 of 10 runs before the fix).
_REAL = (
    "import asyncio, sys\n"
    "import numpy as np\n"
    "import acoll\n"
    "async def main():\n"
    "    async with await acoll.init_from_env() as comm:\n"
    "        x = np.ones(1000, np.float32)\n"
    "        for _ in range(20):\n"
    "            await comm.all_reduce(x)\n"
    "        if comm.rank == 2:\n"
    "            sys.exit(7)\n"
    "        for _ in range(20):\n"
    "            await comm.all_reduce(x)\n"
    "asyncio.run(main())\n"
)


class _FakeTransport:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def get_pid(self) -> int:
        return self.pid


def test_exits_reaped_together_are_judged_before_blame(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # Found under load: rank 2 (the cause) and rank 1 (which lost it) were reaped in one loop
    # pass; rank 1's watcher ran first, saw no live rank and blamed itself. Blame must wait
    # until every reaped rank's exit has been judged.
    async def scenario() -> tuple[int, list[str]]:
        opts = acoll_run._Options(nranks=3, command=["x"], comm_id="127.0.0.1:1", prefix=False,
                                  timeout=None, grace=1.0, secret=None)
        job = acoll_run._Job(opts)
        said: list[str] = []
        job.err.say = said.append  # type: ignore[method-assign]
        job.stop = lambda sig=signal.SIGTERM: None  # type: ignore[method-assign]
        ranks = []
        for r in range(3):
            rank = acoll_run._Rank.__new__(acoll_run._Rank)
            rank.rank = r
            rank.exited = asyncio.get_running_loop().create_future()
            job.ranks.append((rank, _FakeTransport(2**22 + r)))  # type: ignore[arg-type]
            ranks.append(rank)
        for r in (0, 1):
            os.pwrite(job.reports.fd, json.dumps(
                {"peer": 2, "error": "RemoteError: rank 2 is gone"}).encode(),
                r * acoll_run.REPORT_SLOT)
        watchers = [asyncio.ensure_future(job._watch(rank, 2**22 + rank.rank))
                    for rank in ranks]
        await asyncio.sleep(0)
        ranks[0].exited.set_result(1)
        await asyncio.sleep(0)
        ranks[1].exited.set_result(1)  # same pass: rank 1's watcher is scheduled first
        ranks[2].exited.set_result(7)
        await asyncio.wait_for(asyncio.gather(*watchers), 5)
        job._blame_consequential()
        if job.blame_timer is not None:
            job.blame_timer.cancel()
        job.reports.close()
        return job.result or 0, said

    killed: list[int] = []  # (the fake pids must never reach a real process group)
    monkeypatch.setattr(acoll_run.os, "killpg", lambda pgid, sig: killed.append(pgid))
    code, said = asyncio.run(scenario())
    assert sorted(killed) == [2**22, 2**22 + 1, 2**22 + 2]
    assert code == 7, said
    assert len(said) == 1, said
    assert said[0].startswith("rank 2 (pid "), said


def test_real_job_blames_the_rank_that_left() -> None:
    jobs = 4
    env = {**os.environ, "ACOLL_TIMEOUT": "45"}
    procs = [subprocess.Popen([PY, "-m", "acoll.run", "-n", "3", "--", PY, "-c", _REAL],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(jobs)]
    results = []
    for proc in procs:
        try:
            _out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        results.append((proc.returncode, [ln for ln in err.splitlines()
                                          if ln.startswith("acoll-run:")]))
    for code, lines in results:
        assert code == 7, (code, lines)
        assert len(lines) == 1
        assert lines[0].startswith("acoll-run: rank 2 (pid "), lines


def test_a_rank_leaving_early_with_code_0_is_named_as_the_lost_peer() -> None:
    """A rank that leaves with exit code 0 while its peers still run its calls is not a
    failure by itself: its peers' RemoteError is, and the launcher's line says that the
    peer they lost had exited with code 0 (session 57: it did not say so)."""
    code = _REAL.replace("sys.exit(7)", "os._exit(0)").replace(
        "import asyncio, sys", "import asyncio, os, sys")
    env = {**os.environ, "ACOLL_TIMEOUT": "45"}
    res = launch("-n", "3", "--", PY, "-c", code, env=env)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("acoll-run:")]
    assert res.returncode == 1, res.stderr[-2000:]
    assert len(lines) == 1, lines
    assert "after losing rank 2, which had exited with code 0" in lines[0], lines


# --- the job's secret ------------------------------------------------------------------------

_SHOW_SECRET = ("import json, os\n"
                "print(json.dumps([os.environ.get('ACOLL_COMM_SECRET'),"
                " os.environ.get('ACOLL_COMM_SECRET_FILE'),"
                " open('/proc/self/cmdline', 'rb').read().decode(errors='replace')]))\n")


def _secrets(env: dict[str, str]) -> list[list[str | None]]:
    res = launch("-n", "3", "--", PY, "-c", _SHOW_SECRET, env=env)
    assert res.returncode == 0, res.stderr
    return [json.loads(line.partition("] ")[2]) for line in res.stdout.splitlines()]


def test_every_rank_gets_one_random_secret_per_job() -> None:
    env = {k: v for k, v in os.environ.items() if k not in acoll_run._SECRET_VARS}
    first, second = _secrets(env), _secrets(env)
    for seen in (first, second):
        assert len(seen) == 3
        values = {s for s, _f, _c in seen}
        assert len(values) == 1
        [secret] = values
        assert secret is not None
        assert len(secret) == 64
        assert int(secret, 16) >= 0
        assert all(f is None for _s, f, _c in seen)
        assert all(secret not in cmdline for _s, _f, cmdline in seen)  # environment only
    assert first[0][0] != second[0][0]


@pytest.mark.parametrize("var", ["ACOLL_COMM_SECRET", "ACOLL_COMM_SECRET_FILE"])
def test_secret_from_the_launchers_environment_passes_through(var: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in acoll_run._SECRET_VARS}
    env[var] = "given-by-user"
    seen = _secrets(env)
    expect = ["given-by-user", None] if var == "ACOLL_COMM_SECRET" else [None, "given-by-user"]
    assert [s[:2] for s in seen] == [expect] * 3


def test_find_remote_error_follows_causes_and_groups() -> None:
    from acoll._exitreport import find_remote_error
    from acoll.errors import RemoteError

    remote = RemoteError("rank 3 is gone", 3)
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = remote
    outer = ValueError("while handling")
    outer.__context__ = wrapped
    assert find_remote_error(outer) is remote
    group_type = getattr(builtins, "BaseExceptionGroup", None)  # Python >= 3.11
    if group_type is not None:
        assert find_remote_error(group_type("g", [ValueError(), remote])) is remote
    assert find_remote_error(ValueError("plain")) is None
    assert find_remote_error(None) is None


def test_an_invalid_usage_reported_by_a_peer_is_a_consequence() -> None:
    """Found by review (session 57): a rank's misuse reached its peers as InvalidUsage,
    which wrote no exit report, so the launcher blamed whichever rank exited first (the
    innocent one, when the misusing rank took longer to exit)."""
    from acoll._bootstrap.ring import error_from_wire
    from acoll._bootstrap.wire import Error
    from acoll._exitreport import find_remote_error
    from acoll.errors import InvalidUsage

    told = error_from_wire(Error("usage", "rank 1 made an invalid send call", 1))
    assert isinstance(told, InvalidUsage)
    assert told.rank == 1
    assert find_remote_error(RuntimeError("x")) is None
    wrapped = RuntimeError("while running")
    wrapped.__context__ = told
    assert find_remote_error(wrapped) is told
    assert find_remote_error(InvalidUsage("found here")) is None
    code = ("import asyncio, atexit, time\n"
            "import numpy as np\n"
            "import acoll\n"
            "async def main():\n"
            "    comm = await acoll.init_from_env(timeout=30)\n"
            "    await comm.all_reduce(np.ones(4))\n"
            "    if comm.rank == 1:\n"
            "        atexit.register(time.sleep, 2)  # (exits after its peer)\n"
            "        await comm.send(np.ones(4), 1)  # to self, outside a group\n"
            "    await comm.all_reduce(np.ones(4))\n"
            "asyncio.run(main())\n")
    res = launch("-n", "2", "--", PY, "-c", code)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("acoll-run:")]
    assert res.returncode == 1, res.stderr[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith("acoll-run: rank 1 (pid "), lines


def test_reports_take_one_descriptor_whatever_the_rank_count() -> None:
    """Found by review (session 57): a memfd per rank, held for the whole job, took the
    launcher's open-file limit (-n 340 failed at the usual 1024 where it had run)."""
    before = len(os.listdir("/proc/self/fd"))
    reports = acoll_run._Reports(2000)
    try:
        assert len(os.listdir("/proc/self/fd")) == before + 1
    finally:
        reports.close()


def test_a_report_path_that_is_not_a_launchers_memfd_is_left_alone(tmp_path: Path) -> None:
    """Found by review (session 57): a rank whose launcher died held a /proc/<pid>/fd/<n>
    path that, once the pid was reused, named another process's file, which the rank's
    report overwrote. A /proc path is written only while it is a report memfd."""
    from acoll._exitreport import _write
    from acoll.errors import RemoteError

    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    with open(victim, "r+") as held:
        _write(f"/proc/self/fd/{held.fileno()}#0", RemoteError("rank 1 is gone", 1))
    assert victim.read_text() == "not yours"
    reports = acoll_run._Reports(3)
    try:
        assert reports.folder is None
        _write(reports.path(2), RemoteError("rank 1 is gone " + "x" * 10_000, 1))
        assert reports.read(0) is None
        peer, error = reports.read(2)  # type: ignore[misc]
        assert peer == 1
        assert error.startswith("RemoteError: rank 1 is gone xx")  # (cut to fit its slot)
    finally:
        reports.close()


def test_reports_use_a_folder_where_proc_is_not_this_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 57): in a PID namespace whose /proc is its parent's (or
    with no procfs), /proc/<our pid> is another process: ranks would write into its files
    and the launcher read empty reports. The launcher checks, and uses a folder then."""
    monkeypatch.setattr(acoll_run.os, "getpid", lambda: 1)
    reports = acoll_run._Reports(2)
    try:
        assert reports.folder is not None
        assert reports.path(1) == os.path.join(reports.folder, "rank1.json")
        assert reports.fd == -1
    finally:
        reports.close()
    assert not os.path.exists(reports.folder)
    monkeypatch.undo()
    reports = acoll_run._Reports(2)
    try:
        assert reports.folder is None
        assert reports.path(0).startswith(f"/proc/{os.getpid()}/fd/")
        assert reports.path(0).endswith("#0")
    finally:
        reports.close()
