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

Ranks sharing one GPU must be in one process: across processes their kernels would
time-slice, and a kernel spinning at a barrier for a peer's kernel that cannot run until
the slice ends turns every step into milliseconds.

The domain then launches the kernels of :mod:`acoll._cuda.p2p_kernels` on the
communicator's stream. Errors the kernels record (a peer that never arrived, an abort,
a mismatched call) are read from host-mapped memory after each call and raised as
:class:`~acoll.TimeoutError` / :class:`~acoll.RemoteError` / :class:`~acoll.InvalidUsage`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from typing import Any

import msgpack
import numpy as np

from .._config import Setting, get_logger, parse_bool, parse_size
from .._cuda.kernels import NVRTC_OPTIONS
from .._cuda.p2p_kernels import (
    ERR_ABORTED,
    ERR_MISMATCH,
    ERR_TIMEOUT,
    ERR_WORDS,
    MAX_BLOCKS,
    MAXR,
    PHASES,
    SIGNAL_BYTES,
    THREADS,
    P2PSource,
    copy_source,
    reduce_source,
)
from .._dtypes import DTYPE_NAMES, ReduceOp
from ..errors import AcollError, InvalidUsage, RemoteError
from ..errors import TimeoutError as AcollTimeoutError
from .plan import Step, describe

__all__ = ["BLOCKS", "BUFFER", "DISABLE", "ONE_SHOT_MAX", "P2PDomain"]

log = get_logger("P2P")

DISABLE = Setting("P2P_DISABLE", parse_bool, False,
                  "Never use the intra-host GPU path (peer access / CUDA IPC kernels).", "P2P")
BUFFER = Setting("P2P_BUFFER", parse_size, 32 << 20,
                 "Device workspace per GPU rank for the P2P path (bytes; copy mode moves "
                 "calls through it in steps of this size).", "P2P")
BLOCKS = Setting("P2P_BLOCKS", int, 64, "Most thread blocks per P2P kernel launch.", "P2P")
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
        self._abort = np.frombuffer(raw, np.uint32, 1, MAX_BLOCKS * ERR_WORDS * 8)
        self._err[:] = 0
        self._abort[0] = 0
        self._err_dev = self._device_pointer(self._host_ptr)
        self._abort_dev = self._err_dev + MAX_BLOCKS * ERR_WORDS * 8
        self._failed: AcollError | None = None
        self._freed = False
        self.timeout_ns = 0

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
        try:
            dom._map(records)
        except BaseException:
            dom.close()
            raise
        dom.timeout_ns = int(timeout * 1e9) + 2_000_000_000
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
            self.space.stream.synchronize()  # small, once: the table is in place

    # ------------------------------------------------------------------ running
    async def kernel(self, src: P2PSource) -> Any:
        """The kernel of ``src`` for this device (compiled off the loop thread once)."""
        kern = _kernels.get((src.name, self.device))
        if kern is None:
            kern = await asyncio.to_thread(_compile, src, self.device)
        return kern

    def source(self, op: ReduceOp | None, dtype: Any) -> P2PSource:
        return copy_source() if op is None else reduce_source(op, dtype)

    def check(self) -> None:
        """Raise the first error a kernel recorded (and keep raising it)."""
        if self._failed is not None:
            raise self._failed
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
                f"{self._mine or '?'}")
        return RemoteError(f"GPU peer-to-peer step failed with code {code}", peer)

    _mine = ""

    def launch(self, kern: Any, step: Step, *, mode_sig: int, total: int, root: int,
               in_ptr: int, out_ptr: int, mine: str) -> None:
        """Enqueue one step on the communicator's stream (the caller copied its pieces)."""
        self.epoch += 1
        self._mine = mine
        u64, i32 = np.uint64, np.int32
        kern((step.blocks,), (THREADS,), (
            u64(self._table.data.ptr), u64(self._err_dev), u64(self._abort_dev),
            i32(self.rank), i32(self.nranks), i32(root), i32(step.mode), i32(self.direct),
            u64(self.epoch), u64(self.timeout_ns), u64(mode_sig), u64(total),
            u64(in_ptr), u64(out_ptr), u64(step.n), u64(0), u64(step.out_stride),
            u64(step.src_stride)), stream=self.space.stream)

    @property
    def workspace(self) -> int:
        """Device address of this rank's workspace."""
        return self._block + SIGNAL_BYTES

    # ------------------------------------------------------------------ ending
    def abort(self) -> None:
        """Make every kernel of this rank that waits for a peer give up now."""
        if not self._freed:
            self._abort[0] = 1

    def close(self) -> None:
        """Unmap the peers and free the workspace (after the last step finished; a domain
        whose stream is still busy after an abort keeps its memory instead)."""
        if self._freed:
            return
        self._freed = True
        cp = self.cp
        busy = False
        try:
            busy = not self.space.stream.done
        except Exception:
            busy = True
        if busy:
            log.info("rank %d: P2P workspace kept (a step is still running)", self.rank)
            return
        for handle in self._handles:
            _close_ipc(cp, handle)
        self._handles.clear()
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
        if r["pid"] != me["pid"] and peer_dev == device:
            return (f"ranks {rank} and {p} share GPU {r['bus']} from different processes")
        if peer_dev != device and not rt.deviceCanAccessPeer(device, peer_dev):
            return f"cuda:{device} cannot access cuda:{peer_dev} (no P2P)"
    return ""
