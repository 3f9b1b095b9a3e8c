"""``acoll-perf``: nccl-tests-style bandwidth and latency sweeps (also ``python -m acoll.perf``).

Usage::

    acoll-perf all_reduce -N 4 -b 8 -e 256M -f 2 -n 20 -w 5 -d float32 -o sum [--vs gloo]

Collectives: ``all_reduce broadcast reduce all_gather reduce_scatter all_to_all sendrecv
barrier``, and ``tcp``: the raw TCP ceiling (every rank sends SIZE bytes to its ring successor
and receives SIZE bytes from its predecessor over plain blocking sockets, full duplex like one
ring step), reported as busbw so it compares with 2-rank all_reduce busbw.

Semantics follow nccl-tests:

* ``-b/-e`` are bytes of the largest buffer one op touches: for all_gather the gathered
  output, for reduce_scatter the full input, for all_to_all the whole send buffer; ``count``
  is the op's count argument (per-rank block for all_gather/reduce_scatter/all_to_all).
* time: a barrier, then ``-n`` back-to-back ops, averaged; combined over ranks (``-a``:
  max by default). ``-w`` warm-up ops precede every size.
* ``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests' PERFORMANCE.md factors:
  all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; the rest 1.
* ``#wrong``: after the timed loop the op runs once more on freshly filled buffers (values
  exact in the dtype, depending on rank and index) and the output is compared with a NumPy
  reference; the count of mismatching elements is summed over ranks.
* out-of-place and in-place columns (``--no-inplace`` drops the latter). acoll's broadcast is
  in place only, so its out-of-place column broadcasts into a separate buffer. Modes a
  backend refuses (e.g. torch's all_to_all_single in place) print ``N/A``.

Ranks: ``-N n`` starts n local ranks through acoll-run's launcher; otherwise a launcher's
variables (acoll-run, torchrun, Slurm, MPI: :func:`acoll.init_from_env`), else one rank.
``--vs gloo|nccl`` repeats the sweep with ``torch.distributed`` in separate processes (with
``-N``) and prints a comparison; torch's out-of-place all_reduce/reduce is ``copy_`` plus
the in-place op, so ratios use in-place results where both sides have them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import math
import os
import platform
import queue
import shlex
import socket
import sys
import tempfile
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._config import parse_size
from ._dtypes import DTYPE_NAMES, ReduceOp, parse_dtype
from .errors import AcollError, InvalidUsage

__all__ = ["COLLECTIVES", "bus_factor", "main", "sweep_sizes"]

_PROG = "acoll-perf"
_CHUNK = 1 << 20  # elements per step when filling and checking buffers
_REDUCING = ("all_reduce", "reduce", "reduce_scatter")
_ROOTED = ("broadcast", "reduce")
#: The collectives ``acoll-perf`` measures, in the order ``--help`` lists them.
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
               "all_to_all", "sendrecv", "barrier", "tcp")
_AVERAGE = {0: "rank0", 1: "avg", 2: "min", 3: "max"}
_T = TypeVar("_T")
_BF16 = np.dtype(ml_dtypes.bfloat16)


class _Usage(Exception):
    """A command-line or environment problem: exit 2 with the message."""


# --------------------------------------------------------------------------- size arithmetic

def bus_factor(coll: str, nranks: int) -> float:
    """nccl-tests' busbw/algbw factor for ``coll`` on ``nranks`` ranks."""
    n = nranks
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _counts(coll: str, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int, int]:
    """``(send, recv, param)`` element counts for a ``nbytes`` test (nccl-tests' rules)."""
    count = nbytes // itemsize
    per = count // nranks
    if coll == "barrier":
        return 0, 0, 0
    if coll == "all_gather":
        return per, per * nranks, per
    if coll == "reduce_scatter":
        return per * nranks, per, per
    if coll == "all_to_all":
        return per * nranks, per * nranks, per
    return count, count, count


def sweep_sizes(minbytes: int, maxbytes: int, factor: float, step: int = 0) -> list[int]:
    """The sizes of a sweep: ``minbytes`` growing by ``step`` bytes (or ``factor``)."""
    if minbytes < 0 or maxbytes < minbytes:
        raise _Usage(f"bad size range: -b {minbytes} -e {maxbytes}")
    if step <= 0 and factor <= 1:
        raise _Usage(f"-f must be > 1 (got {factor:g}) unless -i gives a step")
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = size + step if step > 0 else int(size * factor)
        size = max(nxt, size + 1)
    return sizes


# --------------------------------------------------------------------------- data and check

def _pattern(coll: str, op: ReduceOp) -> str:
    if coll in _REDUCING:
        return "prod" if op == ReduceOp.PROD else "sum"
    return "data"


