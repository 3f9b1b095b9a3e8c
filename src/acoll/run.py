"""``acoll-run``: start N local ranks of a program (also ``python -m acoll.run``).

Usage: ``acoll-run -n N [options] [--] prog args...``

Contract:

* Rank ``r`` runs ``prog args...`` (``sys.executable prog args...`` when ``prog`` ends with
  ``.py``) with ``ACOLL_RANK=r``, ``ACOLL_WORLD_SIZE=N``, ``ACOLL_LOCAL_RANK=r``,
  ``ACOLL_LOCAL_SIZE=N`` and ``ACOLL_COMM_ID`` set: ``--comm-id`` if given, else the
  launcher's own ``ACOLL_COMM_ID`` if set, else a free port on ``--host`` (127.0.0.1).
* Each rank runs in its own session (process group); when a rank's main process exits, what
  is left of its group is killed. Rank 0 inherits the launcher's stdin, the others read
  ``/dev/null``.
* Output is forwarded line by line with a ``[rank R] `` prefix, stdout to stdout and stderr
  to stderr (``--no-prefix``: the ranks write to the launcher's stdout/stderr directly).
  ``PYTHONUNBUFFERED=1`` is set for the ranks unless already set, so Python output is live.
* ``ACOLL_COMM_SECRET`` is set for every rank to one random 64-hex-digit value per job
  (``os.urandom(32)``; passed in the environment only, never on a command line), unless the
  launcher's own environment has ``ACOLL_COMM_SECRET`` or ``ACOLL_COMM_SECRET_FILE``: those
  reach the ranks unchanged.
* The first rank to fail ends the job: the others get SIGTERM, then SIGKILL after
  ``--grace`` seconds, and the launcher exits with that rank's code (``128 + signal`` for a
  signal), naming the rank on stderr. A rank that failed *because a peer was lost* (an
  uncaught :class:`~acoll.errors.RemoteError`, reported through ``ACOLL_RUN_REPORT``, see
  :mod:`acoll._exitreport`) often exits before the peer that caused it; so such an exit is
  blamed only if no other rank exits non-zero for another reason within ``_BLAME_WAIT_S``
  seconds (nothing is stopped meanwhile).
* SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to every rank (SIGKILL follows after
  ``--grace``; a second signal kills at once); the launcher then exits ``128 + signal``.
* ``--timeout S``: after ``S`` seconds the job is stopped the same way and the launcher
  exits 124.
* The launcher itself: 2 for usage errors, 127/126 when the program cannot be started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from ._exitreport import ENV_VAR as _REPORT_VAR
from ._exitreport import REPORT_MEMFD, REPORT_SLOT, parse_report, read_report
from ._uid import parse_host_port
from .errors import InvalidUsage

__all__ = ["main"]

EXIT_TIMEOUT = 124
_MAX_LINE = 1 << 16  # a partial line longer than this is forwarded without waiting for "\n"
_DRAIN_S = 2.0  # how long output is still read after every rank has exited
_PORT_LOW, _PORT_HIGH = 20000, 32768  # where the root's port is drawn from (see _free_comm_id)
_BLAME_WAIT_S = 2.0  # how long a consequential failure waits for the rank that caused it
_BLAME_WAIT_NAMED_S = 10.0  # ... when it names that rank and the rank is still running
_SECRET_VARS = ("ACOLL_COMM_SECRET", "ACOLL_COMM_SECRET_FILE")
_PROG = "acoll-run"


# --- command line ----------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _host_port(text: str) -> str:
    try:
        parse_host_port(text)
    except InvalidUsage as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG, allow_abbrev=False,
        usage=f"{_PROG} -n N [options] [--] prog [args ...]",
        description="Start N local ranks of an acoll program. A failing rank ends the job "
                    "with its exit code; the others are stopped.")
    p.add_argument("-n", "--nranks", type=_positive_int, required=True, metavar="N",
                   help="number of ranks to start (>= 1)")
    p.add_argument("--comm-id", type=_host_port, metavar="HOST:PORT",
                   help="root address for ACOLL_COMM_ID (default: $ACOLL_COMM_ID, else a "
                        "free port on --host)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to pick the free root port on (default: %(default)s)")
    p.add_argument("--no-prefix", action="store_true",
                   help="let ranks write to the launcher's stdout/stderr without "
                        "'[rank R] ' prefixes")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="stop the job after SECONDS and exit 124")
    p.add_argument("--grace", type=_seconds, default=3.0, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping ranks "
                        "(default: %(default)s)")
    return p


def _split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str],
                                                                               list[str]]:
    """Split ``argv`` into launcher options and the rank command.

    The command starts after ``--`` or at the first argument that is neither an option nor an
    option's value, so the program's own options never reach argparse.
    """
    takes_value = {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        if arg in takes_value:
            i += 1  # its value follows
        i += 1
    return list(argv), []


@dataclass(frozen=True)
class _Options:
    nranks: int
    command: list[str]
    comm_id: str
    prefix: bool
    timeout: float | None
    grace: float
    secret: str | None  # ACOLL_COMM_SECRET for the ranks; None: the environment provides one


def _free_comm_id(host: str) -> str:
    """A free ``host:port`` for the root, as numeric text.

    The port is drawn from below Linux's ephemeral range (32768+), which the kernel never
    hands out for port 0: between this check and rank 0 binding it, no other program's
    bind-to-any-port can take it (one that asks for a fixed port still can). Falls back to
    a kernel-chosen port when none is free there.
    """
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    rng = random.SystemRandom()
    for port in [*(rng.randrange(_PORT_LOW, _PORT_HIGH) for _ in range(50)), 0]:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((addr[0], port, *addr[2:]))
            except OSError:
                continue
            bound_host, port = s.getsockname()[:2]
            break
    return f"[{bound_host}]:{port}" if family == socket.AF_INET6 else f"{bound_host}:{port}"


def _parse(argv: Sequence[str]) -> _Options:
    parser = _parser()
    opt_args, command = _split_argv(parser, argv)
    ns = parser.parse_args(opt_args)
    if not command:
        parser.error("missing the program to run (acoll-run -n N [--] prog args...)")
    comm_id: str | None = ns.comm_id or os.environ.get("ACOLL_COMM_ID", "").strip() or None
    if comm_id is not None and ns.comm_id is None:
        try:
            parse_host_port(comm_id)
        except InvalidUsage as exc:
            parser.error(f"the environment's ACOLL_COMM_ID is invalid: {exc}")
    if comm_id is None:
        try:
            comm_id = _free_comm_id(ns.host)
        except OSError as exc:
            parser.error(f"--host {ns.host}: cannot bind a port there: {exc}")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    secret = None if any(os.environ.get(v) for v in _SECRET_VARS) else os.urandom(32).hex()
    return _Options(ns.nranks, command, comm_id, not ns.no_prefix, ns.timeout, ns.grace,
                    secret)


# --- output forwarding -----------------------------------------------------------------------

class _Sink:
    """Writes bytes to a text stream's buffer; gives up quietly once the reader is gone."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        self.broken = stream is None

    def write(self, data: bytes) -> None:
        if self.broken or self.stream is None:
            return
        try:
            buf = getattr(self.stream, "buffer", None)
            if buf is not None:
                self.stream.flush()
                buf.write(data)
                buf.flush()
            else:
                self.stream.write(data.decode(errors="replace"))
                self.stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            self.broken = True

    def say(self, text: str) -> None:
        self.write(f"{_PROG}: {text}\n".encode())


