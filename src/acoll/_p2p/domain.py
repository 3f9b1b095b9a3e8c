"""The P2P domain of a GPU communicator: every rank's workspace, mapped by every rank.

Formed once per communicator, right after the bootstrap, when every rank is a GPU rank
on one host with the P2P path on (``ACOLL_P2P_DISABLE`` unset) and every pair of GPUs can
reach each other:

1. each rank allocates one device block with ``cudaMalloc`` (so the allocation base is the
   pointer an IPC handle names): a zeroed signal area, then ``ACOLL_P2P_BUFFER`` bytes of
   workspace;
2. the ranks all-gather (over the bootstrap) the block's address, its CUDA IPC handle, the
   GPU's PCI bus id, SM count and their process id;
3. each rank checks it can reach every peer (same process: peer access between the two
   devices, or one device; other processes: the peer's GPU is visible here, is a
   different GPU, and peer access works), and the ranks all-gather that verdict: the
   domain exists only if every rank said yes, otherwise everyone frees and the
   communicator keeps its transports (logged at INFO with the reason);
4. each rank maps the peers' blocks: the pointer itself in one process (after
   ``cudaDeviceEnablePeerAccess``), ``cudaIpcOpenMemHandle`` across processes (an
   opened handle is cached per process: CUDA allows one open per handle and process).

Ranks sharing one GPU must be in one process and one event loop: across processes their
kernels would time-slice, and a kernel spinning at a barrier for a peer's kernel that
cannot run until the slice ends turns every step into milliseconds.

Ranks of one communicator that live in one process and loop launch each call together
(:class:`LocalLaunch`): the last of them to reach call *k* enqueues every local rank's
kernels back to back. No kernel of a local rank spins while this thread still has to
launch its peer's, so an allocation or a synchronize the application makes between the
ranks' calls (which may wait for every kernel on the device) cannot deadlock.

The domain then launches the kernels of :mod:`acoll._cuda.p2p_kernels` on the
communicator's stream. Errors the kernels record (a peer that never arrived, an abort,
a mismatched call) are read from host-mapped memory after each call and raised as
:class:`~acoll.TimeoutError` / :class:`~acoll.RemoteError` / :class:`~acoll.InvalidUsage`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

from .._config import Setting, get_logger, parse_bool, parse_size
from .._cuda.kernels import NVRTC_OPTIONS
from .._cuda.launcher import AT, NATIVE, Launcher
from .._cuda.launcher import load_async as load_launcher
from .._cuda.p2p_kernels import (
    ERR_ABORTED,
    ERR_MISMATCH,
    ERR_TIMEOUT,
    ERR_WORDS,
    MAX_BLOCKS,
    MAX_REGS,
    MAXR,
    PHASES,
    SIGNAL_BYTES,
    THREADS,
    Mode,
    P2PSource,
    copy_source,
    reduce_source,
)
from .._dtypes import DTYPE_NAMES, ReduceOp
from .._offloop import in_thread
from ..errors import AcollError, ClosedError, InvalidUsage, RemoteError, TransportError
from ..errors import TimeoutError as AcollTimeoutError
from .plan import Step, describe, plan

__all__ = ["BLOCKS", "BUFFER", "DISABLE", "ONE_SHOT_MAX", "P2PDomain"]

log = get_logger("P2P")

DISABLE = Setting("P2P_DISABLE", parse_bool, False,
                  "Never use the intra-host GPU path (peer access / CUDA IPC kernels).", "P2P")
BUFFER = Setting("P2P_BUFFER", parse_size, 256 << 20,
                 "Device workspace per GPU rank for the P2P path (bytes; copy mode moves "
                 "calls through it in steps of this size).", "P2P")
BLOCKS = Setting("P2P_BLOCKS", int, 128,
                 "Most thread blocks per P2P kernel launch (at most 128).", "P2P", lo=1)
ONE_SHOT_MAX = Setting("P2P_ONE_SHOT_MAX", parse_size, 256 << 10,
                       "Largest all_reduce (bytes) run one-shot; larger ones are two-shot.",
                       "P2P")
DIRECT = Setting("P2P_DIRECT", parse_bool, True,
                 "Ranks all in one process read each other's buffers in place (no copy "
                 "into the workspace).", "P2P")

_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_HOST_ALLOC_PORTABLE_MAPPED = 1 | 2
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess

_opened: dict[bytes, list[int]] = {}  # IPC handle -> [pointer, users] (per process)
_opened_lock = threading.Lock()
_kernels: dict[tuple[str, int], Any] = {}
_kernels_lock = threading.Lock()
_libcuda: list[Any] = []


class _Args(ctypes.Structure):
    """The kernel's parameters, in order (see :class:`~acoll._cuda.p2p_kernels.P2PSource`),
    kept in one place so that a launch only rewrites the fields that change."""

    _fields_ = [("tab", ctypes.c_uint64), ("err", ctypes.c_uint64),
                ("abort", ctypes.c_uint64), ("rank", ctypes.c_int32),
                ("nranks", ctypes.c_int32), ("root", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("own_ws", ctypes.c_int32),
                ("epoch", ctypes.c_uint64), ("timeout", ctypes.c_uint64),
                ("sig", ctypes.c_uint64), ("sig2", ctypes.c_uint64),
                ("inp", ctypes.c_uint64), ("out", ctypes.c_uint64), ("n", ctypes.c_uint64),
                ("ws_off", ctypes.c_uint64), ("out_stride", ctypes.c_uint64),
                ("src_stride", ctypes.c_uint64), ("user_stride", ctypes.c_uint64),
                ("regtab", ctypes.c_uint64), ("reg", ctypes.c_uint64),
                ("reg_in_off", ctypes.c_uint64), ("reg_out_off", ctypes.c_uint64)]


#: Where the epoch lies in a parameter block (the native launcher writes it).
EPOCH_OFFSET: int = _Args.epoch.offset


def _cu_launch() -> Any:
    """``cuLaunchKernel`` through ctypes (a launch costs a few µs instead of CuPy's
    argument conversion), or ``None`` where the driver library cannot be loaded."""
    if not _libcuda:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _libcuda.append(fn)
        except (OSError, AttributeError):
            _libcuda.append(None)
    return _libcuda[0]


class LocalLaunch:
    """The ranks of one communicator in this process and loop, launching together.

    :meth:`submit` takes rank ``rank``'s launch for its call number ``index``; the last
    local rank to submit runs every local rank's launch, in rank order. The others get a
    future that completes then (or fails with that rank's launch error).

    Never while a kernel module is being loaded (:data:`_kernels_lock` held by a compile
    in a worker thread): loading a module waits for the device's running kernels and
    holds the context meanwhile, so with two ranks on one GPU the first rank's kernel,
    spinning for the second's, would hold the load, which holds the second launch, until
    the kernel's timeout (seen on an H200). The launches then wait (a timer, off the
    lock) and the last rank gets a future too.
    """

    #: Seconds between tries while a module loads (a compile takes up to a second; the
    #: loops' timers have millisecond resolution: a shorter delay busy-loops uvloop).
    RETRY_S = 0.001

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.users = 0
        self.pending: dict[int, dict[int, tuple[Callable[[], None],
                                                asyncio.Future[None] | None]]] = {}

    def submit(self, index: int, rank: int, launch: Callable[[], None]
               ) -> asyncio.Future[None] | None:
        entries = self.pending.setdefault(index, {})
        if len(entries) + 1 < self.expected:
            fut = asyncio.get_running_loop().create_future()
            entries[rank] = (launch, fut)
            return fut
        if not _kernels_lock.acquire(blocking=False):
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            entries[rank] = (launch, fut)
            loop.call_later(self.RETRY_S, self._retry, index)
            return fut
        try:
            del self.pending[index]
            entries[rank] = (launch, None)
            mine = self._run(entries)
        finally:
            _kernels_lock.release()
        if mine is not None:
            raise mine
        return None

    def _retry(self, index: int) -> None:
        entries = self.pending.get(index)
        if entries is None or len(entries) < self.expected:
            return  # withdrawn (timeout, abort): the others' waits end on their own
        if not _kernels_lock.acquire(blocking=False):
            asyncio.get_running_loop().call_later(self.RETRY_S, self._retry, index)
            return
        try:
            del self.pending[index]
            self._run(entries)
        finally:
            _kernels_lock.release()

    @staticmethod
    def _run(entries: dict[int, tuple[Callable[[], None], asyncio.Future[None] | None]]
             ) -> BaseException | None:
        """Run every rank's launch in rank order; the error of the rank without a future
        (the caller's) is returned, the others' go to their futures.

        When every launch is a native one of the same launcher (``fill``/``finish``, see
        :mod:`acoll._p2p.fast`), their driver calls are made by one C call."""
        order = sorted(entries)
        outcome: dict[int, BaseException | None] = {}
        runs = [entries[r][0] for r in order]
        lau = getattr(runs[0], "launcher", None)
        if lau is not None and all(getattr(x, "launcher", None) is lau for x in runs):
            jobs = lau.jobs(len(order))
            filled: list[tuple[int, Any, int]] = []
            for r, run in zip(order, runs, strict=True):
                try:
                    run.fill(jobs[len(filled)])  # type: ignore[attr-defined]
                except BaseException as exc:
                    outcome[r] = exc
                    continue
                filled.append((r, run, len(filled)))
            if filled:
                try:
                    lau.run(jobs, len(filled))
                except BaseException as exc:  # (not from C: an interrupt on return)
                    for r, _, _ in filled:
                        outcome[r] = exc
                    filled = []
            for r, run, i in filled:
                try:
                    run.finish(jobs[i])
                    outcome[r] = None
                except BaseException as exc:
                    outcome[r] = exc
        else:
            for r, run in zip(order, runs, strict=True):
                try:
                    run()
                    outcome[r] = None
                except BaseException as exc:
                    outcome[r] = exc
        mine: BaseException | None = None
        for r in order:
            waiter, failure = entries[r][1], outcome[r]
            if waiter is None:
                mine = failure
            elif waiter.done():
                continue
            elif failure is not None:
                waiter.set_exception(failure)
            else:
                waiter.set_result(None)
        return mine

    def withdraw(self, index: int, rank: int) -> None:
        entries = self.pending.get(index)
        if entries is not None:
            entries.pop(rank, None)
            if not entries:
                del self.pending[index]


_local_groups: dict[tuple[Any, ...], LocalLaunch] = {}
_range_fn: list[Any] = []


def address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the CUDA allocation holding device pointer ``ptr``
    (``cuMemGetAddressRange``: a memory pool's sub-allocation lies inside one)."""
    if not _range_fn:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                       ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _range_fn.append(fn)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _range_fn[0](ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise InvalidUsage(f"{ptr:#x} is not in a CUDA allocation (CUresult {rc})")
    return int(base.value), int(size.value)


class _Registration:
    __slots__ = ("base", "index", "opened", "size")

    def __init__(self, index: int, base: int, size: int, opened: list[bytes]) -> None:
        self.index, self.base, self.size, self.opened = index, base, size, opened


def _compile(src: P2PSource, device: int) -> Any:
    """The loaded kernel of ``src`` on ``device`` (compiled once per process and device;
    run in a worker thread: NVRTC takes a second the first time)."""
    key = (src.name, device)
    kern = _kernels.get(key)
    if kern is None:
        import cupy as cp
        with _kernels_lock:
            kern = _kernels.get(key)
            if kern is None:
                with cp.cuda.Device(device):
                    kern = cp.RawKernel(src.code, src.name, options=NVRTC_OPTIONS)
                    kern.compile()
                _kernels[key] = kern
    return kern


def _open_ipc(cp: Any, handle: bytes) -> int:
    with _opened_lock:
        hit = _opened.get(handle)
        if hit is None:
            hit = _opened[handle] = [int(cp.cuda.runtime.ipcOpenMemHandle(
                handle, _IPC_LAZY_PEER)), 0]
        hit[1] += 1
        return hit[0]


def _close_ipc(cp: Any, handle: bytes) -> None:
    with _opened_lock:
        hit = _opened.get(handle)
        if hit is None:
            return
        hit[1] -= 1
        if hit[1] == 0:
            del _opened[handle]
            try:
                cp.cuda.runtime.ipcCloseMemHandle(hit[0])
            except Exception as exc:  # the peer's process may be gone
                log.info("closing a peer's IPC mapping failed: %s", exc)


class P2PDomain:
    """One rank's view of its communicator's P2P domain (see the module docstring)."""

    def __init__(self, space: Any, rank: int, nranks: int, block: int, capacity: int,
                 direct: bool, most_blocks: int, one_shot_max: int) -> None:
        self.space = space
        self.cp = space.cp
        self.device = space.device
        self.rank, self.nranks = rank, nranks
        self.capacity = capacity
        self.direct = direct
        self.most_blocks = most_blocks
        self.one_shot_max = one_shot_max
        self.epoch = 0
        #: Another rank of the domain drives this GPU (from this thread: see above). Its
        #: kernels must not share a stream with ours: on one stream, the first of two
        #: kernels waiting for each other would wait forever for the second.
        self.shares_gpu = False
        self._block = block  # my cudaMalloc'd signal area + workspace
        self._handles: list[bytes] = []  # peers' IPC handles I opened
        self._table: Any = None  # device u64[2 * MAXR]
        # Host-mapped: error rows, then the abort word.
        nbytes = MAX_BLOCKS * ERR_WORDS * 8 + 64
        self._host_ptr = int(self.cp.cuda.runtime.hostAlloc(nbytes,
                                                            _HOST_ALLOC_PORTABLE_MAPPED))
        raw = memoryview((ctypes.c_char * nbytes).from_address(self._host_ptr)).cast("B")
        self._err = np.frombuffer(raw, np.uint64, MAX_BLOCKS * ERR_WORDS).reshape(
            MAX_BLOCKS, ERR_WORDS)
        self._err[:] = 0
        self._err_dev = self._device_pointer(self._host_ptr)
        self._failed: AcollError | None = None
        self._freed = False
        self.timeout_ns = 0
        self._flag = np.frombuffer(raw, np.uint64, 1, MAX_BLOCKS * ERR_WORDS * 8)
        self._abort = np.frombuffer(raw, np.uint32, 1, MAX_BLOCKS * ERR_WORDS * 8 + 8)
        self._flag[0] = 0
        self._abort[0] = 0
        self._abort_dev = self._err_dev + MAX_BLOCKS * ERR_WORDS * 8 + 8
        self._args = _Args()
        base = ctypes.addressof(self._args)
        self._params = (ctypes.c_void_p * len(_Args._fields_))(
            *(base + getattr(_Args, field[0]).offset for field in _Args._fields_))
        self._functions: dict[str, int] = {}  # kernel name -> CUfunction on this device
        self._plans: dict[tuple[int, int, int, int], list[Step]] = {}
        self._sources: dict[tuple[Any, Any], P2PSource] = {}
        self._local: LocalLaunch | None = None
        self._local_key: tuple[Any, ...] = ()
        self._launches = 0
        self._waiting: tuple[int, asyncio.Future[None]] | None = None
        #: Bytes this rank copied into its workspace so far (a registered or in-process
        #: call copies none).
        self.copied = 0
        self._regs: list[_Registration] = []
        self._next_reg = 0
        self._regtab: Any = None  # device u64[MAX_REGS * MAXR]
        #: Changes with every registration and deregistration (prepared calls that chose
        #: where peers read by the registrations then are stale).
        self.generation = 0
        # Launch order across streams: the stream of this rank's last launch and an event
        # recorded after it (from a small ring, see mark()).
        self._ring: list[Any] = []
        self._ring_next = 0
        self._last_stream: Any = None
        self._last_ptr = -1
        self._last_event: Any = None
        #: The native launcher prepared calls use (:mod:`acoll._cuda.launcher`), or None,
        #: and this device's context for it.
        self.launcher: Launcher | None = None
        self.ctx = 0

    def _device_pointer(self, host_ptr: int) -> int:
        rt = self.cp.cuda.runtime
        get = getattr(rt, "hostGetDevicePointer", None)
        if get is None:  # unified addressing: the host pointer works on the device
            return host_ptr
        with self.cp.cuda.Device(self.device):
            return int(get(host_ptr, 0))

    # ------------------------------------------------------------------ formation
    @classmethod
    async def establish(cls, space: Any, rank: int, nranks: int, boot: Any,
                        timeout: float) -> P2PDomain | None:
        """Form the domain (every rank of the communicator calls this, or none does).

        Returns ``None`` (everyone alike) when some pair cannot use the path.
        """
        cp = space.cp
        rt = cp.cuda.runtime
        capacity = BUFFER.resolve()
        capacity = max(1 << 20, capacity // 256 * 256)
        block = 0
        record: dict[str, Any] = {"ok": False}
        try:
            with cp.cuda.Device(space.device):
                block = int(rt.malloc(SIGNAL_BYTES + capacity))
                rt.memsetAsync(block, 0, SIGNAL_BYTES, space.stream.ptr)
                record = {
                    "ok": True, "pid": os.getpid(), "ptr": block,
                    "handle": bytes(rt.ipcGetMemHandle(block)),
                    "bus": str(rt.deviceGetPCIBusId(space.device)).lower(),
                    "sms": int(cp.cuda.Device(space.device).attributes[
                        "MultiProcessorCount"]),
                    "loop": id(asyncio.get_running_loop()),
                    "cap": capacity, "blocks": BLOCKS.resolve(),
                    "direct": DIRECT.resolve(), "one": ONE_SHOT_MAX.resolve()}
        except Exception as exc:
            record = {"ok": False, "why": f"rank {rank}: {exc}"}
        try:
            await space.settle(asyncio.get_running_loop().time() + timeout)
            records = [msgpack.unpackb(r) for r in await boot.allgather(msgpack.packb(record))]
            why = next((r.get("why", "?") for r in records if not r["ok"]), "")
            if not why:
                why = _reach(cp, space.device, rank, records)
            verdicts = [msgpack.unpackb(v) for v in await boot.allgather(msgpack.packb(why))]
        except BaseException:
            if block:
                _free(cp, space.device, block)
            raise
        refusal = next((v for v in verdicts if v), "")
        if refusal:
            log.info("rank %d: intra-host GPU path not used: %s", rank, refusal)
            if block:
                _free(cp, space.device, block)
            return None
        same_proc = all(r["pid"] == records[rank]["pid"] for r in records)
        buses = [r["bus"] for r in records]
        sharing = max(buses.count(b) for b in buses)
        most = max(1, min(min(r["blocks"] for r in records), MAX_BLOCKS,
                          min(r["sms"] for r in records) // sharing))
        direct = same_proc and all(r["direct"] for r in records)
        dom = cls(space, rank, nranks, block, min(r["cap"] for r in records), direct, most,
                  min(r["one"] for r in records))
        dom.shares_gpu = buses.count(buses[rank]) > 1
        try:
            dom._map(records)
        except BaseException:
            dom.close()
            raise
        me = records[rank]
        local = [p for p, r in enumerate(records)
                 if (r["pid"], r["loop"]) == (me["pid"], me["loop"])]
        if len(local) > 1:
            dom._local_key = tuple((r["pid"], r["ptr"]) for r in records)
            group = _local_groups.get(dom._local_key)
            if group is None:
                group = _local_groups[dom._local_key] = LocalLaunch(len(local))
            group.users += 1
            dom._local = group
        if NATIVE.resolve():
            lau = await load_launcher()
            if lau is not None:
                dom.ctx = lau.primary_context(space.device)
                dom.launcher = lau if dom.ctx else None
        dom.timeout_ns = int(timeout * 1e9) + 2_000_000_000
        a = dom._args
        a.tab, a.err, a.abort = int(dom._table.data.ptr), dom._err_dev, dom._abort_dev
        a.rank, a.nranks, a.timeout = rank, nranks, dom.timeout_ns
        a.regtab = int(dom._regtab.data.ptr)
        log.info("rank %d: intra-host GPU path on cuda:%d: %d ranks, %s mode, %d blocks, "
                 "%d MiB workspace", rank, space.device, nranks,
                 "direct" if direct else "copy", most, dom.capacity >> 20)
        return dom

    def _map(self, records: list[dict[str, Any]]) -> None:
        cp, rt = self.cp, self.cp.cuda.runtime
        table = np.zeros(2 * MAXR, np.uint64)
        me = records[self.rank]
        with cp.cuda.Device(self.device):
            for p, r in enumerate(records):
                if p == self.rank:
                    base = self._block
                elif r["pid"] == me["pid"]:
                    peer_dev = int(rt.deviceGetByPCIBusId(r["bus"]))
                    if peer_dev != self.device:
                        try:
                            rt.deviceEnablePeerAccess(peer_dev)
                        except cp.cuda.runtime.CUDARuntimeError as exc:
                            if exc.status != _PEER_ALREADY_ENABLED:
                                raise
                    base = int(r["ptr"])
                else:
                    base = _open_ipc(cp, r["handle"])
                    self._handles.append(r["handle"])
                table[p] = base + SIGNAL_BYTES
                table[MAXR + p] = base
            self._table = cp.asarray(table)
            self._regtab = cp.zeros(MAX_REGS * MAXR, cp.uint64)
            self.space.stream.synchronize()  # small, once: the table is in place

    # ------------------------------------------------------------------ running
    def loaded(self, src: P2PSource) -> Any:
        """The kernel of ``src`` if it is compiled for this device already, else ``None``."""
        return _kernels.get((src.name, self.device))

    async def kernel(self, src: P2PSource) -> Any:
        """The kernel of ``src`` for this device (compiled off the loop thread once)."""
        kern = _kernels.get((src.name, self.device))
        if kern is None:
            kern = await in_thread(functools.partial(_compile, src, self.device))
        return kern

    def source(self, op: ReduceOp | None, dtype: Any) -> P2PSource:
        key = (op, dtype)
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = copy_source() if op is None else reduce_source(
                op, dtype)
        return src

    def plan(self, mode: int, count: int, itemsize: int, root: int) -> list[Step]:
        """The steps of a call (cached: the same for every call with these arguments)."""
        key = (mode, count, itemsize, root)
        steps = self._plans.get(key)
        if steps is None:
            if len(self._plans) >= 1024:
                self._plans.clear()
            # Ranks all in one process read user buffers in place, except for the calls
            # where a rank may have to take its workspace (see P2POp.own_ws): those go
            # in workspace-sized steps on every rank alike.
            whole = self.direct and mode not in (Mode.ALL_REDUCE_ONE_SHOT, Mode.ALL_TO_ALL)
            steps = self._plans[key] = plan(
                mode, count, itemsize, self.nranks, self.rank, root,
                capacity=None if whole else self.capacity, most_blocks=self.most_blocks)
        return steps

    def translated(self, exc: BaseException) -> TransportError | None:
        """``exc`` raised while enqueueing a call, as the acoll error to raise from it (the
        path's boundary: a failed CUDA call is a :class:`~acoll.TransportError`), or
        ``None`` for anything else."""
        cuda = self.cp.cuda
        if isinstance(exc, (cuda.runtime.CUDARuntimeError, cuda.driver.CUDADriverError)):
            return TransportError(f"rank {self.rank}: a CUDA call of the GPU peer-to-peer "
                                  f"path failed: {exc}")
        return None

    def submit(self, launch: Callable[[], None], timeout: float, name: str
               ) -> Awaitable[None] | None:
        """Run ``launch`` (this rank's enqueue of one call) together with the same call of
        the other local ranks (see :class:`LocalLaunch`): ``None`` when it ran now, else
        an awaitable that completes when it ran, or raises :class:`~acoll.TimeoutError`
        if the other local ranks did not make the call within ``timeout`` seconds."""
        index = self._launches
        self._launches += 1
        if self._local is None:
            launch()
            return None
        fut = self._local.submit(index, self.rank, launch)
        if fut is None:
            return None
        # Known to abort() from now on, not only once awaited (a call in a group is
        # awaited when the group exits).
        self._waiting = (index, fut)
        return self._wait_local(index, fut, timeout, name)

    async def _wait_local(self, index: int, fut: asyncio.Future[None], timeout: float,
                          name: str) -> None:
        def expire() -> None:
            if not fut.done():
                if self._local is not None:
                    self._local.withdraw(index, self.rank)
                fut.set_exception(AcollTimeoutError(
                    f"{name} did not start within {timeout:g} s on rank {self.rank}: the "
                    "other ranks of this process did not make the call"))

        if fut.done():  # (launched already: by the last local rank's call in a group)
            self._not_waiting(fut)
            fut.result()
            return
        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            await fut
        finally:
            timer.cancel()
            self._not_waiting(fut)

    def _not_waiting(self, fut: asyncio.Future[None]) -> None:
        if self._waiting is not None and self._waiting[1] is fut:
            self._waiting = None

    @property
    def failed(self) -> bool:
        """Whether a kernel recorded an error or the domain is closed (:meth:`check`
        raises)."""
        return self._failed is not None or self._freed or bool(self._flag[0])

    def check(self) -> None:
        """Raise the first error a kernel recorded (and keep raising it), or
        :class:`~acoll.ClosedError` once the domain is closed (its error rows are host
        memory freed at close: never read after)."""
        if self._failed is not None:
            raise self._failed
        if self._freed:
            raise ClosedError(f"rank {self.rank}: the communicator's GPU peer-to-peer "
                              "path was closed while a call used it")
        if not self._flag[0]:
            return
        rows = np.flatnonzero(self._err[:, 0])
        if rows.size == 0:
            return
        code, peer, phase, value, value2 = (int(x) for x in self._err[rows[0], :5])
        self._failed = self._error(code, peer, phase, value, value2)
        raise self._failed

    def _error(self, code: int, peer: int, phase: int, value: int, value2: int
               ) -> AcollError:
        where = PHASES[phase] if 0 <= phase < len(PHASES) else f"phase {phase}"
        if code == ERR_TIMEOUT:
            return AcollTimeoutError(
                f"rank {self.rank}: rank {peer} did not reach the {where} barrier of a GPU "
                f"peer-to-peer step within {self.timeout_ns / 1e9:g} s", peer)
        if code == ERR_ABORTED:
            return RemoteError(f"rank {self.rank}: a GPU peer-to-peer step was aborted "
                               f"while waiting for rank {peer} (the communicator failed)",
                               peer)
        if code == ERR_MISMATCH:
            names = {c: n for c, n in _dtype_codes().items()}
            return InvalidUsage(
                f"mismatched collectives: rank {peer} called "
                f"{describe(value, value2, names)} while rank {self.rank} called "
                f"{self.mine() or '?'}")
        return RemoteError(f"GPU peer-to-peer step failed with code {code}", peer)

    #: Describes this rank's last call, for mismatch reports (set by the launcher).
    mine: Callable[[], str] = staticmethod(lambda: "")

    # -- launch order across streams
    def follow(self, stream: Any) -> None:
        """Order what is enqueued next on ``stream`` (a CuPy stream of this device) after
        this rank's last launch, when that went to another stream: every launch of a rank
        uses its workspace and advances its epochs, so launches never overlap. Call under
        this device's context, then :meth:`mark` after the launch."""
        event = self._last_event
        if event is not None and stream.ptr != self._last_ptr:
            stream.wait_event(event)

    def mark(self, stream: Any) -> Any:
        """Record that this rank's last launch went to ``stream`` (call under this
        device's context, right after it). Returns an event that passes when that launch
        is done.

        The events come from a ring of eight, so one may be recorded again by a later
        launch while a waiter still polls it: it then passes later, never earlier (every
        launch of this rank starts after the previous one ended)."""
        ring = self._ring
        if not ring:
            ring.extend(self.cp.cuda.Event(block=False, disable_timing=True)
                        for _ in range(8))
        event = ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) & 7
        event.record(stream)
        self._last_stream, self._last_ptr, self._last_event = stream, stream.ptr, event
        return event

    def next_mark(self) -> Any:
        """The event :meth:`mark` would record next, for a native launch that records it
        itself (then :meth:`marked`)."""
        ring = self._ring
        if not ring:
            with self.cp.cuda.Device(self.device):
                ring.extend(self.cp.cuda.Event(block=False, disable_timing=True)
                            for _ in range(8))
        event = ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) & 7
        return event

    def marked(self, stream: Any, event: Any) -> None:
        """A native launch recorded ``event`` (:meth:`next_mark`) after its kernels on
        ``stream``: as :meth:`mark` would have."""
        self._last_stream, self._last_ptr, self._last_event = stream, stream.ptr, event

    def launch_failed(self, code: int, at: int) -> TransportError:
        """The error of a native launch whose driver call ``at`` returned ``code``."""
        return TransportError(f"rank {self.rank}: a CUDA call of the GPU peer-to-peer "
                              f"path failed: {AT.get(at, f'call {at}')} returned CUresult "
                              f"{code}")

    def gather_launches(self) -> None:
        """Make the communicator's stream wait for this rank's last launch (prepared calls
        launch on callers' streams), so that settling that stream covers every launch."""
        if self._last_event is not None and not self._freed:
            with self.cp.cuda.Device(self.device):
                self.follow(self.space.stream)

    @property
    def busy(self) -> bool:
        """Whether a launch of this rank may still run (or the device cannot tell)."""
        try:
            last = self._last_event
            return not self.space.stream.done or (last is not None and not last.done)
        except Exception:
            return True

    def args_for(self, step: Step, *, own_ws: bool, mode_sig: int, total: int, root: int,
                 in_ptr: int, out_ptr: int, reg: int = 0, reg_in_off: int = 0,
                 reg_out_off: int = 0) -> tuple[Any, Any]:
        """``(args, params)`` for launching ``step`` with :meth:`launch_prepared`: a
        parameter block of its own (a prepared call keeps it; each launch sets only the
        epoch)."""
        a = _Args()
        common = self._args
        a.tab, a.err, a.abort = common.tab, common.err, common.abort
        a.rank, a.nranks, a.timeout, a.regtab = (common.rank, common.nranks, common.timeout,
                                                 common.regtab)
        self._fill(a, step, own_ws, mode_sig, total, root, in_ptr, out_ptr, reg, reg_in_off,
                   reg_out_off)
        base = ctypes.addressof(a)
        params = (ctypes.c_void_p * len(_Args._fields_))(
            *(base + getattr(_Args, field[0]).offset for field in _Args._fields_))
        return a, params

    @staticmethod
    def _fill(a: Any, step: Step, own_ws: bool, mode_sig: int, total: int, root: int,
              in_ptr: int, out_ptr: int, reg: int, reg_in_off: int, reg_out_off: int) -> None:
        a.root, a.mode, a.sig, a.sig2 = root, step.mode, mode_sig, total
        a.inp, a.out, a.n, a.own_ws = in_ptr, out_ptr, step.n, own_ws
        a.out_stride, a.src_stride, a.user_stride = (step.out_stride, step.src_stride,
                                                     step.user_stride)
        a.reg, a.reg_in_off, a.reg_out_off = reg, reg_in_off, reg_out_off

    def function(self, src: P2PSource) -> int:
        """The ``CUfunction`` of ``src`` on this device, or 0 while it is not compiled
        or launches cannot go through the driver library (then :meth:`launch` only)."""
        fn = self._functions.get(src.name)
        if fn is None:
            kern = self.loaded(src)
            if kern is None or _cu_launch() is None:
                return 0
            fn = self._functions[src.name] = int(kern.kernel.ptr)
        return fn

    def launch_prepared(self, fn: int, blocks: int, args: Any, params: Any,
                        stream_ptr: int) -> None:
        """Enqueue one prepared step (:meth:`args_for`) on ``stream_ptr`` (under this
        device's context, between :meth:`follow` and :meth:`mark`)."""
        self.epoch += 1
        args.epoch = self.epoch
        rc = _libcuda[0](fn, blocks, 1, 1, THREADS, 1, 1, 0, stream_ptr, params, None)
        if rc != 0:
            raise RemoteError(f"rank {self.rank}: launching a GPU peer-to-peer kernel "
                              f"failed (CUresult {rc})", None)

    def launch(self, kern: Any, src: P2PSource, step: Step, *, own_ws: bool, mode_sig: int,
               total: int, root: int, in_ptr: int, out_ptr: int, reg: int = 0,
               reg_in_off: int = 0, reg_out_off: int = 0) -> None:
        """Enqueue one step on the communicator's stream (the caller copied its pieces;
        call under this device's context)."""
        fn = self.function(src)
        if fn:
            self._fill(self._args, step, own_ws, mode_sig, total, root, in_ptr, out_ptr, reg,
                       reg_in_off, reg_out_off)
            self.launch_prepared(fn, step.blocks, self._args, self._params,
                                 self.space.stream.ptr)
            return
        self.epoch += 1  # (no driver library: through CuPy)
        u64, i32 = np.uint64, np.int32
        kern((step.blocks,), (THREADS,), (
            u64(self._table.data.ptr), u64(self._err_dev), u64(self._abort_dev),
            i32(self.rank), i32(self.nranks), i32(root), i32(step.mode),
            i32(own_ws), u64(self.epoch), u64(self.timeout_ns), u64(mode_sig),
            u64(total), u64(in_ptr), u64(out_ptr), u64(step.n), u64(0),
            u64(step.out_stride), u64(step.src_stride), u64(step.user_stride),
            u64(self._regtab.data.ptr), u64(reg), u64(reg_in_off), u64(reg_out_off)),
            stream=self.space.stream)

    # ------------------------------------------------------------------ registration
    async def register(self, ptr: int, boot: Any) -> int:
        """Map the allocation holding device pointer ``ptr`` into every rank (collective:
        every rank calls it, in the same order, with its own buffer). Returns the index
        of the registration (the same on every rank)."""
        cp, rt = self.cp, self.cp.cuda.runtime
        if self._next_reg >= MAX_REGS:
            raise InvalidUsage(f"at most {MAX_REGS} registrations per communicator")
        record: dict[str, Any]
        try:
            with cp.cuda.Device(self.device):
                base, size = address_range(ptr)
                handle = bytes(rt.ipcGetMemHandle(base))
            record = {"ok": True, "base": base, "size": size, "handle": handle,
                      "pid": os.getpid()}
        except Exception as exc:
            record = {"ok": False, "why": f"rank {self.rank}: {exc}"}
        records = [msgpack.unpackb(r) for r in await boot.allgather(msgpack.packb(record),
                                                                    "register()")]
        bad = next((r["why"] for r in records if not r["ok"]), "")
        if bad:
            raise InvalidUsage(f"cannot register the buffer for peer access: {bad}")
        index = self._next_reg
        self._next_reg += 1
        row = np.zeros(MAXR, np.uint64)
        opened: list[bytes] = []
        me = records[self.rank]
        try:
            with cp.cuda.Device(self.device):
                for p, r in enumerate(records):
                    if p == self.rank or r["pid"] == me["pid"]:
                        row[p] = r["base"]
                    else:
                        row[p] = _open_ipc(cp, r["handle"])
                        opened.append(r["handle"])
                rt.memcpyAsync(int(self._regtab.data.ptr) + index * MAXR * 8,
                               row.ctypes.data, row.nbytes, 1, self.space.stream.ptr)
        except BaseException:
            for h in opened:
                _close_ipc(cp, h)
            raise
        await self.space.settle(asyncio.get_running_loop().time() + self.timeout_ns / 1e9)
        self._regs.append(_Registration(index, me["base"], me["size"], opened))
        self.generation += 1
        log.info("rank %d: registered %d bytes at %#x as #%d", self.rank, me["size"],
                 me["base"], index)
        return index

    async def deregister(self, index: int, boot: Any) -> None:
        """Forget registration ``index`` and unmap the peers' allocations (collective)."""
        reg = next((r for r in self._regs if r.index == index), None)
        if reg is None:
            raise InvalidUsage(f"no registration #{index} on this communicator")
        self._regs.remove(reg)
        self.generation += 1
        self.gather_launches()  # (a prepared call's kernel may still read it)
        await self.space.settle(asyncio.get_running_loop().time() + self.timeout_ns / 1e9)
        await boot.barrier()  # every rank's kernels that could read it are done
        for h in reg.opened:
            _close_ipc(self.cp, h)

    def registered(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """``(index, byte offset)`` of a registration holding ``[ptr, ptr + nbytes)``."""
        for reg in self._regs:
            if reg.base <= ptr and ptr + nbytes <= reg.base + reg.size:
                return reg.index, ptr - reg.base
        return None

    @property
    def workspace(self) -> int:
        """Device address of this rank's workspace."""
        return self._block + SIGNAL_BYTES

    # ------------------------------------------------------------------ ending
    def abort(self, error: AcollError | None = None) -> None:
        """Make every kernel of this rank that waits for a peer give up now, and a call
        waiting for the other local ranks fail with ``error``."""
        if not self._freed:
            self._abort[0] = 1
        waiting = self._waiting
        if waiting is not None:
            index, fut = waiting
            if self._local is not None:
                self._local.withdraw(index, self.rank)
            if not fut.done():
                fut.set_exception(error or RemoteError(
                    f"rank {self.rank}: the communicator failed", None))

    def close(self) -> None:
        """Unmap the peers and free the workspace (after the last step finished; a domain
        whose stream is still busy after an abort keeps its memory instead)."""
        if self._freed:
            return
        self._freed = True
        if self._local is not None:
            self._local.users -= 1
            if self._local.users <= 0:
                _local_groups.pop(self._local_key, None)
            self._local = None
        cp = self.cp
        if self.busy:
            log.info("rank %d: P2P workspace kept (a step is still running)", self.rank)
            return
        for handle in self._handles:
            _close_ipc(cp, handle)
        self._handles.clear()
        for reg in self._regs:
            for handle in reg.opened:
                _close_ipc(cp, handle)
        self._regs.clear()
        _free(cp, self.device, self._block)
        try:
            cp.cuda.runtime.freeHost(self._host_ptr)
        except Exception as exc:
            log.info("freeing P2P host memory failed: %s", exc)


def _dtype_codes() -> dict[int, str]:
    from .._dtypes import DTYPES, dtype_code
    return {dtype_code(dt): DTYPE_NAMES[dt] for dt in DTYPES}


def _free(cp: Any, device: int, ptr: int) -> None:
    try:
        with cp.cuda.Device(device):
            cp.cuda.runtime.free(ptr)
    except Exception as exc:
        log.info("freeing the P2P workspace failed: %s", exc)


def _reach(cp: Any, device: int, rank: int, records: list[dict[str, Any]]) -> str:
    """Why this rank cannot reach some peer ("" if it can reach all)."""
    rt = cp.cuda.runtime
    me = records[rank]
    if len(records) > MAXR:
        return f"{len(records)} ranks (the path supports up to {MAXR})"
    for p, r in enumerate(records):
        if p == rank:
            continue
        try:
            peer_dev = int(rt.deviceGetByPCIBusId(r["bus"]))
        except Exception:
            return f"rank {p}'s GPU {r['bus']} is not visible to rank {rank}"
        if (r["pid"], r["loop"]) != (me["pid"], me["loop"]) and peer_dev == device:
            return (f"ranks {rank} and {p} share GPU {r['bus']} from different processes "
                    "or event loops")
        if peer_dev != device and not rt.deviceCanAccessPeer(device, peer_dev):
            return f"cuda:{device} cannot access cuda:{peer_dev} (no P2P)"
    return ""