def _values(rank: int | npt.NDArray[np.int64], idx: npt.NDArray[np.int64], pattern: str,
            dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Input values of ``rank`` at indices ``idx``: small integers, exact in every dtype.

    ``sum`` keeps |v| <= 4 (sums of up to 31 ranks fit int8 and bfloat16 exactly); ``prod``
    gives 1 or 2; ``data`` (moved, not reduced) spans 200 values.
    """
    signed = dtype.kind in "if" or dtype == _BF16
    if pattern == "prod":
        v = 1 + (((idx * 7 + rank * 3 + (idx >> 3)) % 5) == 0).astype(np.int64)
    elif pattern == "sum":
        v = (idx * 7 + rank * 13 + (idx >> 5)) % 9 - (4 if signed else 0)
    else:
        v = (idx * 7 + rank * 131 + (idx >> 8)) % 200 - (100 if signed else 0)
    return np.asarray(v.astype(dtype))


def _fill(arr: npt.NDArray[Any], rank: int, pattern: str) -> None:
    """Fill ``arr`` with ``rank``'s input values."""
    for start in range(0, arr.size, _CHUNK):
        stop = min(arr.size, start + _CHUNK)
        arr[start:stop] = _values(rank, np.arange(start, stop, dtype=np.int64), pattern,
                                  arr.dtype)


def _sentinel(arr: npt.NDArray[Any]) -> None:
    """Overwrite ``arr`` with values no correct result holds here (NaN, or the dtype's max)."""
    if arr.dtype.kind == "f" or arr.dtype == _BF16:
        arr.fill(np.nan)
    else:
        arr.fill(np.iinfo(arr.dtype).max)


def _reference(parts: Sequence[npt.NDArray[Any]], op: ReduceOp,
               dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """The reduction of ``parts`` (float64 for float dtypes, the dtype's wrap-around for ints)."""
    n = len(parts)
    floating = dtype.kind not in "iu"
    if op == ReduceOp.AVG:
        acc = np.sum([p.astype(np.float64 if floating else np.int64) for p in parts], axis=0)
        if floating:
            return np.asarray(acc / n, np.float64)
        q = np.abs(acc) // n
        return np.asarray((np.sign(acc) * q).astype(dtype))
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum,
             ReduceOp.MIN: np.minimum}[op]
    out = parts[0].astype(np.float64 if floating else dtype)
    for p in parts[1:]:
        ufunc(out, p.astype(out.dtype), out=out)
    return out


def _expected(coll: str, j: npt.NDArray[np.int64], *, rank: int, nranks: int, root: int,
              per: int, op: ReduceOp, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """What output element ``j`` of ``rank`` must hold after ``coll``."""
    pattern = _pattern(coll, op)
    if coll in ("all_reduce", "reduce"):
        return _reference([_values(r, j, pattern, dtype) for r in range(nranks)], op, dtype)
    if coll == "reduce_scatter":
        src = rank * per + j
        return _reference([_values(r, src, pattern, dtype) for r in range(nranks)], op, dtype)
    if coll == "broadcast":
        return _values(root, j, pattern, dtype)
    if coll == "all_gather":
        return _values(j // max(per, 1), j % max(per, 1), pattern, dtype)
    if coll == "all_to_all":
        return _values(j // max(per, 1), rank * per + j % max(per, 1), pattern, dtype)
    # sendrecv and tcp: the ring predecessor's data
    return _values((rank - 1) % nranks, j, pattern, dtype)


def count_wrong(got: npt.NDArray[Any], expected: npt.NDArray[Any], *,
                approx: bool = False) -> int:
    """Elements of ``got`` that differ from ``expected``.

    Exact, except that ``approx`` allows floats one rounding (AVG divides).
    """
    if got.dtype.kind in "iu":
        return int(np.count_nonzero(got != expected))
    g = got.astype(np.float64)
    if not approx:  # round the reference to the dtype first (overflow to inf matches)
        e = expected.astype(got.dtype).astype(np.float64)
        return int(g.size - np.count_nonzero(g == e))
    e = expected.astype(np.float64)
    eps = 2.0 ** -7 if got.dtype == _BF16 else float(np.finfo(got.dtype).eps)
    with np.errstate(invalid="ignore"):
        ok = (np.abs(g - e) <= eps * np.abs(e)) | (g == e)
    return int(ok.size - np.count_nonzero(ok))


def _check(coll: str, out: npt.NDArray[Any], *, rank: int, nranks: int, root: int, per: int,
           op: ReduceOp) -> int:
    if coll == "reduce" and rank != root:
        return 0
    wrong = 0
    for start in range(0, out.size, _CHUNK):
        stop = min(out.size, start + _CHUNK)
        j = np.arange(start, stop, dtype=np.int64)
        exp = _expected(coll, j, rank=rank, nranks=nranks, root=root, per=per, op=op,
                        dtype=out.dtype)
        wrong += count_wrong(out[start:stop], exp, approx=op == ReduceOp.AVG)
    return wrong


# --------------------------------------------------------------------------- backends

@dataclass
class _Buf:
    """One buffer: its host array (filled and checked) and the backend's own object."""

    host: npt.NDArray[Any]
    obj: Any
    view: Callable[[int, int], Any]  # the backend object for elements [start, start + count)
    upload: Callable[[], None] = lambda: None
    download: Callable[[], None] = lambda: None


_Op = Callable[[], Awaitable[None]]


class _Runner(ABC):
    """What a sweep needs from a backend: buffers, ops, barrier and a scalar all-reduce."""

    name = "?"
    rank = 0
    size = 1
    info: dict[str, str]

    def alloc(self, count: int, dtype: np.dtype[Any]) -> _Buf:
        arr = np.empty(count, dtype)
        return _Buf(arr, arr, lambda start, n: arr[start:start + n])

    @abstractmethod
    def make_op(self, coll: str, inplace: bool, inp: Any, out: Any, op: ReduceOp,
                root: int) -> _Op | None:
        """The awaitable that runs ``coll`` once, or ``None`` if the mode is unsupported."""

    def unsupported(self, exc: BaseException) -> bool:
        """Whether ``exc`` (from an op's first call) means "mode not supported"."""
        return False

    @abstractmethod
    async def barrier(self) -> None:
        """Return once every rank got here."""

    @abstractmethod
    async def combine(self, value: float, how: str) -> float:
        """``value`` combined over ranks: ``max``, ``min``, ``sum``, ``avg`` or ``rank0``."""

    async def sync(self) -> None:  # noqa: B027 - optional hook, nothing to wait for on host
        """Wait until issued device work is done (GPU backends)."""


class _AcollRunner(_Runner):
    def __init__(self, comm: Any) -> None:
        from . import __version__

        self.comm = comm
        self.name = "acoll"
        self.rank, self.size = comm.rank, comm.size
        transport = getattr(comm, "_transport", None)
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        self.info = {
            "backend": f"acoll {__version__}",
            "net": str(getattr(transport, "name", "?")) if self.size > 1 else "none",
            "loop": "uvloop" if loop == "uvloop" else "asyncio",
            "chunk": _human(int(getattr(comm, "chunk_bytes", 0))),
        }

    def make_op(self, coll: str, inplace: bool, inp: Any, out: Any, op: ReduceOp,
                root: int) -> _Op | None:
        c = self.comm
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops: dict[str, Callable[[], Awaitable[Any]]] = {
            "all_reduce": (lambda: c.all_reduce(inp, None, op)) if inplace
            else (lambda: c.all_reduce(inp, out, op)),
            "broadcast": lambda: c.broadcast(out, root),
            "reduce": (lambda: c.reduce(inp, None, op, root)) if inplace
            else (lambda: c.reduce(inp, out, op, root)),
            "all_gather": lambda: c.all_gather(inp, out),
            "reduce_scatter": lambda: c.reduce_scatter(inp, out, op),
            "all_to_all": (lambda: c.all_to_all(inp, None)) if inplace
            else (lambda: c.all_to_all(inp, out)),
            "barrier": c.barrier,
        }
        if coll == "sendrecv":
            if self.size < 2:
                return None

            async def sendrecv() -> None:
                async with c.group():
                    await c.send(inp, nxt)
                    await c.recv(out, prv)
            return sendrecv
        call = ops[coll]

        async def run() -> None:
            await call()
        return run

    def unsupported(self, exc: BaseException) -> bool:
        # Refused before any message moved: local, the same on every rank, comm still usable.
        return isinstance(exc, InvalidUsage) and self.comm.error is None

    async def barrier(self) -> None:
        await self.comm.barrier()

    async def combine(self, value: float, how: str) -> float:
        arr = np.array([value], np.float64)
        if self.size == 1:
            return value
        if how == "rank0":
            await self.comm.broadcast(arr, 0)
        else:
            red = {"max": ReduceOp.MAX, "min": ReduceOp.MIN}.get(how, ReduceOp.SUM)
            await self.comm.all_reduce(arr, None, red)
            if how == "avg":
                arr /= self.size
        return float(arr[0])


class _TcpRing:
    """Raw ring exchange: send to the successor (a thread) while receiving from the predecessor."""

    def __init__(self, to_next: socket.socket, from_prev: socket.socket) -> None:
        self.to_next, self.from_prev = to_next, from_prev
        self._jobs: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._sender, name="acoll-perf-tcp",
                                        daemon=True)
        self._thread.start()

    def _sender(self) -> None:
        while True:
            data = self._jobs.get()
            if data is None:
                return
            try:
                self.to_next.sendall(data)
                self._done.put(None)
            except BaseException as exc:  # handed to the caller
                self._done.put(exc)

    def exchange(self, send: npt.NDArray[Any], recv: npt.NDArray[Any]) -> None:
        """Send ``send`` and receive ``recv.nbytes`` bytes into ``recv``, concurrently."""
        self._jobs.put(send.view(np.uint8).data)
        view = recv.view(np.uint8).data
        got, total = 0, len(view)
        while got < total:
            n = self.from_prev.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("tcp: the predecessor closed the connection")
            got += n
        err = self._done.get()
        if err is not None:
            raise err

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.to_next.close()
        self.from_prev.close()


class _TcpRunner(_AcollRunner):
    """acoll for set-up, barriers and timing; plain blocking sockets for the data."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self.name = "tcp"
        self.info = {"backend": "raw TCP (blocking sockets, sender thread)",
                     "net": "tcp", "loop": self.info["loop"], "chunk": "-"}
        self.ring: _TcpRing | None = None

    async def connect(self, timeout: float) -> None:
        from ._net.interfaces import find_interfaces

        iface = find_interfaces()[0]
        lsock = socket.socket(iface.family, socket.SOCK_STREAM)
        try:
            lsock.bind(iface.sockaddr(0))
            lsock.listen(4)
            host, port = lsock.getsockname()[:2]
            mine = np.zeros(64, np.uint8)
            raw = f"{host}|{port}|{iface.scope_id}".encode()
            mine[:len(raw)] = np.frombuffer(raw, np.uint8)
            every = np.zeros(64 * self.size, np.uint8)
            await self.comm.all_gather(mine, every)
            nxt = (self.rank + 1) % self.size
            text = every[64 * nxt:64 * (nxt + 1)].tobytes().rstrip(b"\0").decode()
            h, p, scope = text.split("|")
            addr: tuple[Any, ...] = (h, int(p), 0, int(scope)) \
                if iface.family == socket.AF_INET6 else (h, int(p))

            def dial_and_accept() -> tuple[socket.socket, socket.socket]:
                out = socket.socket(iface.family, socket.SOCK_STREAM)
                out.settimeout(timeout)
                out.connect(addr)
                lsock.settimeout(timeout)
                inc, _ = lsock.accept()
                for s in (out, inc):
                    s.settimeout(timeout)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return out, inc

            out, inc = await asyncio.to_thread(dial_and_accept)
        finally:
            lsock.close()
        self.ring = _TcpRing(out, inc)

    def make_op(self, coll: str, inplace: bool, inp: Any, out: Any, op: ReduceOp,
                root: int) -> _Op | None:
        ring = self.ring
        if ring is None or inplace:
            return None

        async def run() -> None:
            ring.exchange(inp, out)  # blocks the loop on purpose: nothing else runs meanwhile
        return run

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None


class _TorchRunner(_Runner):
    """``torch.distributed`` with gloo (CPU tensors) or nccl (CUDA tensors)."""

    def __init__(self, backend: str, init_method: str, rank: int, size: int,
                 local_rank: int, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.name = backend
        self.rank, self.size = rank, size
        if backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                 world_size=size,
                                 timeout=datetime.timedelta(seconds=timeout))
        self.info = {"backend": f"torch.distributed {backend} (torch {torch.__version__})",
                     "net": backend, "loop": "-", "chunk": "-"}
        self.ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def _tdtype(self, dtype: np.dtype[Any]) -> Any:
        name = DTYPE_NAMES[dtype]
        tdt = getattr(self.torch, name, None)
        if tdt is None:
            raise _Usage(f"torch has no dtype {name}")
        return tdt

    def alloc(self, count: int, dtype: np.dtype[Any]) -> _Buf:
        torch = self.torch
        t = torch.empty(count, dtype=self._tdtype(dtype), device=self.device)
        view: Callable[[int, int], Any] = lambda start, n: t.narrow(0, start, n)  # noqa: E731
        if self.device.type == "cpu":
            host = t.view(torch.uint8).numpy().view(dtype) if count else np.empty(0, dtype)
            return _Buf(host, t, view)
        host = np.empty(count, dtype)

        def upload() -> None:
            t.view(torch.uint8).copy_(torch.from_numpy(host.view(np.uint8)))

        def download() -> None:
            host.view(np.uint8)[:] = t.view(torch.uint8).cpu().numpy()
        return _Buf(host, t, view, upload, download)

    def _rop(self, op: ReduceOp) -> Any:
        r = self.dist.ReduceOp
        return {ReduceOp.SUM: r.SUM, ReduceOp.PROD: r.PRODUCT, ReduceOp.MAX: r.MAX,
                ReduceOp.MIN: r.MIN, ReduceOp.AVG: r.AVG}[op]

    def make_op(self, coll: str, inplace: bool, inp: Any, out: Any, op: ReduceOp,
                root: int) -> _Op | None:
        dist, rop = self.dist, self._rop(op)
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        call: Callable[[], Any]
        if coll == "all_reduce":
            call = (lambda: dist.all_reduce(inp, op=rop)) if inplace \
                else (lambda: (out.copy_(inp), dist.all_reduce(out, op=rop)))
        elif coll == "broadcast":
            call = lambda: dist.broadcast(out, src=root)  # noqa: E731
        elif coll == "reduce":
            call = (lambda: dist.reduce(inp, dst=root, op=rop)) if inplace \
                else (lambda: (out.copy_(inp), dist.reduce(out, dst=root, op=rop)))
        elif coll == "all_gather":
            call = lambda: self.ag(out, inp)  # noqa: E731
        elif coll == "reduce_scatter":
            call = lambda: self.rs(out, inp, op=rop)  # noqa: E731
        elif coll == "all_to_all":
            if inplace:
                return None  # all_to_all_single has no in-place form
            call = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
        elif coll == "sendrecv":
            if inplace or self.size < 2:
                return None
            def call() -> None:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt),
                                               dist.P2POp(dist.irecv, out, prv)])
                for req in reqs:
                    req.wait()
        elif coll == "barrier":
            call = dist.barrier
        else:
            return None

        async def run() -> None:
            call()
        return run

    def unsupported(self, exc: BaseException) -> bool:
        return isinstance(exc, (RuntimeError, ValueError, TypeError, NotImplementedError))

    async def barrier(self) -> None:
        self.dist.barrier()

    async def combine(self, value: float, how: str) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        if how == "rank0":
            self.dist.broadcast(t, src=0)
        else:
            r = self.dist.ReduceOp
            self.dist.all_reduce(t, op={"max": r.MAX, "min": r.MIN}.get(how, r.SUM))
            if how == "avg":
                t /= self.size
        return float(t.item())

    async def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def close(self) -> None:
        self.dist.destroy_process_group()


# --------------------------------------------------------------------------- the sweep

@dataclass
class _Opts:
    """Parsed command line (see :func:`_parser`)."""

    coll: str
    minbytes: int
    maxbytes: int
    factor: float
    stepbytes: int
    iters: int
    warmup: int
    dtype: str
    op: str
    root: int
    check: bool
    average: int
    nranks: int | None
    json: str | None
    plot: str | None
    vs: str | None
    inplace: bool
    loop: str
    progress: bool | None
    timeout: float | None
    backend: str
    result_file: str | None
    peer_init: str | None
    inject_error: bool
    argv: list[str] = field(default_factory=list)


@dataclass
class _Record:
    """One (size, mode) result: a row half of the table and one JSON record."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    inplace: bool
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None
    note: str = ""


@dataclass
class _Result:
    """A whole sweep of one backend."""

    backend: str
    settings: dict[str, Any]
    records: list[_Record]
    notes: list[str]

    @property
    def wrong(self) -> int:
        return sum(r.wrong or 0 for r in self.records)

    @property
    def avg_busbw(self) -> float:
        vals = [r.busbw for r in self.records if r.busbw is not None]
        return sum(vals) / len(vals) if vals else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "settings": self.settings,
                "records": [asdict(r) for r in self.records], "notes": self.notes,
                "out_of_bounds": self.wrong, "avg_busbw": self.avg_busbw}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _Result:
        return cls(data["backend"], data["settings"],
                   [_Record(**r) for r in data["records"]], list(data["notes"]))


def _human(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _fmt_time(us: float) -> str:
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


class _Table:
    """nccl-tests' table on stdout (rank 0 only) and an optional progress line on stderr."""

    def __init__(self, modes: int, progress: bool) -> None:
        self.modes = modes
        self.progress = progress
        self.shown = False

    def header(self, o: _Opts, res: _Result) -> None:
        s = res.settings
        step = f"{o.stepbytes}(bytes)" if o.stepbytes > 0 else f"{o.factor:g}(factor)"
        print(f"# {_PROG} {o.coll}: minBytes {o.minbytes} maxBytes {o.maxbytes} step: {step} "
              f"warmup iters: {o.warmup} iters: {o.iters} validation: {int(o.check)}")
        print(f"# {s['backend']} | ranks {s['nranks']} | net {s['net']} | loop {s['loop']} "
              f"| chunk {s['chunk']} | host {s['host']} | time: {s['time_combine']} over "
              f"ranks")
        print("#")
        def cells(*v: str) -> str:
            return f"{v[0]:>12s}  {v[1]:>12s}  {v[2]:>8s}  {v[3]:>6s}  {v[4]:>6s}"

        def mode(*v: str) -> str:
            return f"  {v[0]:>7s}  {v[1]:>6s}  {v[2]:>6s}  {v[3]:>6s}"

        top = " " * 52
        cols = cells("size", "count", "type", "redop", "root")
        units = cells("(B)", "(elements)", "", "", "")
        for name in ("out-of-place", "in-place")[:self.modes]:
            top += f"{name:^33s}"
            cols += mode("time", "algbw", "busbw", "#wrong")
            units += mode("(us)", "(GB/s)", "(GB/s)", "")
        top, cols, units = ("#" + line[1:] for line in (top, cols, units))
        print(top.rstrip())
        print(cols)
        print(units.rstrip())
        sys.stdout.flush()

    def row(self, recs: Sequence[_Record]) -> None:
        self.clear()
        r0 = recs[0]
        line = f"{r0.size:12d}  {r0.count:12d}  {r0.type:>8s}  {r0.redop:>6s}  {r0.root:6d}"
        for r in recs:
            if r.time_us is None or r.algbw is None or r.busbw is None:
                line += f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {'N/A':>6s}"
                continue
            wrong = "N/A" if r.wrong is None else str(r.wrong)
            line += f"  {_fmt_time(r.time_us)}  {r.algbw:6.2f}  {r.busbw:6.2f}  {wrong:>6s}"
        print(line, flush=True)

    def footer(self, res: _Result, checked: bool) -> None:
        self.clear()
        for note in res.notes:
            print(f"# note: {note}")
        status = ("OK" if res.wrong == 0 else "FAILED") if checked else "(not checked)"
        print(f"# Out of bounds values : {res.wrong} {status}")
        print(f"# Avg bus bandwidth    : {res.avg_busbw:.6g} ")
        print("#", flush=True)

    def step(self, done: int, total: int, what: str) -> None:
        if self.progress:
            sys.stderr.write(f"\r\x1b[K# {_PROG}: [{done}/{total}] {what}")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


async def _measure(run: _Runner, fn: _Op, o: _Opts) -> float:
    """Average seconds per op over ``o.iters`` after a barrier (nccl-tests' timing)."""
    await run.barrier()
    t0 = time.perf_counter()
    for _ in range(o.iters):
        await fn()
    await run.sync()
    return (time.perf_counter() - t0) / max(o.iters, 1)


async def sweep(run: _Runner, o: _Opts) -> _Result:
    """Run the whole sweep on ``run``; rank 0 prints the table as it goes."""
    dtype = np.dtype(np.uint8) if o.coll == "tcp" else parse_dtype(o.dtype)
    op = ReduceOp.coerce(o.op)
    n, rank = run.size, run.rank
    root = o.root if o.coll in _ROOTED else -1
    if o.coll in _ROOTED and not 0 <= o.root < n:
        raise _Usage(f"-r {o.root}: root must be in [0, {n})")
    if o.coll in ("sendrecv", "tcp") and n < 2:
        raise _Usage(f"{o.coll} needs at least 2 ranks (use -N 2)")
    sizes = [0] if o.coll == "barrier" else sweep_sizes(o.minbytes, o.maxbytes, o.factor,
                                                       o.stepbytes)
    modes = [False, True] if o.inplace and o.coll not in ("barrier", "tcp") else [False]
    how = _AVERAGE[o.average]
    settings = {"collective": o.coll, "nranks": n, "dtype": DTYPE_NAMES[dtype],
                "op": op.name.lower() if o.coll in _REDUCING else "none", "root": root,
                "iters": o.iters, "warmup": o.warmup, "check": o.check,
                "minbytes": o.minbytes, "maxbytes": o.maxbytes, "factor": o.factor,
                "stepbytes": o.stepbytes, "time_combine": how,
                "host": socket.gethostname(), **run.info}
    res = _Result(run.name, settings, [], [])
    table = _Table(len(modes), bool(o.progress)) if rank == 0 else None
    if table is not None:
        table.header(o, res)
    biggest = max(max(_counts(o.coll, s, dtype.itemsize, n)[:2]) for s in sizes)
    a, b = run.alloc(biggest, dtype), run.alloc(biggest, dtype)
    factor = 1.0 if o.coll == "tcp" else bus_factor(o.coll, n)
    redop = str(settings["op"])
    pattern = _pattern(o.coll, op)
    for si, size in enumerate(sizes):
        sc, rc, pc = _counts(o.coll, size, dtype.itemsize, n)
        nbytes = max(sc, rc) * dtype.itemsize
        recs: list[_Record] = []
        for inplace in modes:
            if table is not None:
                table.step(si + 1, len(sizes), f"{run.name} {o.coll} {_human(nbytes)} "
                           f"{'in-place' if inplace else 'out-of-place'}")
            in_off = rank * pc if inplace and o.coll == "all_gather" else 0
            out_off = rank * pc if inplace and o.coll == "reduce_scatter" else 0
            ib, ob = (b, b) if inplace else (a, b)
            inp, out = ib.view(in_off, sc), ob.view(out_off, rc)
            h_in, h_out = ib.host[in_off:in_off + sc], ob.host[out_off:out_off + rc]

            def prepare(h_in: npt.NDArray[Any] = h_in, h_out: npt.NDArray[Any] = h_out,
                        inplace: bool = inplace) -> None:
                if inplace:
                    _sentinel(b.host[:max(h_in.size, h_out.size)])
                else:
                    _sentinel(h_out)
                _fill(h_in, rank, pattern)
                if o.coll == "broadcast" and not inplace and rank == o.root:
                    h_out[...] = h_in  # acoll's broadcast is in place: root's data is in out
                a.upload()
                b.upload()

            rec = _Record(nbytes, pc, DTYPE_NAMES[dtype], redop, root, inplace, None, None,
                          None, None)
            fn = run.make_op(o.coll, inplace, inp, out, op, o.root)
            mode = "in-place" if inplace else "out-of-place"
            if fn is None:
                rec.note = "not supported"
                note = f"{mode} {o.coll} is not measured with {run.name} (no such form)"
                if note not in res.notes:
                    res.notes.append(note)
                recs.append(rec)
                continue
            prepare()
            try:
                await fn()
            except Exception as exc:
                if not run.unsupported(exc):
                    raise
                rec.note = f"not supported: {exc}"
                note = (f"{mode} {o.coll} not supported by {run.name}: "
                        f"{str(exc).splitlines()[0]}")
                if note not in res.notes:
                    res.notes.append(note)
                recs.append(rec)
                continue
            for _ in range(o.warmup - 1):
                await fn()
            seconds = await run.combine(await _measure(run, fn, o), how)
            rec.time_us = seconds * 1e6
            rec.algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            rec.busbw = rec.algbw * factor
            if o.check and o.coll != "barrier":
                prepare()
                await fn()
                await run.sync()
                a.download()
                b.download()
                if o.inject_error and rank == 0:
                    h_out[:1] += h_out.dtype.type(1)  # test hook: the check must notice
                wrong = _check(o.coll, h_out, rank=rank, nranks=n, root=o.root, per=pc, op=op)
                rec.wrong = round(await run.combine(float(wrong), "sum"))
            recs.append(rec)
        res.records.extend(recs)
        if table is not None:
            table.row(recs)
    if table is not None:
        table.footer(res, o.check and o.coll != "barrier")
    return res


# --------------------------------------------------------------------------- processes

def _run_loop(coro: Coroutine[Any, Any, _T], kind: str) -> _T:
    """Run ``coro`` on a fresh uvloop (when asked for or ``auto`` and installed) or asyncio."""
    loop: asyncio.AbstractEventLoop
    if kind != "asyncio" and importlib.util.find_spec("uvloop") is not None:
        import uvloop

        loop = uvloop.new_event_loop()
    elif kind == "uvloop":
        raise _Usage("--loop uvloop: uvloop is not installed")
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


def _peer_sweep(o: _Opts, rank: int, size: int, local_rank: int, init: str) -> _Result:
    """The sweep with torch.distributed (``o.vs`` or this worker's ``o.backend``)."""
    backend = o.vs if o.backend == "acoll" else o.backend
    assert backend is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation chatter in the ranks' output
        run = _TorchRunner(backend, init, rank, size, local_rank, _timeout_s())
        try:
            return asyncio.run(sweep(run, o))
        finally:
            run.close()


async def _acoll_rank(o: _Opts) -> tuple[_Result, Any, str | None]:
    """Join (or make) the communicator and run the acoll/tcp sweep.

    Returns the result, the launch info (``None`` for a lone rank) and, with ``--vs``, the
    ``tcp://`` address rank 0 chose for torch.distributed.
    """
    import acoll

    from ._env import ranks_from_env

    try:
        info: Any = ranks_from_env()
    except InvalidUsage:
        info = None
    if info is None:
        comm = await acoll.init_rank(1, acoll.get_unique_id(), 0)
    else:
        comm = await acoll.init_from_env()
    peer_init: str | None = None
    async with comm:
        run: _AcollRunner = _TcpRunner(comm) if o.coll == "tcp" else _AcollRunner(comm)
        try:
            if isinstance(run, _TcpRunner):
                await run.connect(comm.timeout)
            res = await sweep(run, o)
        finally:
            if isinstance(run, _TcpRunner):
                run.close()
        if o.vs is not None and o.result_file is None:
            from ._uid import parse_host_port

            host = parse_host_port(info.comm_id)[0] if info is not None else "127.0.0.1"
            port = np.array([_free_port(host) if comm.rank == 0 else 0], np.int64)
            await comm.broadcast(port, 0)
            peer_init = f"tcp://{host}:{int(port[0])}"
    return res, info, peer_init


def _rank_main(o: _Opts) -> int:
    """One rank of a job: sweep, then hand the result to the driver (or be the driver)."""
    if o.backend != "acoll":  # a torch worker started by -N
        from ._env import ranks_from_env

        info = ranks_from_env()
        assert o.peer_init is not None
        res = _peer_sweep(o, info.rank, info.world_size, info.local_rank, o.peer_init)
        if info.rank == 0 and o.result_file:
            Path(o.result_file).write_text(json.dumps(res.to_json()))
        return 0
    res, info, peer_init = _run_loop(_acoll_rank(o), o.loop)
    rank = 0 if info is None else info.rank
    if o.result_file is not None:
        if rank == 0:
            Path(o.result_file).write_text(json.dumps(res.to_json()))
        return 0
    peer = None
    if o.vs is not None and peer_init is not None:
        size = 1 if info is None else info.world_size
        local = 0 if info is None else info.local_rank
        peer = _peer_sweep(o, rank, size, local, peer_init)
    if rank == 0:
        _report(o, res, peer)
    return 1 if res.wrong else 0


def _child_args(o: _Opts, backend: str, result_file: str, peer_init: str | None) -> list[str]:
    args = [o.coll, "-b", str(o.minbytes), "-e", str(o.maxbytes), "-f", repr(o.factor),
            "-i", str(o.stepbytes), "-n", str(o.iters), "-w", str(o.warmup), "-d", o.dtype,
            "-o", o.op, "-r", str(o.root), "-c", str(int(o.check)), "-a", str(o.average),
            "--loop", o.loop, "--backend", backend, "--result-file", result_file,
            "--progress" if o.progress else "--no-progress"]
    if not o.inplace:
        args.append("--no-inplace")
    if peer_init:
        args += ["--peer-init", peer_init]
    if o.inject_error:
        args.append("--inject-error")
    return args


def _spawn(o: _Opts, args: list[str]) -> int:
    from .run import main as run_main

    launch = ["-n", str(o.nranks), "--no-prefix"]
    if o.timeout:
        launch += ["--timeout", str(o.timeout)]
    return run_main([*launch, "--", sys.executable, "-m", "acoll.perf", *args])


def _load(path: Path) -> _Result | None:
    try:
        return _Result.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _launch(o: _Opts) -> int:
    """``-N``: run the ranks as local processes (acoll-run's launcher), then report."""
    with tempfile.TemporaryDirectory(prefix="acoll-perf-") as tmp:
        mine = Path(tmp, "acoll.json")
        rc = _spawn(o, _child_args(o, "acoll", str(mine), None))
        res = _load(mine)
        if res is None:
            print(f"{_PROG}: the acoll ranks failed (exit code {rc})", file=sys.stderr)
            return rc or 1
        peer = None
        if o.vs is not None:
            theirs = Path(tmp, "peer.json")
            init = f"tcp://127.0.0.1:{_free_port()}"
            rc = _spawn(o, _child_args(o, o.vs, str(theirs), init))
            peer = _load(theirs)
            if peer is None:
                print(f"{_PROG}: the {o.vs} ranks failed (exit code {rc})", file=sys.stderr)
                return rc or 1
    _report(o, res, peer)
    return 1 if res.wrong else 0


# --------------------------------------------------------------------------- reporting

def _pairs(res: _Result, peer: _Result) -> list[tuple[_Record, _Record]]:
    """Matching records per size: in place where both measured it, else out of place."""
    def index(r: _Result) -> dict[tuple[int, bool], _Record]:
        return {(x.size, x.inplace): x for x in r.records if x.time_us is not None}

    mine, theirs = index(res), index(peer)
    out = []
    for size in sorted({x.size for x in res.records}):
        for inplace in (True, False):
            if (size, inplace) in mine and (size, inplace) in theirs:
                out.append((mine[size, inplace], theirs[size, inplace]))
                break
    return out


def _comparison(res: _Result, peer: _Result) -> list[dict[str, Any]]:
    rows = []
    for m, t in _pairs(res, peer):  # measured records only: times > 0, busbw set
        mt, tt, mb, tb = m.time_us or 1.0, t.time_us or 1.0, m.busbw or 0.0, t.busbw or 0.0
        rows.append({"size": m.size, "inplace": m.inplace, "acoll_time_us": mt,
                     "peer_time_us": tt, "acoll_busbw": mb, "peer_busbw": tb,
                     "busbw_ratio": mb / tb if tb > 0 else None, "time_ratio": tt / mt})
    return rows


def _print_comparison(rows: list[dict[str, Any]], name: str) -> None:
    print(f"# acoll vs {name} (same sizes, dtype, op, ranks, iters; in-place where both "
          "support it)")
    print(f"#       size  mode   acoll(us)  {name:>5s}(us)  acoll_busbw  {name:>5s}_busbw  "
          f"busbw_ratio  time_ratio")
    for r in rows:
        ratio = "N/A" if r["busbw_ratio"] is None else f"{r['busbw_ratio']:.2f}"
        print(f"{r['size']:12d}  {'in ' if r['inplace'] else 'out'}  "
              f"{_fmt_time(r['acoll_time_us']):>10s}  {_fmt_time(r['peer_time_us']):>9s}  "
              f"{r['acoll_busbw']:11.3f}  {r['peer_busbw']:11.3f}  {ratio:>11s}  "
              f"{r['time_ratio']:10.2f}")
    ratios = [r["busbw_ratio"] for r in rows if r["busbw_ratio"] is not None]
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios if x > 0) / len(ratios))
        print(f"# busbw ratio acoll/{name}: geometric mean {geo:.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}")
    print("#", flush=True)


def _machine() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__}


