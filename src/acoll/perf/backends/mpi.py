"""MPI through mpi4py (``--vs mpi``): the same sweep, on host NumPy buffers.

The ranks of the MPI side are MPI processes: ``-N n`` starts them with ``mpirun -np n``
(:func:`mpirun_command`, :func:`run_mpirun`); a job that ``mpirun`` itself started sweeps
acoll and then MPI in the same processes. Timing, sizes and the result check are the
sweep's, so both sides are measured alike (a barrier, then ``-n`` back-to-back ops).

Calls, by collective (``IN_PLACE`` is ``MPI.IN_PLACE``)::

    all_reduce      Allreduce(inp, out, op)          in place: Allreduce(IN_PLACE, out, op)
    broadcast       Bcast(out, root)                 (one buffer)
    reduce          Reduce(inp, out, op, root)       in place: the root passes IN_PLACE
    all_gather      Allgather(inp, out)              in place: Allgather(IN_PLACE, out)
    reduce_scatter  Reduce_scatter_block(inp, out, op)   (no in-place column: MPI's in-place
                    form leaves the result at the start of the buffer, not at block ``rank``)
    all_to_all      Alltoall(inp, out)               in place: Alltoall(IN_PLACE, out)
    sendrecv        Sendrecv(inp, next, out, prev)   in place: Sendrecv_replace(out, next, prev)
    barrier         Barrier()

MPI has no 16-bit float type (neither the standard nor Open MPI 4.1) and no average:
float16 and bfloat16 move as 16-bit integers (exact for collectives that only move data),
and reductions of them, or ``-o avg``, are refused up front (:func:`refusal`) rather than
measured wrongly.
"""

from __future__ import annotations

import faulthandler
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import numpy as np

from ..._dtypes import ReduceOp
from ..colls import Coll
from .base import Backend, Op, OpArgs

__all__ = ["INSTALL_HINT", "MpiBackend", "mpirun_command", "mpirun_flavour", "refusal",
           "run_mpirun"]

#: What to install, for error messages (``make test-mpi`` does both on Debian/Ubuntu).
INSTALL_HINT = ("install Open MPI and mpi4py: apt-get install openmpi-bin libopenmpi-dev, "
                "then pip install 'acoll[mpi]' (make test-mpi does both)")
#: acoll-perf dtype name -> MPI datatype name (16-bit floats move as 16-bit integers).
_TYPES = {"int8": "INT8_T", "uint8": "UINT8_T", "int32": "INT32_T", "uint32": "UINT32_T",
          "int64": "INT64_T", "uint64": "UINT64_T", "float32": "FLOAT", "float64": "DOUBLE",
          "float16": "UINT16_T", "bfloat16": "UINT16_T"}
_NO_MPI_TYPE = ("float16", "bfloat16")
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.PROD: "PROD", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}
#: Exit code of :func:`run_mpirun` when it stopped the job at a deadline (as timeout(1)).
EXIT_TIMEOUT = 124
_GRACE_S = 5.0  # SIGTERM to SIGKILL


def refusal(coll: Coll, dtype: str, op: ReduceOp) -> str | None:
    """Why MPI cannot measure ``coll`` on ``dtype`` with ``op`` (``None``: it can).

    ``dtype`` is an acoll-perf dtype name; ``op`` matters only for reducing collectives.
    """
    if "mpi" not in coll.backends:
        return f"MPI has no {coll.name} to compare with"
    dtype = coll.dtype or dtype
    if dtype not in _TYPES:
        return f"MPI has no {dtype} datatype"
    if not coll.reduces:
        return None
    if dtype in _NO_MPI_TYPE:
        return (f"MPI has no {dtype} datatype to reduce (neither the MPI standard nor "
                f"Open MPI 4.1 defines 16-bit floats); use -d float32, or compare {dtype} "
                "with --vs gloo")
    if op not in _OPS:
        return (f"MPI has no {op.name.lower()} reduction (MPI_SUM/PROD/MAX/MIN only); "
                "use -o sum")
    return None


# --------------------------------------------------------------------------- the ranks

