"""Rank discovery from launcher environment variables (``acoll.init_from_env``).

:func:`ranks_from_env` reads the variables of the first launcher found, in this order:

===========  ==================================================================================
source       variables
===========  ==================================================================================
acoll-run    ``ACOLL_RANK``, ``ACOLL_WORLD_SIZE``, ``ACOLL_LOCAL_RANK``, ``ACOLL_LOCAL_SIZE``
torchrun     ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
openmpi      ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
             ``OMPI_COMM_WORLD_LOCAL_SIZE``
pmi          ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``/``PMI_LOCAL_RANK``,
             ``MPI_LOCALNRANKS``/``PMI_LOCAL_SIZE`` (MPICH, Intel MPI, ``srun --mpi=pmi2``)
slurm        ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE`` or
             ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` with ``SLURM_NODEID``
===========  ==================================================================================

A source is chosen by its rank variable being set (non-empty). MPI comes before Slurm because
``mpirun`` inside a Slurm allocation leaves the allocation's (wrong) ``SLURM_PROCID`` in every
rank's environment, while a direct ``srun`` launch gives both consistently.

The root's address (``comm_id``), for every source: ``ACOLL_COMM_ID`` if set; else
``MASTER_ADDR`` with port ``MASTER_PORT + 1`` (``MASTER_PORT`` itself is taken by
torch.distributed's store: torchrun's agent listens there); else, under Slurm only, the first
host of ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``/``SLURM_NODELIST`` (where task 0 runs
with Slurm's block and cyclic distributions) and a port derived from ``SLURM_JOB_ID`` and
``SLURM_STEP_ID``; else, under Open MPI only and only when every rank is on one host
(``OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE``), ``127.0.0.1`` and a port derived
from the job's ``PMIX_NAMESPACE`` (or ``OMPI_MCA_ess_base_jobid``), the same on every rank
and different for concurrent jobs. Open MPI does not say on which host rank 0 runs, so
across hosts (and under PMI, which names no job either) the address must be passed::

    export ACOLL_COMM_ID=<host of rank 0>:29400
    export ACOLL_COMM_SECRET=$(python -c 'import os; print(os.urandom(32).hex())')
    mpirun -x ACOLL_COMM_ID -x ACOLL_COMM_SECRET -np 4 python prog.py

(``-x NAME`` forwards the variable's value from mpirun's environment, so the secret never
appears on a command line; ``MASTER_ADDR``/``MASTER_PORT`` work too.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._config import get_logger
from ._offloop import in_thread
from ._uid import UniqueId, parse_host_port
from .errors import InvalidUsage

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["LaunchInfo", "expand_nodelist", "init_from_env", "ompi_port", "ranks_from_env",
           "slurm_port", "tasks_per_node"]

#: Offset from ``MASTER_PORT`` to the port acoll's root uses.
MASTER_PORT_OFFSET = 1
#: Derived Slurm ports lie in ``[SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN)``.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000
#: Derived single-host Open MPI ports lie in ``[OMPI_PORT_BASE, OMPI_PORT_BASE + SPAN)``.
OMPI_PORT_BASE = 22000  # below the kernel's ephemeral range (32768+): never taken by a
#: connection's local port or a bind-to-any-port listener
OMPI_PORT_SPAN = 10000

_log = get_logger("ENV")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process stands in the job, as its launcher described it.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks in the job (>= 1).
        local_rank: rank among the ranks on this host; equals ``rank`` when the launcher
            does not say (a single-host assumption).
        local_size: number of ranks on this host, ``None`` when the launcher does not say.
        comm_id: the root's address, ``host:port`` or ``[v6addr]:port``.
        source: the launcher: ``"acoll-run"``, ``"torchrun"``, ``"openmpi"``, ``"pmi"`` or
            ``"slurm"``.
        comm_id_from: the variables ``comm_id`` came from (for messages).
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int | None
    comm_id: str
    source: str
    comm_id_from: str = ""


@dataclass(frozen=True)
class _Source:
    name: str
    rank: str
    size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]


_SOURCES = (
    _Source("acoll-run", "ACOLL_RANK", ("ACOLL_WORLD_SIZE",), ("ACOLL_LOCAL_RANK",),
            ("ACOLL_LOCAL_SIZE",)),
    _Source("torchrun", "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    _Source("openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",),
            ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    _Source("pmi", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
            ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    _Source("slurm", "SLURM_PROCID", ("SLURM_NTASKS", "SLURM_NPROCS"), ("SLURM_LOCALID",),
            ("SLURM_NTASKS_PER_NODE",)),
)


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = _get(env, name)
        if value is not None:
            return name, value
    return None


def _int(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidUsage(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise InvalidUsage(f"{name}={text!r} must be >= {minimum}")
    return value


# --- Slurm helpers -------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets; raise ValueError on unbalanced brackets."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unmatched ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unmatched '['")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str) -> list[str]:
    """``01-03,07`` -> ``["01", "02", "03", "07"]`` (zero padding from the lower bound)."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"bad range {item!r}")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {item!r}")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_one(pattern: str) -> Iterator[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        yield pattern
        return
    close_at = pattern.index("]", open_at)
    head, body, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    values = _expand_ranges(body)
    for value in values:
        for rest in _expand_one(tail):
            yield head + value + rest


def iter_nodelist(text: str) -> Iterator[str]:
    """Yield the host names of a Slurm host list, in order, lazily.

    Understands the compressed form: ``node[01-03,07],gpu5`` ->
    ``node01 node02 node03 node07 gpu5``; several bracket groups in one name expand as a
    product (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``).

    Raises:
        ValueError: the text is not a host list (unbalanced brackets, bad ranges, empty names).
    """
    text = text.strip()
    if not text:
        raise ValueError("empty host list")
    parts = _split_top(text)
    for part in parts:
        part = part.strip()
        if not part or part.startswith("["):
            raise ValueError(f"empty host name in {text!r}")
        # Validate the whole part before yielding anything from it.
        for m in re.finditer(r"\[([^\]]*)\]", part):
            _expand_ranges(m.group(1))
        yield from _expand_one(part)


def expand_nodelist(text: str) -> list[str]:
    """All host names of a Slurm host list (see :func:`iter_nodelist`)."""
    return list(iter_nodelist(text))


def tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form, ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: the text is not of that form.
    """
    out: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"bad tasks-per-node item {item!r}")
        out.extend([int(m.group(1))] * (int(m.group(2)) if m.group(2) else 1))
    return out


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The root port derived for a Slurm job step (the same on every task of the step).

    ``SLURM_PORT_BASE + (job_id + 1009 * step_id) % SLURM_PORT_SPAN``; concurrent steps of
    one job get different ports.
    """
    return SLURM_PORT_BASE + (job_id + 1009 * step_id) % SLURM_PORT_SPAN


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    found = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    node = _get(env, "SLURM_NODEID")
    if found is None or node is None:
        return None
    name, text = found
    try:
        counts = tasks_per_node(text)
    except ValueError as exc:
        raise InvalidUsage(f"{name}={text!r} is invalid: {exc}") from None
    index = _int("SLURM_NODEID", node, 0)
    if index >= len(counts):
        raise InvalidUsage(f"SLURM_NODEID={node!r} is out of range for {name}={text!r}")
    return counts[index]


def _slurm_comm_id(env: Mapping[str, str]) -> str | None:
    found = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    job = _get(env, "SLURM_JOB_ID") or _get(env, "SLURM_JOBID")
    if found is None or job is None:
        return None
    name, text = found
    try:
        host = next(iter_nodelist(text))
    except ValueError as exc:
        raise InvalidUsage(f"{name}={text!r} is not a Slurm host list: {exc}") from None
    job_id = _int("SLURM_JOB_ID", job, 0)
    step_text = _get(env, "SLURM_STEP_ID") or ""
    # The batch and interactive steps carry huge sentinel ids; treat them as step 0.
    step = int(step_text) if step_text.isdigit() and int(step_text) < 0xFFFF0000 else 0
    return _format_address(host, slurm_port(job_id, step))


# --- Open MPI helpers ----------------------------------------------------------------------

def ompi_port(job: str) -> int:
    """The root port derived from an Open MPI job's name (same on every rank of the job)."""
    digest = hashlib.blake2b(job.encode(), digest_size=4).digest()
    return OMPI_PORT_BASE + int.from_bytes(digest, "big") % OMPI_PORT_SPAN


def _ompi_comm_id(env: Mapping[str, str], world_size: int,
                  local_size: int | None) -> str | None:
    """``127.0.0.1:<port>`` for a single-host Open MPI job, else ``None``."""
    job = _get(env, "PMIX_NAMESPACE") or _get(env, "OMPI_MCA_ess_base_jobid")
    if job is None or local_size != world_size:
        return None
    return _format_address("127.0.0.1", ompi_port(job))


_MPI_HINT = ("pass the root's address to every rank, e.g. `export ACOLL_COMM_ID=<host of "
             "rank 0>:29400` and `mpirun -x ACOLL_COMM_ID -x ACOLL_COMM_SECRET ...` "
             "(or MASTER_ADDR/MASTER_PORT)")


# --- the root's address --------------------------------------------------------------------

def _format_address(host: str, port: int) -> str:
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _comm_id(env: Mapping[str, str], source: str, world_size: int,
             local_size: int | None) -> tuple[str, str]:
    """Return ``(comm_id, where)``; ``where`` names the variables it came from."""
    text = _get(env, "ACOLL_COMM_ID")
    if text is not None:
        try:
            parse_host_port(text)
        except InvalidUsage as exc:
            raise InvalidUsage(f"ACOLL_COMM_ID is invalid: {exc}") from None
        return text, "ACOLL_COMM_ID"
    addr, port_text = _get(env, "MASTER_ADDR"), _get(env, "MASTER_PORT")
    if addr is not None or port_text is not None:
        if addr is None or port_text is None:
            missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
            raise InvalidUsage(f"MASTER_ADDR and MASTER_PORT go together; {missing} is unset")
        port = _int("MASTER_PORT", port_text, 1)
        if port > 65535:
            raise InvalidUsage(f"MASTER_PORT={port_text!r} is out of range 1..65535")
        port = port + MASTER_PORT_OFFSET if port + MASTER_PORT_OFFSET <= 65535 \
            else port - MASTER_PORT_OFFSET
        return _format_address(addr, port), "MASTER_ADDR/MASTER_PORT"
    if source == "slurm":
        derived = _slurm_comm_id(env)
        if derived is not None:
            return derived, "SLURM_*NODELIST/SLURM_JOB_ID"
        raise InvalidUsage(
            "slurm: no root address: set ACOLL_COMM_ID=host:port or MASTER_ADDR/MASTER_PORT, "
            "or run inside a job step (SLURM_JOB_NODELIST and SLURM_JOB_ID)")
    if source == "openmpi":
        derived = _ompi_comm_id(env, world_size, local_size)
        if derived is not None:
            return derived, "single host: PMIX_NAMESPACE/OMPI_MCA_ess_base_jobid"
        why = ("the ranks span several hosts (OMPI_COMM_WORLD_LOCAL_SIZE < "
               "OMPI_COMM_WORLD_SIZE) and Open MPI does not say where rank 0 runs"
               if local_size is not None and local_size < world_size else
               "it can only be derived for a single-host job with OMPI_COMM_WORLD_LOCAL_SIZE "
               "and PMIX_NAMESPACE set")
        raise InvalidUsage(f"openmpi: no root address: ACOLL_COMM_ID and "
                           f"MASTER_ADDR/MASTER_PORT are unset, and {why}; {_MPI_HINT}")
    if source == "pmi":
        raise InvalidUsage("pmi: no root address: ACOLL_COMM_ID and MASTER_ADDR/MASTER_PORT "
                           "are unset; export ACOLL_COMM_ID=<host of rank 0>:29400 (and "
                           "ACOLL_COMM_SECRET) before mpiexec, which forwards the environment "
                           "(Hydra: -genvlist ACOLL_COMM_ID,ACOLL_COMM_SECRET)")
    raise InvalidUsage(
        f"{source}: no root address: set ACOLL_COMM_ID=host:port or MASTER_ADDR/MASTER_PORT")


# --- public --------------------------------------------------------------------------------

def ranks_from_env(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Describe this process's place in the job from its launcher's variables.

    Pure: reads ``environ`` (default ``os.environ``) and nothing else. Empty variables count
    as unset.

    Raises:
        InvalidUsage: no launcher's variables are set, or they are missing, not integers,
            contradictory (``rank >= world_size``, ``local_rank >= local_size``...) or give no
            root address; the message names the variables.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    src = next((s for s in _SOURCES if _get(env, s.rank) is not None), None)
    if src is None:
        names = ", ".join(s.rank for s in _SOURCES)
        raise InvalidUsage(f"no launcher found: none of {names} is set "
                           "(start the job with acoll-run, torchrun, srun or mpirun)")
    rank = _int(src.rank, env[src.rank].strip(), 0)
    size_found = _first(env, src.size)
    if size_found is None:
        raise InvalidUsage(f"{src.name}: {src.rank} is set but {src.size[0]} is not")
    size_name, size_text = size_found
    world_size = _int(size_name, size_text, 1)
    if rank >= world_size:
        raise InvalidUsage(f"{src.rank}={rank} must be < {size_name}={world_size}")

    local_found = _first(env, src.local_rank)
    local_rank = rank if local_found is None else _int(*local_found, 0)
    lsize_found = _first(env, src.local_size)
    local_size = None if lsize_found is None else _int(*lsize_found, 1)
    lsize_name = lsize_found[0] if lsize_found else ""
    if local_size is None and src.name == "slurm":
        local_size = _slurm_local_size(env)
        lsize_name = "SLURM_TASKS_PER_NODE"
    local_name = local_found[0] if local_found else src.rank
    if local_rank >= world_size:
        raise InvalidUsage(f"{local_name}={local_rank} must be < {size_name}={world_size}")
    if local_size is not None:
        if local_size > world_size:
            raise InvalidUsage(f"{lsize_name}={local_size} must be <= {size_name}={world_size}")
        if local_rank >= local_size:
            raise InvalidUsage(f"{local_name}={local_rank} must be < {lsize_name}={local_size}")

    comm_id, where = _comm_id(env, src.name, world_size, local_size)
    return LaunchInfo(rank, world_size, local_rank, local_size, comm_id, src.name, where)


async def init_from_env(*, device: int | str | None = None, **init_kw: Any) -> Communicator:
    """Join the job described by the launcher's variables (see :func:`ranks_from_env`).

    Equivalent to ``await acoll.init_rank(world_size, UniqueId.from_address(comm_id), rank,
    device=device, **init_kw)``; rank 0 hosts the root at ``comm_id``. ``device="auto"``
    binds the rank to GPU ``local_rank % (number of visible GPUs)``; ``None`` (default)
    keeps it host-only.

    Raises:
        InvalidUsage: as :func:`ranks_from_env`, the root's host name does not resolve,
            or ``device="auto"`` finds no GPU.
        Whatever ``init_rank`` raises.
    """
    from ._communicator import init_rank

    info = ranks_from_env()
    if device == "auto":
        device = info.local_rank % _gpu_count()
    elif isinstance(device, str):
        raise InvalidUsage(f"device must be a CUDA device number, 'auto' or None, got "
                           f"{device!r}")
    _log.info("init_from_env: %s rank %d of %d (local %d of %s), root %s (from %s)",
              info.source, info.rank, info.world_size, info.local_rank,
              info.local_size if info.local_size is not None else "?", info.comm_id,
              info.comm_id_from)
    # from_address may resolve a host name: keep the blocking lookup off the loop.
    uid = await in_thread(functools.partial(UniqueId.from_address, info.comm_id))
    if device is not None:
        init_kw["device"] = device
    return await init_rank(info.world_size, uid, info.rank, **init_kw)


def _gpu_count() -> int:
    """Visible CUDA devices (CuPy); InvalidUsage if there are none."""
    from ._cuda import import_cupy

    cp = import_cupy()
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver
        raise InvalidUsage(f"device='auto': no usable CUDA device ({exc})") from None
    if count < 1:
        raise InvalidUsage("device='auto': no CUDA device is visible")
    return count
