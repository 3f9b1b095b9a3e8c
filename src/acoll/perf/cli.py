"""The ``acoll-perf`` command line: options, starting ranks, handing results to rank 0.

With ``-N n`` this process is the driver: it starts ``n`` ranks with acoll-run's launcher
(``python -m acoll.perf ... --result-file F``), reads rank 0's result from ``F`` and
reports; ``--vs`` then starts ``n`` torch ranks the same way, or ``n`` MPI processes with
``mpirun`` (``--vs mpi``). Otherwise (under a launcher, or alone) each process is a rank: it
joins acoll from the environment, sweeps, then (``--vs``) sweeps torch.distributed or MPI
too (MPI only in a job ``mpirun`` started); rank 0 reports.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._communicator import Communicator, get_unique_id, init_rank
from .._config import parse_size
from .._dtypes import DTYPE_NAMES, ReduceOp, parse_dtype
from .._env import LaunchInfo, init_from_env, ranks_from_env
from .._uid import parse_host_port
from ..errors import AcollError, InvalidUsage
from .backends import mpi as mpi_backend
from .backends.acoll import AcollBackend
from .backends.tcp import TcpBackend
from .backends.torch import TorchBackend
from .buffers import CupyAllocator, host_buffer, shared_buffer
from .colls import COLLECTIVES, COLLS, Usage
from .report import PROG, Result, median_result, report, round_ratios
from .sweep import Spec, sweep, sweep_sizes

__all__ = ["main"]

_T = TypeVar("_T")
#: acoll's side of a job, by the first backend of a collective's table row.
_ACOLL_SIDE: dict[str, Callable[[Communicator], AcollBackend]] = {
    "acoll": AcollBackend, "tcp": TcpBackend}
#: Launchers under which the processes are MPI processes (``--vs mpi`` without ``-N``).
_MPI_LAUNCHERS = ("openmpi", "pmi")


@dataclass
class _Opts:
    """The parsed command line: the sweep, and how to run and report it."""

    spec: Spec
    nranks: int | None
    json: str | None
    plot: str | None
    vs: str | None
    loop: str
    timeout: float | None
    device: str  # where acoll's buffers live: cpu or cuda
    rounds: int  # with -N: the jobs run this many times, alternating with --vs's
    register: bool  # acoll's buffers are registered with the communicator (-R 1)
    backend: str  # this process's side: acoll (acoll or tcp, as the collective says) or torch's
    result_file: str | None
    peer_init: str | None
    argv: list[str] = field(default_factory=list)

    @property
    def peer(self) -> str | None:
        """The library this process sweeps besides acoll (gloo, nccl, mpi), if any."""
        return self.vs if self.backend == "acoll" else self.backend


# --------------------------------------------------------------------------- command line

def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M, 1G)"
                                         ) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="nccl-tests-style bandwidth/latency sweeps of acoll collectives.")
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument("-b", "--minbytes", type=_size_arg, default=32 << 20, metavar="MIN",
                   help="smallest size in bytes; K/M/G suffixes (default 32M)")
    p.add_argument("-e", "--maxbytes", type=_size_arg, default=None, metavar="MAX",
                   help="largest size (default: MIN)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, metavar="FACTOR",
                   help="multiply the size by FACTOR each step (default 2)")
    p.add_argument("-i", "--stepbytes", type=_size_arg, default=0, metavar="BYTES",
                   help="add BYTES each step instead of multiplying")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="warm-up iterations before each size (5)")
    p.add_argument("-d", "--datatype", default="float32", metavar="DTYPE",
                   help="int8 uint8 int32 uint32 int64 uint64 float16 bfloat16 float32 "
                        "float64 (default float32)")
    p.add_argument("-o", "--op", default="sum", help="sum prod max min avg (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root rank (0)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check results against NumPy (1)")
    p.add_argument("-a", "--average", type=int, choices=(0, 1, 2, 3), default=3,
                   help="time over ranks: 0 rank 0, 1 average, 2 min, 3 max (default 3)")
    p.add_argument("-N", "--nranks", type=int, default=None,
                   help="start this many local ranks (default: launcher variables or 1)")
    p.add_argument("--json", metavar="FILE", help="write every record and metadata as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot busbw against size (needs matplotlib: pip install acoll[plot])")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="acoll's buffers: host NumPy (cpu, default) or CuPy on GPU "
                        "local_rank %% ngpus (cuda)")
    p.add_argument("--vs", choices=("gloo", "nccl", "mpi"),
                   help="also run torch.distributed with this backend (gloo, nccl), or MPI "
                        "through mpi4py and mpirun (mpi), and compare")
    p.add_argument("-R", "--register", type=int, choices=(0, 1), default=0,
                   help="1: acoll's buffers are registered with the communicator "
                        "(comm.register; host buffers from acoll.empty_shared), as "
                        "nccl-tests' -R; other libraries' buffers are not (default 0)")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="with -N: run the sweep R times, alternating with --vs's, and report "
                        "medians and per-round ratios (for machines whose speed drifts)")
    p.add_argument("--no-inplace", dest="inplace", action="store_false",
                   help="skip the in-place columns")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="event loop (auto: uvloop when installed)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with -N: stop the job after S seconds")
    p.add_argument("--backend", default="acoll", choices=("acoll", "gloo", "nccl", "mpi"),
                   help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def _parse(argv: list[str]) -> _Opts:
    ns = _parser().parse_args(argv)
    maxbytes = ns.minbytes if ns.maxbytes is None else ns.maxbytes
    if ns.iters < 1 or ns.warmup_iters < 0:
        raise Usage("-n must be >= 1 and -w >= 0")
    if ns.rounds < 1:
        raise Usage("--rounds must be >= 1")
    if ns.timeout is not None and not ns.timeout > 0:
        raise Usage(f"--timeout must be a positive number of seconds, got {ns.timeout}")
    if ns.stepbytes < 0:
        raise Usage(f"-i must be >= 0, got {ns.stepbytes}")
    for flag, path in (("--json", ns.json), ("--plot", ns.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):  # (found out only after the sweep, before)
            raise Usage(f"{flag} {path}: no folder {folder}")
    if ns.rounds > 1 and ns.nranks is None:
        raise Usage("--rounds needs -N (it alternates whole jobs)")
    if ns.nranks is not None:
        if ns.nranks < 1:
            raise Usage("-N must be >= 1")
        COLLS[ns.collective].check_ranks(ns.nranks, ns.root)
    try:
        dtype = parse_dtype(ns.datatype)
        op = ReduceOp.coerce(ns.op)
    except InvalidUsage as exc:
        raise Usage(str(exc)) from None
    sweep_sizes(ns.minbytes, maxbytes, ns.stepfactor, ns.stepbytes)  # validates
    progress = ns.progress if ns.progress is not None else sys.stderr.isatty()
    spec = Spec(ns.collective, ns.minbytes, maxbytes, ns.stepfactor, ns.stepbytes, ns.iters,
                ns.warmup_iters, DTYPE_NAMES[dtype], op.name.lower(), ns.root,
                bool(ns.check), ns.average, ns.inplace, progress, ns.inject_error)
    return _Opts(spec, ns.nranks, ns.json, ns.plot, ns.vs, ns.loop, ns.timeout, ns.device,
                 ns.rounds, bool(ns.register), ns.backend,
                 ns.result_file, ns.peer_init, list(argv))


def _rank_args(o: _Opts, backend: str, result_file: str, peer_init: str | None) -> list[str]:
    """The command line of one rank that ``-N`` starts (the inverse of :func:`_parse`)."""
    s = o.spec
    args = [s.coll, "-b", str(s.minbytes), "-e", str(s.maxbytes), "-f", repr(s.factor),
            "-i", str(s.stepbytes), "-n", str(s.iters), "-w", str(s.warmup), "-d", s.dtype,
            "-o", s.op, "-r", str(s.root), "-c", str(int(s.check)), "-a", str(s.average),
            "--loop", o.loop, "--device", o.device, "-R", str(int(o.register)),
            "--backend", backend,
            "--result-file", result_file,
            "--progress" if s.progress else "--no-progress"]
    if not s.inplace:
        args.append("--no-inplace")
    if peer_init:
        args += ["--peer-init", peer_init]
    if s.inject_error:
        args.append("--inject-error")
    return args


def _preflight(o: _Opts) -> None:
    """Fail fast, before any rank starts, when an optional dependency is missing."""
    if o.plot and o.result_file is None and importlib.util.find_spec("matplotlib") is None:
        raise Usage("--plot needs matplotlib: pip install 'acoll[plot]'")
    backend = o.peer
    if backend is None or o.result_file is not None:
        return
    coll = COLLS[o.spec.coll]
    if backend not in coll.backends:
        raise Usage(f"--vs makes no sense with {coll.name}: only {coll.backends[0]} "
                    "measures it")
    if backend == "mpi":
        _preflight_mpi(o)
        return
    if importlib.util.find_spec("torch") is None:
        raise Usage(f"--vs {backend} needs PyTorch: pip install 'acoll[bench]' "
                    "(or pip install torch)")
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise Usage(f"--vs {backend}: this torch build has no torch.distributed")
    if backend == "gloo" and not dist.is_gloo_available():
        raise Usage("--vs gloo: this torch build has no gloo backend")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise Usage("--vs nccl needs CUDA GPUs and a CUDA build of torch; none found")
        if not dist.is_nccl_available():
            raise Usage("--vs nccl: this torch build has no NCCL backend")
        if o.nranks is not None and o.nranks > torch.cuda.device_count():
            raise Usage(f"--vs nccl -N {o.nranks}: only {torch.cuda.device_count()} GPUs")


def _preflight_mpi(o: _Opts) -> None:
    """``--vs mpi``: the sweep is one MPI has, the ranks can be MPI processes (``-N`` and an
    ``mpirun`` on PATH, or a job that mpirun started) and mpi4py loads its MPI library."""
    s = o.spec
    why = mpi_backend.refusal(COLLS[s.coll], s.dtype, ReduceOp.coerce(s.op))
    if why is not None:
        raise Usage(f"--vs mpi: {why}")
    if importlib.util.find_spec("mpi4py") is None:
        raise Usage(f"--vs mpi needs mpi4py, which is not installed: {mpi_backend.INSTALL_HINT}")
    if o.nranks is not None:
        try:
            mpi_backend.find_mpirun()
        except FileNotFoundError as exc:
            raise Usage(str(exc)) from None
    else:
        try:
            source: str | None = ranks_from_env().source
        except InvalidUsage:
            source = None  # one rank: MPI runs as a singleton
        if source is not None and source not in _MPI_LAUNCHERS:
            raise Usage(f"--vs mpi: these ranks were started by {source}, so they are not MPI "
                        "processes; use -N (acoll-perf starts mpirun itself) or start "
                        "acoll-perf with mpirun")
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # loading only; ranks initialise
    try:
        from mpi4py import MPI  # noqa: F401 - loads the MPI library
    except ImportError as exc:
        raise Usage(f"--vs mpi: mpi4py cannot load an MPI library ({exc}): "
                    f"{mpi_backend.INSTALL_HINT}") from None


# --------------------------------------------------------------------------- one rank

def _run_loop(coro: Coroutine[Any, Any, _T], kind: str) -> _T:
    """Run ``coro`` on a fresh uvloop (when asked for or ``auto`` and installed) or asyncio."""
    loop: asyncio.AbstractEventLoop
    if kind != "asyncio" and importlib.util.find_spec("uvloop") is not None:
        import uvloop

        loop = uvloop.new_event_loop()
    elif kind == "uvloop":
        raise Usage("--loop uvloop: uvloop is not installed")
    else:
        loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _timeout_s() -> float:
    try:
        return float(os.environ.get("ACOLL_TIMEOUT") or 300.0)
    except ValueError:
        return 300.0


def _torch_sweep(o: _Opts, rank: int, size: int, local_rank: int, init: str) -> Result:
    """The sweep with torch.distributed (:attr:`_Opts.peer`), rendezvous at ``init``."""
    assert o.peer is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation chatter in the ranks' output
        backend = TorchBackend(o.peer, init, rank, size, local_rank, _timeout_s())
        return asyncio.run(sweep(backend, o.spec))


def _mpi_sweep(o: _Opts) -> tuple[Result, int]:
    """The sweep with MPI (mpi4py's COMM_WORLD); returns the result and this MPI rank."""
    backend = mpi_backend.MpiBackend(deadline=_timeout_s())
    return asyncio.run(sweep(backend, o.spec)), backend.rank


async def _acoll_rank(o: _Opts) -> tuple[Result, LaunchInfo | None, str | None]:
    """Join (or make) the communicator and run the acoll/tcp sweep.

    Returns the result, the launch info (``None`` for a lone rank) and, with ``--vs``, the
    ``tcp://`` address rank 0 chose for torch.distributed.
    """
    try:
        info: LaunchInfo | None = ranks_from_env()
    except InvalidUsage:
        info = None
    cuda = o.device == "cuda"
    if info is None:
        comm = await init_rank(1, get_unique_id(), 0, device=0 if cuda else None)
    else:
        comm = await init_from_env(device="auto" if cuda else None)
    peer_init: str | None = None
    async with comm:
        side = COLLS[o.spec.coll].backends[0]
        if cuda and side == "acoll":
            assert comm.device is not None
            backend = AcollBackend(comm, CupyAllocator(comm.device), register=o.register)
        elif side == "acoll":
            backend = AcollBackend(comm, shared_buffer if o.register else host_buffer,
                                   register=o.register)
        else:
            backend = _ACOLL_SIDE[side](comm)
        res = await sweep(backend, o.spec)
        if o.vs in ("gloo", "nccl") and o.result_file is None:
            host = parse_host_port(info.comm_id)[0] if info is not None else "127.0.0.1"
            port = await backend.broadcast_scalar(_free_port(host) if comm.rank == 0 else 0)
            peer_init = f"tcp://{host}:{int(port)}"
    return res, info, peer_init


def _rank_main(o: _Opts) -> int:
    """One rank of a job: sweep, then hand the result to the driver (or be the driver)."""
    if o.backend == "mpi":  # an MPI process started by -N (through mpirun)
        res, rank = _mpi_sweep(o)
        if rank == 0 and o.result_file:
            res.save(o.result_file)
        return 0
    if o.backend != "acoll":  # a torch rank started by -N
        info = ranks_from_env()
        assert o.peer_init is not None
        res = _torch_sweep(o, info.rank, info.world_size, info.local_rank, o.peer_init)
        if info.rank == 0 and o.result_file:
            res.save(o.result_file)
        return 0
    res, launch, peer_init = _run_loop(_acoll_rank(o), o.loop)
    rank = 0 if launch is None else launch.rank
    if o.result_file is not None:
        if rank == 0:
            res.save(o.result_file)
        return 0
    peer = None
    if o.vs == "mpi":  # these processes are MPI processes (see _preflight_mpi)
        peer = _mpi_sweep(o)[0]
    elif o.vs is not None and peer_init is not None:
        size = 1 if launch is None else launch.world_size
        local = 0 if launch is None else launch.local_rank
        peer = _torch_sweep(o, rank, size, local, peer_init)
    if rank == 0:
        report(res, peer, argv=o.argv, json_path=o.json, plot_path=o.plot)
    return 1 if res.wrong else 0


# --------------------------------------------------------------------------- the driver (-N)

def _mpi_job(o: _Opts, result_file: str) -> int:
    """``-N n --vs mpi``: run the MPI side as ``mpirun -np n`` of this command; its exit code.

    ``ACOLL_PERF_MPIRUN_ARGS`` adds mpirun options (shell words). The job is stopped when it
    prints nothing for ``ACOLL_TIMEOUT`` (+30) seconds, or after ``--timeout``.
    """
    assert o.nranks is not None
    mpirun, flavour = mpi_backend.find_mpirun()
    as_root = os.geteuid() == 0
    extra = shlex.split(os.environ.get("ACOLL_PERF_MPIRUN_ARGS", ""))
    program = [sys.executable, "-m", "acoll.perf", *_rank_args(o, "mpi", result_file, None)]
    cmd = mpi_backend.mpirun_command(mpirun, flavour, o.nranks, program, as_root=as_root,
                                     extra=extra)
    env = mpi_backend.mpirun_env(os.environ, as_root=as_root)
    return mpi_backend.run_mpirun(cmd, env, idle=_timeout_s() + 30.0, total=o.timeout)


def _launch(o: _Opts) -> int:
    """``-N``: run the ranks as local processes (acoll-run's launcher), then report.

    acoll's ranks first, then (``--vs``) torch's, or MPI's through mpirun; each job's rank 0
    leaves its result in a file for this process. With ``--rounds R`` the pair runs R times,
    in alternating order (acoll first in even rounds), and the report gives medians.
    """
    from ..run import main as run_main

    launch = ["-n", str(o.nranks), "--no-prefix"]
    if o.timeout:
        launch += ["--timeout", str(o.timeout)]
    results: dict[str, list[Result]] = {}
    order = ["acoll"] if o.vs is None else ["acoll", o.vs]
    jobs = [b for r in range(o.rounds) for b in (order if r % 2 == 0 else order[::-1])]
    with tempfile.TemporaryDirectory(prefix="acoll-perf-") as tmp:
        for job, backend in enumerate(jobs):
            path = Path(tmp, f"{backend}{job}.json")
            if backend == "mpi":
                rc = _mpi_job(o, str(path))
            else:
                init = None if backend == "acoll" else f"tcp://127.0.0.1:{_free_port()}"
                rc = run_main([*launch, "--", sys.executable, "-m", "acoll.perf",
                               *_rank_args(o, backend, str(path), init)])
            res = Result.load(path)
            if res is None:
                print(f"{PROG}: the {backend} ranks failed (exit code {rc})", file=sys.stderr)
                return rc or 1
            if res.settings.get("nranks") != o.nranks:  # e.g. mpi4py built for another MPI
                print(f"{PROG}: the {backend} job ran as {res.settings.get('nranks')} ranks "
                      f"of one job, not {o.nranks} (is mpi4py built for the MPI of this "
                      "mpirun?)", file=sys.stderr)
                return 1
            results.setdefault(backend, []).append(res)
    mine_rounds = results["acoll"]
    peer_rounds = results.get(o.vs) if o.vs is not None else None
    if o.rounds == 1:
        mine, peer, per_round = mine_rounds[0], peer_rounds[0] if peer_rounds else None, None
    else:
        mine = median_result(mine_rounds)
        peer = median_result(peer_rounds) if peer_rounds else None
        per_round = round_ratios(mine_rounds, peer_rounds) if peer_rounds else None
    report(mine, peer, argv=o.argv, json_path=o.json, plot_path=o.plot, per_round=per_round)
    return 1 if mine.wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``acoll-perf``; return the exit code (0 ok, 1 wrong results or failure, 2 usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        o = _parse(args)
        _preflight(o)
        if o.nranks is not None and o.result_file is None:
            return _launch(o)
        # Timed loops reduce the same buffers again and again, so values overflow to inf
        # by design (as in nccl-tests); correctness is checked on fresh buffers.
        np.seterr(over="ignore", invalid="ignore")
        return _rank_main(o)
    except SystemExit as exc:  # argparse: usage errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except Usage as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (AcollError, OSError) as exc:
        print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