def _report(o: _Opts, res: _Result, peer: _Result | None) -> None:
    """Comparison table, ``--json`` and ``--plot`` (the driver process only)."""
    from . import __version__

    comparison = None
    if peer is not None:
        comparison = _comparison(res, peer)
        _print_comparison(comparison, peer.backend)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = shlex.join([_PROG, *o.argv])
    if o.json:
        doc = {"tool": _PROG, "acoll_version": __version__, "machine": _machine(),
               "date": date, "command": command, **res.to_json(),
               "peer": None if peer is None else peer.to_json(), "comparison": comparison}
        Path(o.json).write_text(json.dumps(doc, indent=1) + "\n")
    if o.plot:
        _plot(o.plot, o, res, peer, f"{command}  |  {date}")


def _plot(path: str, o: _Opts, res: _Result, peer: _Result | None, stamp: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(12, 5))
    for r in (res, peer):
        if r is None:
            continue
        for inplace in (False, True):
            pts = [x for x in r.records if x.inplace == inplace and x.busbw is not None
                   and x.time_us is not None and x.size > 0]
            if not pts:
                continue
            label = f"{r.backend} {'in-place' if inplace else 'out-of-place'}"
            style = {"marker": "o", "markersize": 3, "label": label,
                     "linestyle": "--" if inplace else "-"}
            ax.plot([x.size for x in pts], [x.busbw for x in pts], **style)
            lat.plot([x.size for x in pts], [x.time_us for x in pts], **style)
    s = res.settings
    fig.suptitle(f"acoll-perf {o.coll} {s['dtype']} {s['op']}, {s['nranks']} ranks, "
                 f"{s['host']} ({os.cpu_count()} CPUs)")
    for axis, name in ((ax, "busbw (GB/s)"), (lat, "time per op (us)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("size (bytes)")
        axis.set_ylabel(name)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    lat.set_yscale("log")
    fig.text(0.01, 0.01, stamp, fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, metadata={"Description": stamp, "Software": _PROG})
    plt.close(fig)


# --------------------------------------------------------------------------- command line

def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M, 1G)"
                                         ) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG, allow_abbrev=False,
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
    p.add_argument("--vs", choices=("gloo", "nccl"),
                   help="also run torch.distributed with this backend and compare")
    p.add_argument("--no-inplace", dest="inplace", action="store_false",
                   help="skip the in-place columns")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="event loop (auto: uvloop when installed)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with -N: stop the job after S seconds")
    p.add_argument("--backend", default="acoll", choices=("acoll", "gloo", "nccl"),
                   help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def _parse(argv: list[str]) -> _Opts:
    ns = _parser().parse_args(argv)
    maxbytes = ns.minbytes if ns.maxbytes is None else ns.maxbytes
    if ns.iters < 1 or ns.warmup_iters < 0:
        raise _Usage("-n must be >= 1 and -w >= 0")
    if ns.nranks is not None and ns.nranks < 1:
        raise _Usage("-N must be >= 1")
    if ns.nranks is not None and ns.collective in _ROOTED and not 0 <= ns.root < ns.nranks:
        raise _Usage(f"-r {ns.root}: root must be in [0, {ns.nranks})")
    try:
        dtype = parse_dtype(ns.datatype)
        op = ReduceOp.coerce(ns.op)
    except InvalidUsage as exc:
        raise _Usage(str(exc)) from None
    sweep_sizes(ns.minbytes, maxbytes, ns.stepfactor, ns.stepbytes)  # validates
    progress = ns.progress if ns.progress is not None else sys.stderr.isatty()
    return _Opts(ns.collective, ns.minbytes, maxbytes, ns.stepfactor, ns.stepbytes, ns.iters,
                 ns.warmup_iters, DTYPE_NAMES[dtype], op.name.lower(), ns.root,
                 bool(ns.check), ns.average, ns.nranks, ns.json, ns.plot, ns.vs, ns.inplace,
                 ns.loop, progress, ns.timeout, ns.backend, ns.result_file, ns.peer_init,
                 ns.inject_error, list(argv))


def _preflight(o: _Opts) -> None:
    """Fail fast, before any rank starts, when an optional dependency is missing."""
    if o.plot and o.result_file is None and importlib.util.find_spec("matplotlib") is None:
        raise _Usage("--plot needs matplotlib: pip install 'acoll[plot]'")
    backend = o.vs if o.backend == "acoll" else o.backend
    if backend is None or o.result_file is not None:
        return
    if o.coll == "tcp":
        raise _Usage("--vs makes no sense with the tcp baseline")
    if importlib.util.find_spec("torch") is None:
        raise _Usage(f"--vs {backend} needs PyTorch: pip install 'acoll[bench]' "
                     "(or pip install torch)")
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise _Usage(f"--vs {backend}: this torch build has no torch.distributed")
    if backend == "gloo" and not dist.is_gloo_available():
        raise _Usage("--vs gloo: this torch build has no gloo backend")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise _Usage("--vs nccl needs CUDA GPUs and a CUDA build of torch; none found")
        if not dist.is_nccl_available():
            raise _Usage("--vs nccl: this torch build has no NCCL backend")
        if o.nranks is not None and o.nranks > torch.cuda.device_count():
            raise _Usage(f"--vs nccl -N {o.nranks}: only {torch.cuda.device_count()} GPUs")


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
    except _Usage as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (AcollError, OSError) as exc:
        print(f"{_PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