class MpiBackend(Backend):
    """``MPI.COMM_WORLD`` of this process, on host NumPy buffers.

    The constructor initialises MPI (thread level FUNNELED: only this thread calls MPI)
    unless it is already initialised; :meth:`close` finalises it if the constructor did.
    ``deadline``: seconds one size may take (its warm-up, timed loop and check); past it
    the process prints every thread's stack and exits (``faulthandler``, which works while
    the main thread is blocked inside MPI), so that a stuck MPI call ends the job instead
    of hanging it. ``None`` disables that. ``mpi``: the ``mpi4py.MPI`` module to use (tests
    pass a stand-in); by default it is imported.
    """

    def __init__(self, deadline: float | None = None, *, mpi: Any = None) -> None:
        super().__init__()
        binding = "mpi4py"
        if mpi is None:
            import mpi4py

            mpi4py.rc.initialize = False  # MPI_Init_thread below, at the level asked for
            mpi4py.rc.finalize = False
            from mpi4py import MPI

            mpi = MPI

            binding = f"mpi4py {mpi4py.__version__}"
        self.MPI = MPI = mpi
        self._finalize = not MPI.Is_initialized()
        if self._finalize:
            MPI.Init_thread(MPI.THREAD_FUNNELED)
        self.comm = MPI.COMM_WORLD
        self.name = "mpi"
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.deadline = deadline
        library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
        self.info = {"backend": f"{library} ({binding}, host buffers)",
                     "net": "mpi", "loop": "-", "chunk": "-"}

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._finalize and not self.MPI.Is_finalized():
            self.MPI.Finalize()
            self._finalize = False

    def _arm(self) -> None:
        """Restart the deadline of the current size (see the class docstring)."""
        if self.deadline is not None:
            faulthandler.dump_traceback_later(self.deadline, exit=True)

    def _msg(self, arr: Any) -> list[Any]:
        """mpi4py's ``[buffer, datatype]`` for a NumPy view (16-bit floats as integers)."""
        name = arr.dtype.name
        buf = arr.view(np.uint16) if name in _NO_MPI_TYPE else arr
        return [buf, getattr(self.MPI, _TYPES[name])]

    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        self._arm()
        call = self._call(coll, args)
        if call is None:
            return None

        async def run() -> None:
            call()
        return run

    def _call(self, coll: Coll, args: OpArgs) -> Callable[[], object] | None:
        MPI, comm = self.MPI, self.comm
        inp, out, root, inplace = self._msg(args.inp), self._msg(args.out), args.root, \
            args.inplace
        op = getattr(MPI, _OPS[args.op]) if coll.reduces and args.op in _OPS else MPI.OP_NULL
        at_root = self.rank == root
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        send = MPI.IN_PLACE if inplace else inp
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: comm.Allreduce(send, out, op),
            "broadcast": lambda: comm.Bcast(out, root),
            # in place, only the root passes IN_PLACE; the others' input is the buffer
            "reduce": lambda: comm.Reduce(send if at_root else inp, out, op, root),
            "all_gather": lambda: comm.Allgather(send, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(inp, out, op),
            "all_to_all": lambda: comm.Alltoall(send, out),
            "sendrecv": ((lambda: comm.Sendrecv_replace(out, nxt, 0, prv, 0)) if inplace
                         else (lambda: comm.Sendrecv(inp, nxt, 0, out, prv, 0))),
            "barrier": comm.Barrier,
        }
        if coll.name == "reduce_scatter" and inplace:
            return None  # MPI's in-place layout differs (see the module docstring)
        return calls.get(coll.name)

    def unsupported(self, exc: BaseException) -> bool:
        # MPI checks types and ops before moving anything, alike on every rank.
        MPI = self.MPI
        return isinstance(exc, MPI.Exception) and exc.Get_error_class() in (
            MPI.ERR_TYPE, MPI.ERR_OP)

    async def barrier(self) -> None:
        self.comm.Barrier()

    async def all_reduce_scalar(self, value: float, op: ReduceOp) -> float:
        arr = np.array([value], np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, arr, getattr(self.MPI, _OPS[op]))
        return float(arr[0])

    async def broadcast_scalar(self, value: float) -> float:
        arr = np.array([value], np.float64)
        self.comm.Bcast(arr, 0)
        return float(arr[0])