class _Lines:
    """Splits one pipe's bytes into lines and forwards each, prefixed, to a sink."""

    def __init__(self, sink: _Sink, prefix: bytes) -> None:
        self.sink = sink
        self.prefix = prefix
        self.pending = b""

    def feed(self, data: bytes) -> None:
        self.pending += data
        cut = self.pending.rfind(b"\n") + 1
        if cut == 0 and len(self.pending) >= _MAX_LINE:
            cut = len(self.pending)
        if cut:
            lines = self.pending[:cut].splitlines(keepends=True)
            self.pending = self.pending[cut:]
            if not lines[-1].endswith(b"\n"):
                lines[-1] += b"\n"
            self.sink.write(b"".join(self.prefix + line for line in lines))

    def close(self) -> None:
        if self.pending:
            self.sink.write(self.prefix + self.pending + b"\n")
            self.pending = b""


class _Rank(asyncio.SubprocessProtocol):
    """One rank's process: forwards its output, reports its exit and its pipes' closing.

    ``exited`` resolves with the return code as soon as the process is reaped, even while
    a leftover process still holds its pipes (``Process.wait()`` would wait for those too).
    """

    def __init__(self, rank: int, out: _Sink, err: _Sink) -> None:
        loop = asyncio.get_running_loop()
        self.rank = rank
        prefix = f"[rank {rank}] ".encode()
        self.lines = {1: _Lines(out, prefix), 2: _Lines(err, prefix)}
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        self.lines[fd].feed(data.encode() if isinstance(data, str) else data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd in self.lines:
            self.lines[fd].close()

    def process_exited(self) -> None:
        assert self.transport is not None
        code = self.transport.get_returncode()
        if not self.exited.done():
            self.exited.set_result(-1 if code is None else code)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def flush(self) -> None:
        for lines in self.lines.values():
            lines.close()


# --- the job ---------------------------------------------------------------------------------

def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode



def _tie_to_launcher() -> Callable[[], None] | None:
    """A function for each rank's process to run before its program: Linux sends the rank
    SIGTERM once the launcher is gone (``PR_SET_PDEATHSIG``), so that a rank does not
    outlive a launcher killed with SIGKILL (the OOM killer, ``timeout -s KILL``), which
    could not stop it itself; a rank whose launcher died before that exits at once. Only
    the process the launcher started gets the signal: a wrapper that does not ``exec`` its
    program (``bash -c "python x.py; exit $?"``) leaves that program running. ``None``
    where the platform lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def tie() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:
            os._exit(1)

    return tie


class _Reports:
    """Each rank's exit report (:mod:`acoll._exitreport`): a slot of an anonymous file of
    the launcher's (``memfd_create``; one for the job), which the rank opens through
    ``/proc/<launcher>/fd/<n>``. Nothing is on disk, so nothing is left behind even when
    the launcher is killed with SIGKILL (a folder under /tmp was, before session 57).
    Where memfds are missing, or ``/proc/<our pid>`` is not this process, a folder of its
    own is made instead, removed at the end."""

    def __init__(self, nranks: int) -> None:
        self.folder: str | None = None
        self.fd = -1
        try:
            self.fd = os.memfd_create(REPORT_MEMFD)
            os.ftruncate(self.fd, nranks * REPORT_SLOT)
            # /proc/<our pid> must be us: not so where /proc is another PID namespace's
            # (our pid there belongs to someone else, whose file a rank would overwrite)
            # or no procfs at all (found by review, session 57). Else a folder.
            mine, seen = os.fstat(self.fd), os.stat(f"/proc/{os.getpid()}/fd/{self.fd}")
            if (mine.st_dev, mine.st_ino) != (seen.st_dev, seen.st_ino):
                raise OSError("/proc/<pid> is not this process")
        except (AttributeError, OSError):
            self.close()
            self.folder = tempfile.mkdtemp(prefix="acoll-run-")

    def path(self, rank: int) -> str:
        if self.folder is not None:
            return os.path.join(self.folder, f"rank{rank}.json")
        return f"/proc/{os.getpid()}/fd/{self.fd}#{rank}"

    def read(self, rank: int) -> tuple[int | None, str] | None:
        if self.folder is not None:
            return read_report(self.path(rank))
        try:
            return parse_report(os.pread(self.fd, REPORT_SLOT, rank * REPORT_SLOT))
        except OSError:
            return None

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class _Job:
    def __init__(self, opts: _Options) -> None:
        self.opts = opts
        self.out = _Sink(sys.stdout)
        self.err = _Sink(sys.stderr)
        self.ranks: list[tuple[_Rank, asyncio.SubprocessTransport]] = []
        self.result: int | None = None  # the exit code once the job is ending
        self.stopping = False
        self.killer: asyncio.Task[None] | None = None
        self.reports = _Reports(opts.nranks)
        self.tie = _tie_to_launcher()  # (each rank dies with the launcher)
        # Ranks that failed because a peer was lost: (rank, pid, code, peer), in exit order.
        self.consequential: list[tuple[int, int, int, int | None]] = []
        self.blame_timer: asyncio.TimerHandle | None = None
        # Ranks whose exit a watcher has judged. A rank can be reaped (``exited`` done) while
        # its watcher has not run yet; blame must wait for the judgement, not the reaping.
        self.judged: set[int] = set()
        self.codes: dict[int, int] = {}  # exit codes of the ranks reaped so far

    # signals ---------------------------------------------------------------------------

    def _signal_live(self, sig: int) -> None:
        for rank, transport in self.ranks:
            if not rank.exited.done():  # not reaped yet: the pid is still ours
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(transport.get_pid(), sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every live rank; SIGKILL the rest after the grace period."""
        self.stopping = True
        self._signal_live(sig)
        if sig != signal.SIGKILL and self.killer is None:
            self.killer = asyncio.ensure_future(self._kill_later())

    async def _kill_later(self) -> None:
        await asyncio.sleep(self.opts.grace)
        self._signal_live(signal.SIGKILL)

    def _end(self, code: int, message: str) -> bool:
        if self.result is not None:
            return False
        self.result = code
        self.err.say(message)
        return True

    def on_signal(self, sig: int) -> None:
        if self.stopping:
            self._signal_live(signal.SIGKILL)
            return
        self._end(128 + sig, f"got {signal.Signals(sig).name}; stopping "
                             f"{_ranks(len(self.ranks))}")
        self.stop(sig)

    def on_timeout(self) -> None:
        if self._end(EXIT_TIMEOUT, f"timed out after {self.opts.timeout:g} s; stopping "
                                   "the ranks"):
            self.stop()

    # ranks -----------------------------------------------------------------------------

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(ACOLL_RANK=str(rank), ACOLL_WORLD_SIZE=str(self.opts.nranks),
                   ACOLL_LOCAL_RANK=str(rank), ACOLL_LOCAL_SIZE=str(self.opts.nranks),
                   ACOLL_COMM_ID=self.opts.comm_id)
        if self.opts.secret is not None:
            env["ACOLL_COMM_SECRET"] = self.opts.secret
        env[_REPORT_VAR] = self.reports.path(rank)
        if self.opts.prefix:
            env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _live(self) -> int:
        return sum(not r.exited.done() for r, _ in self.ranks)

    def _fail(self, rank: int, pid: int, code: int, note: str = "") -> None:
        others = self._live()
        tail = f"; stopping the other {_ranks(others)}" if others else ""
        self._end(_exit_code(code), f"rank {rank} (pid {pid}) {_describe(code)}{note}{tail}")
        self.stop()

    def _blame_consequential(self) -> None:
        """No rank failed for its own reason in time: blame the first consequential exit."""
        if self.blame_timer is not None:
            self.blame_timer.cancel()
            self.blame_timer = None
        if self.result is not None or self.stopping or not self.consequential:
            return
        rank, pid, code, peer = self.consequential[0]
        lost = "a peer" if peer is None else f"rank {peer}"
        if peer is not None and self.codes.get(peer) == 0:
            # (the lost rank left without failing: it skipped a call its peers made, or
            # ended before they did; exit 0 is not blamed by itself)
            lost += ", which had exited with code 0 before its peers were done"
        self._fail(rank, pid, code, f" after losing {lost}")

    def _all_judged(self) -> bool:
        return len(self.judged) == len(self.ranks)

    async def _watch(self, rank: _Rank, pid: int) -> None:
        try:
            code = await rank.exited
            self.codes[rank.rank] = code
        finally:
            self.judged.add(rank.rank)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # leftovers of the rank's group
        if code == 0 or self.stopping:
            if self._all_judged():
                self._blame_consequential()
            return
        report = self.reports.read(rank.rank) if code > 0 else None
        if report is None:  # failed for its own reason: it is the one to blame
            note = ""
            if self.consequential:
                firsts = ", ".join(str(c[0]) for c in self.consequential)
                which = "rank" if len(self.consequential) == 1 else "ranks"
                note = f" ({which} {firsts} exited before it, after losing a peer)"
            self._fail(rank.rank, pid, code, note)
            return
        # Its peer was lost: the rank that caused that may still be exiting. Wait for it.
        self.consequential.append((rank.rank, pid, code, report[0]))
        if self._all_judged():
            self._blame_consequential()
        elif self.blame_timer is None:
            # A rank named as the lost peer is still exiting (interpreter shutdown can take
            # seconds on a loaded machine): wait longer for that one.
            peer = report[0]
            named_alive = (peer is not None and 0 <= peer < len(self.ranks)
                           and peer not in self.judged)
            self.blame_timer = asyncio.get_running_loop().call_later(
                _BLAME_WAIT_NAMED_S if named_alive else _BLAME_WAIT_S,
                self._blame_consequential)

    async def _start(self, rank: int) -> bool:
        opts = self.opts
        loop = asyncio.get_running_loop()
        pipe = subprocess.PIPE if opts.prefix else None
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _Rank(rank, self.out, self.err), *opts.command,
                env=self._env(rank), stdout=pipe, stderr=pipe,
                stdin=None if rank == 0 else subprocess.DEVNULL, start_new_session=True,
                preexec_fn=self.tie)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._end(code, f"cannot start rank {rank}: {opts.command[0]}: "
                            f"{exc.strerror or exc}")
            self.stop()
            return False
        self.ranks.append((protocol, transport))
        return True

    async def run(self) -> int:
        watchers: list[asyncio.Task[None]] = []
        try:
            for rank in range(self.opts.nranks):
                if self.stopping or not await self._start(rank):
                    break
                protocol, transport = self.ranks[-1]
                watchers.append(asyncio.ensure_future(self._watch(protocol, transport.get_pid())))
            await asyncio.gather(*watchers)
            self._blame_consequential()
        finally:
            if self.blame_timer is not None:
                self.blame_timer.cancel()
            if self.killer is not None:
                self.killer.cancel()
            if self.ranks:
                # A process that left its rank's group may still hold a pipe: bound the wait.
                await asyncio.wait([r.closed for r, _ in self.ranks], timeout=_DRAIN_S)
            for protocol, transport in self.ranks:
                protocol.flush()
                transport.close()
            self.reports.close()
        return 0 if self.result is None else self.result


async def _launch(opts: _Options) -> int:
    job = _Job(opts)
    loop = asyncio.get_running_loop()
    installed: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            loop.add_signal_handler(sig, job.on_signal, sig)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread: no forwarding
    timer = loop.call_later(opts.timeout, job.on_timeout) if opts.timeout else None
    try:
        return await job.run()
    finally:
        if timer is not None:
            timer.cancel()
        for signum in installed:
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``acoll-run``; return the exit code (see the module docstring)."""
    try:
        opts = _parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: usage errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return asyncio.run(_launch(opts))


if __name__ == "__main__":
    sys.exit(main())