# --------------------------------------------------------------------------- mpirun

def mpirun_flavour(version_text: str) -> str:
    """``openmpi``, ``mpich`` (Hydra: MPICH, Intel MPI) or ``other``, from ``--version``."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return "openmpi"
    if "HYDRA" in version_text or "Hydra" in version_text:
        return "mpich"
    return "other"


def find_mpirun() -> tuple[str, str]:
    """The ``mpirun`` (or ``mpiexec``) on ``PATH`` and its flavour.

    Raises:
        FileNotFoundError: neither is installed; the message says what to install.
    """
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            proc = subprocess.run([path, "--version"], capture_output=True, text=True,
                                  timeout=30, stdin=subprocess.DEVNULL, check=False)
            text = proc.stdout + proc.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        return path, mpirun_flavour(text)
    raise FileNotFoundError(f"--vs mpi -N needs mpirun, which is not on PATH: {INSTALL_HINT}")


def mpirun_command(mpirun: str, flavour: str, nprocs: int, program: Sequence[str], *,
                   as_root: bool, extra: Sequence[str] = ()) -> list[str]:
    """The command that runs ``program`` as ``nprocs`` MPI processes on this host.

    Open MPI gets ``--oversubscribe`` (more ranks than cores is allowed, as with acoll-run;
    Open MPI then stops binding ranks to cores) and, for root, ``--allow-run-as-root``
    (:func:`mpirun_env` sets the variables too). ``extra`` (``ACOLL_PERF_MPIRUN_ARGS``)
    goes before the program, e.g. ``--bind-to core`` or ``--mca btl self,vader``.
    """
    cmd = [mpirun, "-np", str(nprocs)]
    if flavour == "openmpi":
        cmd.append("--oversubscribe")
        if as_root:
            cmd.append("--allow-run-as-root")
    return [*cmd, *extra, *program]


def mpirun_env(base: Mapping[str, str], *, as_root: bool) -> dict[str, str]:
    """``base`` plus Open MPI's permission to run as root when ``as_root``."""
    env = dict(base)
    if as_root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc``'s process group: SIGTERM (mpirun stops its ranks), SIGKILL after a grace
    period to whatever is left, then reap ``proc``."""
    for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, _GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def run_mpirun(cmd: Sequence[str], env: Mapping[str, str], *, idle: float,
               total: float | None = None, out: IO[str] | None = None,
               err: IO[str] | None = None) -> int:
    """Run ``cmd`` (an ``mpirun`` line), copying its stdout to ``out``; return its exit code.

    Deadlines: the job is stopped (its whole process group: SIGTERM, then SIGKILL) when it
    prints nothing for ``idle`` seconds or runs longer than ``total``; the return code is
    then :data:`EXIT_TIMEOUT` and ``err`` says which deadline passed. Its stdin is empty; its
    stderr is this process's. Ctrl-C stops the job the same way and re-raises.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            env=dict(env), start_new_session=True)
    assert proc.stdout is not None
    fd, pending = proc.stdout.fileno(), b""
    last = start
    try:
        while True:
            now = time.monotonic()
            limit = last + idle if total is None else min(last + idle, start + total)
            if now >= limit:
                what = (f"ran longer than {total:g} s" if total is not None
                        and limit == start + total else f"printed nothing for {idle:g} s")
                err.write(f"acoll-perf: the MPI job {what}; stopping it\n")
                err.flush()
                _kill_group(proc)
                return EXIT_TIMEOUT
            ready, _, _ = select.select([fd], [], [], limit - now)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            last = time.monotonic()
            pending += chunk
            lines, _, pending = pending.rpartition(b"\n")
            if lines:
                out.write(lines.decode(errors="replace") + "\n")
                out.flush()
        if pending:
            out.write(pending.decode(errors="replace"))
            out.flush()
        try:
            return proc.wait(timeout=max(0.1, (start + total - time.monotonic())
                                         if total is not None else idle))
        except subprocess.TimeoutExpired:  # stdout closed, process still there
            _kill_group(proc)
            return EXIT_TIMEOUT
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        proc.stdout.close()
