"""The communicator: init, collectives, groups, split, close and abort.

The parts live in :mod:`acoll._comm`: peer connections over a transport chosen per peer
(``peers``), numbering and running ops with groups and deadlines (``executor``), order and
descriptor checks (``ordering``), the rooted-op agreement (``agreement``) and argument
adaptation (``args``). This module forms communicators and puts the parts together.

Execution model. Every rank must issue collectives on a communicator in the same order
(as with NCCL streams). Calls are numbered when made and run one at a time in that order
(a FIFO queue): two tasks may call collectives on one communicator concurrently, but the
order in which they *call* must match across ranks; a mismatch is detected by the
descriptor check and raised as :class:`~acoll.InvalidUsage` on every rank. Inside
``async with acoll.group():`` (or ``comm.group()``) calls on any communicator only enqueue
(they return at once, results are ready when the block exits) and then run concurrently,
like ``ncclGroupStart/End`` (:mod:`acoll._comm.groups`).

Memory. A communicator made with ``device=k`` takes GPU buffers on CUDA device ``k``
(:mod:`acoll._memory.cuda`): its ops run on its own stream, fitted into the caller's stream
(``stream=``, or CuPy's current stream), and its connections over transports that move host
memory only are staged through pinned host buffers (:mod:`acoll._transport.staged`).

Failure model. Any failure on one rank (a peer's connection dropping, a deadline, a
mismatch, an abort, a cancelled op) puts the communicator in a failed state: every pending
and later call raises the same error, and every connected peer is told, so failures
flood the job and nothing hangs. A failed communicator cannot be repaired; close it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import resource
import socket
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, NoReturn, ParamSpec, TypeVar

import msgpack
import numpy as np

from ._bootstrap.ring import Bootstrap, error_to_wire
from ._bootstrap.root import RootServer, listen_socket, start_root
from ._bootstrap.wire import Address
from ._coll import algorithms as algos
from ._coll.base import ANY_SEQ, Coll, Descriptor, OpContext
from ._comm.args import as_int, buffer_pair, check_peer, check_root, descriptor
from ._comm.executor import Algorithm, Executor, MakeAlgorithm
from ._comm.groups import Group
from ._comm.groups import current as current_group
from ._comm.lane import (
    ZERO_COPY_MIN,
    AllReducePlan,
    Lane,
    LanePlan,
    StepPlan,
    Steps,
    ZeroCopyAllGather,
    ZeroCopyAllReduce,
    ZeroCopyBroadcast,
    ZeroCopyReduceScatter,
    all_gather_steps,
    all_reduce_one_shot_steps,
    all_reduce_steps,
    all_to_all_steps,
    broadcast_steps,
    lane_size,
    one_shot_max,
    one_shot_step,
    one_shot_steps_max,
    reduce_scatter_steps,
)
from ._comm.native_ring import (
    NATIVE,
    NativeRing,
    NativeRingAllGather,
    NativeRingAllReduce,
    NativeRingReduceScatter,
    native_record,
)
from ._comm.ordering import SEQ_MASK, OrderChecker, p2p_tag
from ._comm.peers import PeerLinks, error_for_lost
from ._comm.probe import (
    PeerState,
    answer,
    ask,
    is_desc_check,
    is_probe,
    send_desc_check,
    take,
)
from ._comm.selfp2p import SelfPairs, SelfRecv, SelfSend
from ._comm.via_host import (
    STAGE_COUNTERS,
    STAGE_PIECE,
    CallerCopies,
    DirectCall,
    DirectLarge,
    DirectPlan,
    NativeCopies,
    RingStaging,
    ViaHost,
    native_pipelines,
    pipelines,
)
from ._config import (
    TIMEOUT,
    Setting,
    get_logger,
    parse_bool,
    parse_size,
    seconds_argument,
)
from ._cuda.p2p_kernels import Mode
from ._deadline import deadline_after, wait_until
from ._dtypes import (
    ReduceOp,
    avg_factor,
    check_op_dtype,
    dtype_code,
    empty_bytes,
    prescales,
    scale_into,
    use_native_halves,
)
from ._memory import (
    Buffer,
    DirectStaging,
    Fence,
    HostSpace,
    MemoryKind,
    MemorySpace,
    SignalledStaging,
    StreamOrder,
    shared,
)
from ._native import NativeLib
from ._native import load_async as load_native
from ._net.interfaces import find_interfaces
from ._offloop import in_thread
from ._p2p.ops import P2POp, Sequencer
from ._transport.base import Connection, ConnectionLost, Listener, PeerInfo, Transport
from ._transport.select import plugins as net_plugins
from ._transport.select import select_transports
from ._transport.tcp import TcpTransport
from ._uid import UniqueId

if TYPE_CHECKING:
    from ._p2p.domain import P2PDomain
    from ._p2p.fast import PreparedCalls
from .errors import (
    AcollError,
    BootstrapError,
    ClosedError,
    InvalidUsage,
    RemoteError,
    again,
)
from .errors import TimeoutError as AcollTimeoutError

__all__ = ["Communicator", "Registration", "get_unique_id", "init_rank"]

log = get_logger("INIT")

COMM_ID = Setting("COMM_ID", str, "",
                  "host:port of the root; rank 0 hosts it there (like NCCL_COMM_ID).", "INIT")
CHECK = Setting("CHECK", parse_bool, True,
                "Check that every rank runs the same collective (count, dtype, op, root).",
                "COLL")

SPIN_US = Setting("SPIN_US", float, 25.0,
                  "Microseconds to busy-poll for a small op's message before sleeping in the "
                  "event loop (peers in other processes only, with a core per local rank).",
                  "NET", lo=0, hi=1e6)

VIA_HOST_MAX = Setting("GPU_VIA_HOST_MAX", parse_size, -1,
                       "A device all_reduce of up to this many bytes that has no intra-host "
                       "GPU path runs the host algorithm on one page-locked copy (one "
                       "download, the reduction on the host, one upload) instead of staging "
                       "every message; 0 turns that off. Default (auto): 64 MiB when every "
                       "peer of this rank is reached over a transport that stages device "
                       "memory (sockets, shared memory), else 64 KiB.", "COLL")
VIA_HOST_PIPELINE = Setting("GPU_VIA_HOST_PIPELINE", parse_bool, True,
                            "Through the host, on the ring, above 1 MiB: download the "
                            "input in pieces "
                            "as the ring first reads them and upload each piece of the "
                            "result once final (0: one copy each way).", "COLL")
VIA_HOST_AUTO_STAGED = 64 << 20
VIA_HOST_AUTO_DIRECT = 64 << 10
_VIA_DIRECT_MAX = 64 << 10  # calls up to this size keep a page-locked copy of their own

_LANE_RANKS = 8  # the lane connects every pair of ranks (a shared segment each)
_LANE_PLANS = 64
_VIA_PLANS = 16
_LINGER = 5.0
_FAILED_LINGER = 0.5
_PROC = os.urandom(8)  # this process, among all processes of the job (see PeerInfo)


def _new_proc_id() -> None:
    global _PROC
    _PROC = os.urandom(8)


os.register_at_fork(after_in_child=_new_proc_id)  # a forked child is another process


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _announced(fn: Callable[Concatenate[Communicator, _P], Coroutine[Any, Any, _R]]
               ) -> Callable[Concatenate[Communicator, _P], Coroutine[Any, Any, _R]]:
    """A collective whose misuse on one rank is announced to every rank.

    The peers are already inside the call (or about to be) and would wait for this rank
    until the deadline: an :class:`InvalidUsage` raised here (a bad buffer, a root out of
    range) fails the communicator everywhere, naming this rank, before it is raised.
    """

    @functools.wraps(fn)
    async def call(self: Communicator, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._on_own_loop(fn.__name__)  # (before the try: a foreign loop fails nothing)
        try:
            return await fn(self, *args, **kwargs)
        except InvalidUsage as exc:
            if self.error is None and not self._closed:
                self.fail(InvalidUsage(f"rank {self.rank} made an invalid "
                                       f"{fn.__name__} call: {exc}"))
            raise
        except AcollError:
            raise
        except Exception as exc:
            # Not acoll's: an object of the caller's that failed (say, an __index__ or a
            # property), or a defect. It leaves the call half made: fail the communicator
            # so that the peers learn at once instead of at their deadline.
            if self.error is None and not self._closed:
                self.fail(RemoteError(f"rank {self.rank}'s {fn.__name__} call failed: "
                                      f"{exc!r}", self.rank))
            raise

    return call  # type: ignore[return-value]  # (self is positional in callers)


def _host_hash() -> int:
    """DJB2a-style hash of the host name (cut at the first '.') and boot id."""
    name = socket.gethostname().split(".")[0]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            name += f.read().strip()
    except OSError:
        pass
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def get_unique_id(*, ifname: str | None = None,
                  family: socket.AddressFamily | None = None) -> UniqueId:
    """Make a new id and start its root server (NCCL's ``ncclGetUniqueId``).

    The root listens on the first interface chosen by NCCL's rules (``ACOLL_SOCKET_IFNAME``,
    ``ACOLL_SOCKET_FAMILY``). It runs as a task in the running loop, or in a background
    thread's loop when called from synchronous code, and stops once its communicator is
    formed. With ``ACOLL_COMM_ID`` set, no root starts here: the id names that address and
    rank 0 hosts the root during :func:`init_rank`.
    """
    comm_id = COMM_ID.resolve()
    if comm_id:
        try:
            return UniqueId.from_address(comm_id)
        except InvalidUsage as exc:
            raise InvalidUsage(f"ACOLL_COMM_ID: {exc}") from exc
    iface = find_interfaces(ifname, family)[0]
    sock = listen_socket(iface.sockaddr(0), iface.family)
    name = sock.getsockname()
    uid = UniqueId.new(name[0], name[1], iface.scope_id)
    start_root(RootServer(sock, uid.job_key, TIMEOUT.resolve()))
    log.info("unique id %r made on %s", uid, iface.name)
    return uid


def group() -> contextlib.AbstractAsyncContextManager[None]:
    """A group across communicators (``ncclGroupStart``/``ncclGroupEnd``).

    Collectives and send/recv called on any communicator inside ``async with
    acoll.group():`` (by this task, or by tasks it starts in the block) return at once and
    run together when the block exits; their buffers hold results after it. This is how
    one task drives several ranks, one per GPU, as the seed article's program does::

        async with acoll.group():
            for comm, buf in zip(comms, bufs):
                await comm.all_reduce(buf)

    The exit raises the first error of any call. If the block raises, its calls never run
    and each communicator they were made on fails (as a cancelled call fails it). Nested
    groups (``comm.group()`` included) join the outermost one. ``close()``, ``split()``,
    ``register()`` and ``deregister()`` are refused inside a group.
    """
    return Group()


async def init_rank(nranks: int, uid: UniqueId | bytes, rank: int, *,
                    device: int | None = None, timeout: float | None = None,
                    ifname: str | None = None, net: str | None = None,
                    check: bool | None = None) -> Communicator:
    """Join communicator ``uid`` as ``rank`` of ``nranks`` (NCCL's ``ncclCommInitRank``).

    Args:
        nranks: the number of ranks; every rank must pass the same value.
        uid: the id from :func:`get_unique_id` on one rank (or its 128 bytes).
        rank: this rank, ``0 <= rank < nranks``; each rank exactly once.
        device: the CUDA device (an int) whose buffers this rank's collectives take
            (CuPy arrays, torch CUDA tensors, anything with ``__cuda_array_interface__``
            or a CUDA ``__dlpack__``); ``None`` (default): host buffers. Ranks of one
            process may use different devices, or share one.
        timeout: deadline in seconds for every network wait (default ``ACOLL_TIMEOUT``).
        ifname: interface rules overriding ``ACOLL_SOCKET_IFNAME``.
        net: data network overriding ``ACOLL_NET``.
        check: descriptor checks overriding ``ACOLL_CHECK``.

    Raises:
        InvalidUsage: bad arguments (``device`` not a visible GPU), a rank claimed twice,
            ranks disagreeing on nranks.
        acoll.TimeoutError: not every rank arrived within the timeout.
        BootstrapError: the root could not be reached.
        acoll._cuda.CudaUnavailable: ``device`` given but CuPy cannot be imported.
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        uid = UniqueId.from_bytes(uid)
    if not isinstance(uid, UniqueId):
        raise InvalidUsage(f"uid must be an acoll.UniqueId or its 128 bytes, not "
                           f"{type(uid).__name__}")
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise InvalidUsage(f"nranks must be a positive int, got {nranks!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nranks:
        raise InvalidUsage(f"rank must be an int in [0, {nranks}), got {rank!r}")
    _raise_nofile_once()
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)
                               or device < 0):
        raise InvalidUsage(f"device must be a CUDA device number or None, got {device!r}")
    mem = HostSpace() if device is None else device_space(device)
    timeout = TIMEOUT.resolve(None if timeout is None else seconds_argument(timeout))
    start = time.perf_counter()
    iface = find_interfaces(ifname, uid.family, uid.host if uid.from_env else None)[0]
    root: RootServer | None = None
    if uid.from_env and rank == 0:
        try:
            sock = listen_socket(uid.sockaddr, uid.family, reuse=True)
        except OSError as exc:
            raise BootstrapError(f"rank 0 cannot host the root at {uid!r}: {exc}") from exc
        root = RootServer(sock, uid.job_key, timeout)
        start_root(root)
    sockaddr = iface.sockaddr(0)

    async def join(make_info: Callable[[Address], bytes]) -> tuple[Bootstrap, list[bytes]]:
        boot = await Bootstrap.create(rank=rank, nranks=nranks, key=uid.job_key,
                                      root=uid.sockaddr, listen=sockaddr,
                                      family=iface.family, host_hash=_host_hash(),
                                      timeout=timeout, make_info=make_info)
        try:
            infos = boot.infos or await boot.allgather(
                make_info(boot.addr), "the all-gather of the ranks' info records")
        except BaseException:
            boot.abort()
            raise
        boot.gathered()
        return boot, infos

    try:
        comm = await Communicator._form(join, sockaddr, iface.family, timeout,
                                        key=uid.job_key, net=net, check=check, mem=mem,
                                        nranks=nranks)
    except BaseException as exc:
        if root is not None:  # tell the ranks that came; free the fixed port at once
            root.abandon(rank, exc)
        raise
    log.info("rank %d/%d ready in %.1f ms", rank, nranks, (time.perf_counter() - start) * 1e3)
    return comm


class Communicator:
    """A group of ranks that run collectives together. Create with :func:`init_rank`.

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: the number of ranks.
        device: the CUDA device of its buffers, or ``None`` (host buffers).
        local_rank / local_size: position among, and number of, ranks on this host.
    """

    def __init__(self, boot: Bootstrap, endpoints: list[tuple[Transport, Listener]],
                 infos: list[PeerInfo], timeout: float, check: bool,
                 mem: MemorySpace | None = None) -> None:
        self._boot = boot
        self.rank = boot.rank
        self.size = boot.nranks
        self.mem: MemorySpace = HostSpace() if mem is None else mem
        self.device: int | None = self.mem.device
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()  # (its calls must come from this loop)
        self.check = check
        hosts = [info.host_hash for info in infos]
        self.local_rank = hosts[: self.rank].count(hosts[self.rank])
        self.local_size = hosts.count(hosts[self.rank])
        self.chunk_bytes = algos.CHUNK.resolve()
        self.ring_chunks = algos.RING_CHUNKS.resolve()
        self.ring_chunk_max = algos.RING_CHUNK_MAX.resolve()
        self.hd_chunks = algos.HD_CHUNKS.resolve()
        self.small = algos.SMALL.resolve()
        self._algo = algos.ALGO.resolve()
        # Busy-poll budget per wait, per peer: only for peers in other processes, and only
        # when this host has a core per local rank (spinning on a shared core slows the
        # very peer we wait for; ranks in this process can never answer while we spin).
        spin = SPIN_US.resolve()
        spare = self.local_size <= (os.cpu_count() or 1)
        me = infos[self.rank]
        self.spin_ns = [int(spin * 1000) if spare and not me.same_process(info) else 0
                        for info in infos]
        self._error: AcollError | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # set while close() runs
        #: futures set once it fails or is aborted (a split() forming a child waits on one)
        self._ended: list[asyncio.Future[None]] = []
        self._split_seq = 0
        self._p2p: P2PDomain | None = None  # the intra-host GPU path, if formed
        self._prepared: PreparedCalls | None = None  # its prepared calls (_p2p/fast.py)
        self._native: NativeRing | None = None  # large TCP all_reduces in C (_form)
        self._via_host_max = VIA_HOST_MAX.resolve() if self.mem.device is not None else 0
        self._via_pipe = bool(self._via_host_max) and VIA_HOST_PIPELINE.resolve()
        # (the native ring's copies through counters: "", or which go in pieces)
        self._via_counters = STAGE_COUNTERS.resolve() if self._via_pipe else ""
        self._via_piece = STAGE_PIECE.resolve() if self._via_counters else 0  # (0: auto)
        self._host_mem = HostSpace()  # for device ops run on host copies (and scratch)
        # small device all_reduces run on the host, by (count, dtype, op): a page-locked
        # copy of their own and the algorithm's choice (see _via_host_direct)
        self._via_plans: dict[tuple[int, Any, ReduceOp], DirectPlan] = {}
        staging = self.mem.staging() if self._via_host_max else None
        self._via_direct = isinstance(staging, DirectStaging)
        self._via_auto = self._via_host_max < 0  # resolved at the first call (_via_limit)
        self._p2p_seq = Sequencer()
        self._p2p_send: defaultdict[int, int] = defaultdict(int)
        self._p2p_recv: defaultdict[int, int] = defaultdict(int)
        self._self_pairs = SelfPairs(self.rank, self.check_usable)  # sends/recvs to self
        self._checker = OrderChecker(self.rank, check, self.fail, lambda: self._exec.seq,
                                     lambda: self._error is None and not self._closed)
        self._exec = Executor(self, self._checker)
        self._exec.check_group = self._self_pairs.check_group
        limit = lane_size(infos, self.mem.device is None) if self.size <= _LANE_RANKS else 0
        self._lane = Lane(self.rank, self.size, limit) if limit else None
        # all_reduce plans through the lane, reused by calls on NumPy arrays of the same
        # (dtype, count, op); they hold views of the mailboxes, never a user's array
        self._lane_plans: dict[tuple[Any, int, Any], _LanePlans | _ScaledLaneCall] = {}
        #: idle host memory for AVG's scaled inputs of its own (see _scale_avg)
        self._avg_spares: list[np.ndarray[Any, Any]] = []
        self._links = PeerLinks(self.rank, infos, endpoints, timeout, self._on_conn_lost,
                                self._on_arrival, self.fail, self.mem.staging())
        boot.on_failure = self.fail
        if boot.error is not None:  # (failed during the formation, before the hook was set:
            self.fail(boot.error)  # found by review, session 58: a rank waited its deadline)

    # ------------------------------------------------------------------ formation
    @classmethod
    async def _form(cls, join: Callable[[Callable[[Address], bytes]],
                                        Awaitable[tuple[Bootstrap, list[bytes]]]],
                    sockaddr: tuple[Any, ...], family: socket.AddressFamily, timeout: float,
                    *, key: bytes, net: str | None, check: bool | None,
                    mem: MemorySpace | None = None, nranks: int = 0) -> Communicator:
        """Set up the transports, then ``join`` the bootstrap and learn every rank's info.

        ``join(make_info)`` returns the bootstrap and all ranks' info records, in rank order
        (from the root's table, or an all-gather); ``make_info(boot_addr)`` builds ours.
        """
        endpoints: list[tuple[Transport, Listener]] = []
        if not net_plugins.cache_info().currsize:
            await in_thread(net_plugins)  # (the once-per-process scan, off the loop)
        try:
            for transport in select_transports(sockaddr, family, timeout=timeout, key=key,
                                               net=net, nranks=nranks):
                endpoints.append((transport, await transport.listen()))
        except BaseException:
            _release(endpoints)
            raise
        host_hash = _host_hash() & 0x7FFFFFFFFFFFFFFF
        loop_id = id(asyncio.get_running_loop())
        p2p = _p2p_wanted(mem)
        try:
            native = await _native_lib(endpoints, mem)
        except BaseException:
            _release(endpoints)
            raise
        native_rec = native_record(native, algos.SMALL.resolve(), None if mem is None or
                                   mem.kind == MemoryKind.HOST else VIA_HOST_MAX.resolve())

        def make_info(boot_addr: Address) -> bytes:
            return msgpack.packb({"host_hash": host_hash, "pid": os.getpid(), "proc": _PROC,
                                  "loop": loop_id, "boot": list(boot_addr), "p2p": p2p,
                                  "native": native_rec,
                                  "handles": {t.name: lis.handle for t, lis in endpoints}})

        try:
            boot, raw = await join(make_info)
        except BaseException:
            _release(endpoints)
            raise
        try:
            infos, addrs = _parse_infos(raw)
            boot.set_peer_addrs(addrs)
            comm = cls(boot, endpoints, infos, timeout, CHECK.resolve(check), mem)
            comm.check_usable()  # (the bootstrap may have failed already)
            if native is not None:
                min_bytes = NativeRing.usable(
                    [msgpack.unpackb(r).get("native") for r in raw],
                    [t for t, _ in endpoints], infos)
                if min_bytes is not None:
                    comm._native = NativeRing(native, comm._links, comm.rank, comm.size,
                                              min_bytes, comm.small, timeout)
                log.info("rank %d: native ring %s", comm.rank,
                         "on" if comm._native is not None else
                         "off (not every rank has it, or a ring edge is not over TCP)")
        except BaseException:
            _release(endpoints)
            boot.abort()
            raise
        try:
            if comm.size > 1:
                ring = sorted({(comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size})
                try:
                    await wait_until(asyncio.gather(*(comm.connection(p) for p in ring)),
                                     deadline_after(timeout), "ring connections")
                except AcollTimeoutError:
                    late = [p for p in ring if not comm.connected(p)] or ring
                    raise AcollTimeoutError(
                        f"rank {comm.rank} could not connect to its ring neighbour"
                        f"{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} within "
                        f"{timeout:g} s (still in init_rank, or stopped?)",
                        late[0] if len(late) == 1 else None) from None
            if comm._lane is not None:
                await wait_until(comm._lane.setup(comm), deadline_after(timeout),
                                 "shared-memory lane connections")
                comm._exec.announce = comm._lane.announce
            # Every rank sees the same records, so all of them try the P2P path or none.
            # (Short-circuits on this rank's own wish, which is in every rank's list.)
            if p2p and comm.size > 1 and len({i.host_hash for i in infos}) == 1 and all(
                    msgpack.unpackb(r).get("p2p", False) for r in raw):
                from ._p2p.domain import P2PDomain
                from ._p2p.fast import PREPARED, PreparedCalls
                comm._p2p = await P2PDomain.establish(comm.mem, comm.rank, comm.size, boot,
                                                      timeout)
                if comm._p2p is not None and PREPARED.resolve():
                    comm._prepared = PreparedCalls(comm, comm._p2p)
        except BaseException as exc:
            if isinstance(exc, AcollError):  # (the peers learn why, not only that it left)
                comm.fail(exc)
            comm.abort()
            raise
        return comm

    # ------------------------------------------------------------------ what ops use
    async def connection(self, peer: int) -> Connection:
        """The connection to ``peer`` (made on first use, over the transport chosen for
        that pair)."""
        conn = self._links.conns.get(peer)
        if conn is not None:
            return conn
        self.check_usable()
        return await self._links.get(peer)

    def transport_name(self, peer: int) -> str | None:
        """The name of the transport that carries traffic with ``peer`` (``None``: self)."""
        transport = self._links.transport_for(peer)
        return None if transport is None else transport.name

    def peer_error(self, peer: int, exc: ConnectionLost) -> AcollError:
        if self._error is not None:
            return self._error
        if exc.orderly:
            err: AcollError = RemoteError(f"rank {peer} closed the communicator", peer)
        else:
            err = RemoteError(f"rank {peer} is gone: {exc}", peer)
        self.fail(err)
        return err

    def _on_arrival(self, peer: int, tag: int, meta: bytes) -> None:
        """A message came before its receive: a peer's probe (its op timed out waiting
        for us) is answered here, and a probe's or descriptor check's descriptor compared
        with the op this rank runs (see acoll._comm.probe); the rest goes to the checks."""
        probe = is_probe(tag)
        if probe or is_desc_check(tag):
            conn = self._links.conns.get(peer)
            if conn is not None and self._error is None and not self._closed:
                seq = (tag >> 32) & SEQ_MASK
                if probe:
                    answer(conn, tag, self._exec.probe_state(seq))
                else:
                    take(conn, tag)
                differs = self._exec.probe_mismatch(seq, peer, meta)
                if differs is not None:
                    # (the ranks chose different algorithms for different calls, so no
                    # message of the op reached a rank that could check it)
                    self.fail(InvalidUsage(differs))
            return
        self._checker.on_arrival(peer, tag, meta)

    def connected(self, peer: int) -> bool:
        return peer in self._links.conns

    def send_desc_check(self, peer: int, seq: int, desc: bytes) -> None:
        conn = self._links.conns.get(peer)
        if conn is not None and conn.failed is None:
            send_desc_check(conn, seq, desc)

    def probe_peer(self, peer: int, seq: int, wait: float, desc: bytes
                   ) -> Awaitable[PeerState | None] | None:
        conn = self._links.conns.get(peer)
        if conn is None or conn.failed is not None:
            return None
        return ask(conn, seq, wait, desc)

    def _on_conn_lost(self, peer: int, lost: ConnectionLost) -> None:
        if self._closed or self._error is not None:
            return
        err = error_for_lost(peer, lost)
        if err is None:
            log.info("rank %d: rank %d closed the communicator", self.rank, peer)
            return
        self.fail(err)

    # ------------------------------------------------------------------ failure
    def check_usable(self) -> None:
        """Raise the error that failed the communicator, or ClosedError once closed."""
        if self._error is not None:
            raise again(self._error)
        if self._closed:
            raise ClosedError("the communicator is closed")

    def fail(self, error: AcollError) -> None:
        """Put the communicator in the failed state and tell every peer (idempotent)."""
        if self._error is not None or self._closed:
            return
        self._error = error
        self._wake_ended()
        self._lane_plans.clear()
        self._avg_spares.clear()
        lane = getattr(self, "_lane", None)  # (None before the lane is made)
        if lane is not None:
            lane.abandon()  # (before any caller can touch its buffers again)
        log.info("rank %d: communicator failed: %s", self.rank, error)
        self._exec.fail_waiting()
        self._self_pairs.fail()
        self._p2p_seq.fail(error)
        if self._p2p is not None:
            self._p2p.abort(error)
        if self._native is not None:
            self._native.abort()
        wire = error_to_wire(error, self.rank)
        notice = msgpack.packb({"kind": wire.kind, "message": wire.message,
                                "rank": wire.rank})
        self._links.fail_all(notice)
        self._links.stop(error)
        self._boot.fail(error)

    def _on_own_loop(self, call: str) -> None:
        """Raise InvalidUsage unless running in the event loop this communicator was
        formed in (its sockets, futures and tasks belong to that loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            raise InvalidUsage(
                f"{call}() on rank {self.rank} was called from "
                f"{'another event loop' if loop is not None else 'outside any event loop'}; "
                "a communicator takes calls only in the loop that formed it (from another "
                "thread, use asyncio.run_coroutine_threadsafe(..., that_loop))")

    @property
    def timeout(self) -> float:
        """The deadline in seconds of each network wait this communicator makes.

        Settable: a new value applies to calls started afterwards, the ``split()`` and
        ``register()`` exchanges and the dials of connections made on first use included
        (a call already running keeps its deadline; so do the transports' handshake
        limits and the GPU peer-to-peer kernels' own timers, fixed at formation). Raises
        InvalidUsage unless a positive number.
        """
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        value = seconds_argument(value)
        self._timeout = value
        self._boot.timeout = value
        self._links.timeout = value
        if self._native is not None:
            self._native.timeout = value

    @property
    def error(self) -> AcollError | None:
        """The error that failed this communicator, or ``None``."""
        return self._error

    def abort(self) -> None:
        """Drop every connection now. Local and immediate; peers see :class:`RemoteError`."""
        if self._closed:
            return
        self._drop_everything()

    def _drop_everything(self) -> None:
        """What abort() does; also finishes a close() interrupted half way (each step
        may run again)."""
        self._closed = True
        lane = getattr(self, "_lane", None)
        if lane is not None:
            lane.abandon()
        if self._error is None:
            self._error = ClosedError("the communicator was aborted")
        self._wake_ended()
        self._p2p_seq.fail(self._error)
        if self._p2p is not None:
            self._p2p.abort(self._error)
            self._p2p.close()
        if self._native is not None:
            self._native.abort()
        self._links.abort_all()
        self._links.stop(self._error)
        self._links.close_transports()
        self._boot.abort()
        self._links.cancel_tasks()
        self._exec.stop_watchdog()
        self._exec.fail_waiting()
        self._self_pairs.fail()
        self._release_lane()

    def _wake_ended(self) -> None:
        ended, self._ended = self._ended, []
        for fut in ended:
            if not fut.done():
                fut.set_result(None)

    def _drop_via_plans(self) -> None:
        """Give the direct calls' page-locked blocks back to the staging pool, each reused
        only after its last upload."""
        plans, self._via_plans = self._via_plans, {}
        for plan in plans.values():
            plan.drop()

    def _release_lane(self) -> None:
        """Drop the lane's plans and views (once no lane op runs any more), and AVG's
        idle host memory."""
        self._lane_plans.clear()
        self._avg_spares.clear()
        self._exec.announce = None
        if self._lane is not None:
            self._lane.release()

    async def close(self) -> None:
        """Orderly close: wait for in-flight ops on every rank, then release everything.

        Every rank must call it; it starts with a barrier. A rank that closes while its
        peers are inside another call makes them fail at once (``InvalidUsage`` naming the
        close). Resources are always released; if the closing barrier failed (a peer
        died, or did not close within the deadline), the error is raised afterwards. A
        communicator that had already failed is released without waiting for anyone.

        A second close() made while one runs waits for it to finish and returns (the
        first one's error, if any, is :attr:`error`); later ones return at once. If
        close() is cancelled (or fails outside acoll's errors) the communicator is
        aborted there and then: everything is released before the cancellation goes on.
        """
        if self._closed and (self._closing is None or self._closing.done()):
            return
        self._on_own_loop("close")
        self._not_in_group("close()")  # (before waiting: the first close waits for the block)
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            await self._close()
        except BaseException as exc:
            if not isinstance(exc, AcollError):  # cancelled, or a bug: release it all now
                self._drop_everything()
            raise
        finally:
            self._closing.set_result(None)

    async def _close(self) -> None:
        failure: AcollError | None = None
        was_failed = self._error is not None
        if not was_failed:
            try:
                await self._exec.execute(Descriptor(Coll.CLOSE, 0, 0, 0, 0),
                                         self._barrier_algo())
            except AcollError as exc:
                failure = exc
        if self._p2p is not None:
            with contextlib.suppress(AcollError):
                self._p2p.gather_launches()
                await self.mem.settle(asyncio.get_running_loop().time() + self.timeout)
            self._p2p.close()
        self._closed = True
        if self._native is not None:
            self._native.abort()  # (no call runs: the closing barrier came after them)
        self._links.stop(None)
        # A failed communicator queued its failure notice when it failed: give it a
        # moment to leave, but never wait for a peer that stopped reading.
        await self._links.close_all(_FAILED_LINGER if was_failed or failure else _LINGER)
        self._links.cancel_tasks()
        await self._links.wait_tasks()
        self._links.close_transports()
        await self._boot.close()
        self._exec.stop_watchdog()
        self._release_lane()
        self._drop_via_plans()
        if failure is not None:
            raise failure

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        if exc is not None and not isinstance(exc, AcollError):
            self.abort()  # peers must not wait in close() for a rank that crashed
        else:
            await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._error else "ok"
        return f"<acoll.Communicator rank {self.rank}/{self.size} {state}>"

    # ------------------------------------------------------------------ execution
    def group(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Run the operations issued inside together (``ncclGroupStart/End``).

        :func:`acoll.group` with this communicator in it from the start: calls on any
        communicator made in the block's context return at once; their buffers hold
        results only after the block exits (a call another task makes on this one
        meanwhile is numbered after them and returns when it ran). Nested groups join
        the outermost one.
        """
        return Group(self._exec)

    def _misused(self, call: str, exc: InvalidUsage) -> NoReturn:
        """Raise ``exc``, a bad argument of collective ``call`` (split, register,
        deregister) found before any exchange, after failing the communicator everywhere
        with it, naming this rank: the peers are in the call and would wait for this rank
        until their deadline. (Errors the ranks raise together after exchanging are not
        announced: nobody waits.)"""
        if self.error is None and not self._closed:
            self.fail(InvalidUsage(f"rank {self.rank} made an invalid {call} call: {exc}"))
        raise exc

    def _not_in_group(self, what: str) -> None:
        """Refuse a call that cannot be queued in a group (it runs at once, or waits for
        the group's calls), made inside one."""
        if current_group() is not None:
            raise InvalidUsage(f"rank {self.rank}: {what} inside a group block (the "
                               f"group's calls run when the block exits): call it after")

    async def _small_or_empty(self, desc: Descriptor, count: int) -> bool:
        """Handle 0 elements (check only).

        With checks on, a zero-element call still runs the full agreement (every rank
        learns every rank's descriptor), so that no rank returns from a call its peers
        did not make.
        """
        if count == 0:
            if self.size > 1 and self.check:
                await self._exec.execute(desc, _Nothing)
                return True
            self.check_usable()  # (a failed or closed communicator fails every call)
            if self.size > 1:
                self._exec.skip()
            return True
        return False

    async def _local_copy(self, dst: Buffer, src: Buffer, order: StreamOrder | None) -> None:
        """One rank: the result is the input (copied unless in place)."""
        self.check_usable()
        if order is not None:
            order.start()
        if not self.mem.same(dst, src):
            await self.mem.copy(dst, src, _yield)
        if order is not None:
            order.finish()
            if order.settle:
                await self.mem.settle(asyncio.get_running_loop().time() + self.timeout)

    def _ordered(self, make: MakeAlgorithm, order: StreamOrder | None) -> MakeAlgorithm:
        """``make``, fitted into the caller's stream on a device communicator."""
        if order is None:
            return make
        mem, timeout = self.mem, self.timeout
        return lambda ctx: _OnStream(make(ctx), order, mem, timeout)

    def _p2p_make(self, mode: int, name: str, s: Buffer, r: Buffer, count: int,
                  order: StreamOrder | None, *, op: ReduceOp | None = None, root: int = 0,
                  asked: ReduceOp | None = None) -> P2POp | None:
        """The call on the intra-host GPU path, or ``None`` when the communicator has none.

        Made at the call (not when the executor runs it): its launch ticket fixes the
        order in which its kernels reach the stream. ``op`` is what the kernels compute,
        ``asked`` (default ``op``) what the ranks compare: AVG for a scaled AVG's SUM."""
        dom = self._p2p
        if dom is None or order is None:
            return None
        return P2POp(dom, self._p2p_seq, order, self.timeout, dom.source(op, s.dtype),
                     dom.plan(mode, count, s.dtype.itemsize, root), s, r, root=root,
                     op=0 if op is None else int(op if asked is None else asked),
                     dtype_code=dtype_code(s.dtype),
                     total=count, name=name)

    async def _ran_prepared(self, name: str, send: Any, recv: Any, op: Any, root: Any,
                            stream: Any) -> bool:
        """Run the call as a prepared call if it is one (:mod:`acoll._p2p.fast`); False:
        nothing was done, take the general route."""
        assert self._prepared is not None
        group = current_group()
        started = self._prepared.start(name, send, recv, op, root, stream,
                                       group is not None)
        if started is False:
            return False
        if started is not True:
            if group is not None:  # launched; the group's exit awaits it
                ex = self._exec
                group.defer(ex, ex.seq - 1, started)
            else:
                await started()
        return True

    def _learn(self, name: str, send: Any, recv: Any, op: Any, root: int,
                p2p: P2POp | None) -> None:
        """Keep a P2P call's launches for later calls like it (:mod:`acoll._p2p.fast`)."""
        fast = self._prepared
        if fast is not None and p2p is not None:
            fast.learn(fast.key(name, send, recv, op, root), p2p)

    async def _execute(self, desc: Descriptor, p2p: P2POp | None, make: MakeAlgorithm
                       ) -> None:
        """Run a call: ``p2p`` when the call is on the intra-host GPU path, else ``make``.

        A P2P call made while the executor is idle (no op running or queued, no group)
        runs at once, without the executor's bookkeeping: it uses up its sequence number
        like every rank does, and its waits carry their own deadlines (the kernels',
        the stream wait's, the local launch's).
        """
        ex = self._exec
        if p2p is None:
            await ex.execute(desc, make)
            return
        if not ex.idle:
            await ex.execute(desc, lambda ctx: p2p, self_checked=True)
            return
        self.check_usable()
        ex.skip()
        await ex.run_now(desc.coll.name.lower(), ex.seq - 1, p2p.run())

    def _zero_copy_lane(self, nbytes: int) -> Lane | None:
        """The lane, checked usable, when a call on ``nbytes`` may read registered buffers
        in place (:class:`~acoll._comm.lane.ZeroCopyAllReduce` and its kin); else None."""
        lane = self._lane
        if lane is None or not lane.registered or nbytes < ZERO_COPY_MIN:
            return None
        self.check_usable()
        return lane

    def _lane_fits(self, nbytes: int) -> bool:
        """Whether a call moving ``nbytes`` to each peer runs through the lane."""
        lane = self._lane
        return lane is not None and nbytes <= lane.limit

    async def _lane_call(self, desc: Descriptor, send: Buffer | None, recv: Buffer | None,
                         op: ReduceOp = ReduceOp.SUM, root: int = 0,
                         scaling: _Scaling | None = None) -> None:
        """Run a call through the lane (:mod:`acoll._comm.lane`), ``scaling`` first."""
        self.check_usable()
        assert self._lane is not None
        await self._lane_run(_scaled_lane(
            LanePlan(self, self._lane, desc, send, recv, op, root), scaling))

    async def _lane_bytes(self, desc: Descriptor, send: Buffer, recv: Buffer,
                          steps: Steps) -> None:
        """Run a moving (not combining) collective's steps through the lane, on the
        buffers' bytes (:class:`~acoll._comm.lane.StepPlan`)."""
        self.check_usable()
        assert self._lane is not None
        mine = np.frombuffer(send.view(), np.uint8)
        res = mine if recv is send else np.frombuffer(recv.view(), np.uint8)
        await self._lane_run(StepPlan(self, self._lane, desc, np.dtype(np.uint8), steps),
                             mine, res)

    async def _lane_run(self, call: _LaneCalls | _ScaledLaneCall, mine: Any = None,
                        res: Any = None) -> None:
        """Run a lane call as the next op (``mine``/``res``: a reused plan's arrays).

        Made while the executor is idle (no op running or queued, no group), it runs at
        once under the executor's lock (taken without suspending: later calls and close()
        wait for it) without the rest of the executor's bookkeeping, like an idle P2P call;
        its waits carry their own deadline."""
        if self._error is not None or self._closed:
            self.check_usable()
        desc = call.desc
        ex = self._exec
        if not ex.idle:
            full = ex.seq  # (the number execute() gives it, at once)
            await ex.execute(desc, lambda ctx: _PlanAt(call, full, ctx, mine, res),
                             self_checked=True)
            return
        await ex.lock.acquire()
        try:
            full = ex.seq
            seq = full & SEQ_MASK
            ex.skip()
            self._checker.issue(seq, desc, in_group=False)
            await ex.run_now(desc.coll.name.lower(), seq, call.run(full, None, mine, res))
        finally:
            ex.lock.release()

    def _scale_avg(self, src: Buffer, dst: Buffer | None, stream: Any
                   ) -> tuple[Buffer, _Scaling | None]:
        """A floating-point AVG as NCCL runs it: this rank's input ``src`` multiplied by
        ``1/n`` (rounded to the dtype) into ``dst`` (``None``: memory of the call's own),
        then summed. Returns the buffer the op then reads, and the scaling the op runs as
        it starts (host memory: paced on the loop, in the op's turn); on a GPU the scaling
        is enqueued now on the caller's stream, ahead of the op (None)."""
        self.check_usable()  # (a failed or closed communicator leaves the buffers alone)
        scaled = self.mem.scale_at_call(stream, dst, src, self.size)
        if scaled is not None:
            return scaled, None
        if dst is not None:
            return dst, _Scaling(self.mem, dst, src, self.size)
        # Host memory of the call's own, reused by later calls (a fresh array of a few MiB
        # costs its page faults at every call): the smallest idle spare large enough, else
        # a new one; given back once its op has succeeded (after a failure a send may
        # still be reading it). At most 2 are kept, the smaller going first, none past a
        # close or a failure.
        need = src.nbytes
        spares = self._avg_spares
        fits = [i for i, a in enumerate(spares) if a.nbytes >= need]
        fit = min(fits, key=lambda i: spares[i].nbytes) if fits else None
        raw = spares.pop(fit) if fit is not None else empty_bytes(max(need, 64))

        def back() -> None:
            if self._error is None and not self._closed:
                spares.append(raw)
                if len(spares) > 2:  # (by position: == on arrays compares elements)
                    del spares[min(range(len(spares)), key=lambda i: spares[i].nbytes)]

        dst = Buffer(raw[:need].view(src.dtype), self.mem)
        return dst, _Scaling(self.mem, dst, src, self.size, back)

    def _pair(self, send: Any, recv: Any, what: str, ratio_send: int = 1,
              ratio_recv: int = 1) -> tuple[Buffer, Buffer, Any]:
        return buffer_pair(self.mem, self.rank, self.size, send, recv, what, ratio_send,
                           ratio_recv)

    # ------------------------------------------------------------------ collectives
    @_announced
    async def all_reduce(self, send: Any, recv: Any = None,
                         op: ReduceOp | str = ReduceOp.SUM, *, stream: Any = None) -> Any:
        """Reduce ``send`` across ranks into ``recv`` on every rank (in place if ``None``).

        On a GPU communicator every collective also takes ``stream=`` (a CuPy stream, a
        torch stream or a raw ``cudaStream_t``): the op starts after the work queued on it
        at the call, later work on it sees the result, and the await returns once the work
        is ordered there. Without ``stream=`` the op is ordered after CuPy's current
        stream's work and the await returns when the result can be read.
        """
        if self._prepared is not None and await self._ran_prepared(
                "all_reduce", send, recv, op, 0, stream):
            return send if recv is None else recv
        key = _plan_key(send, op) if self._lane_plans and stream is None else None
        if key is not None:
            # A call like a recent one (dtype, count, op): its lane plan, with this call's
            # arrays, when they pass the checks the general path would make.
            plan = self._lane_plans.get(key)
            flags = send.flags
            if plan is not None and flags.c_contiguous:
                if recv is None or recv is send:
                    if flags.writeable:
                        flat = send if send.ndim == 1 else send.reshape(-1)
                        await self._lane_run(plan, flat, flat)
                        return send
                elif (type(recv) is np.ndarray and recv.dtype == send.dtype
                      and recv.size == send.size and recv.flags.c_contiguous
                      and recv.flags.writeable and not np.may_share_memory(send, recv)):
                    await self._lane_run(plan, send if send.ndim == 1 else send.reshape(-1),
                                         recv if recv.ndim == 1 else recv.reshape(-1))
                    return recv
        asked = rop = ReduceOp.coerce(op)
        s, r, out = self._pair(send, recv, "all_reduce")
        check_op_dtype(rop, s.dtype, "all_reduce")
        scaling: _Scaling | None = None
        sent = s
        via = (self._via_direct and s.count and self.size > 1 and self._p2p is None
               and s.nbytes <= self._via_limit() and self._exec.idle)
        if prescales(rop, s.dtype) and s.count and self.size > 1 and self._p2p is None:
            if not (via and s.nbytes <= _VIA_DIRECT_MAX):
                # (every input scaled by 1/n into the result, then summed there in place;
                # a small direct call scales its page-locked copy instead: DirectPlan;
                # the P2P kernels scale each operand as they load it)
                s, scaling = self._scale_avg(s, r, stream)
            rop = ReduceOp.SUM
        if via:  # (still idle: nothing above awaited)
            if s.nbytes <= _VIA_DIRECT_MAX:
                await self._via_host_direct(s, r, rop, stream, asked)
                return out
            large = self._via_host_direct_large(s, r, rop, stream, asked)
            if large is not None:
                await large
                return out
        order = self.mem.order(stream)
        cls = algos.choose("all_reduce", s.nbytes, self.size, self._algo, self.small)
        desc = descriptor(Coll.ALL_REDUCE, s, asked, algo=cls)
        if await self._small_or_empty(desc, s.count):
            return out
        if self.size == 1:
            await self._local_copy(r, s, order)
            return out
        lane = self._lane
        if lane is not None:
            self.check_usable()
            made: _LanePlans
            if s.nbytes <= one_shot_max(lane):
                made = AllReducePlan(self, lane, desc, s.dtype, s.count, rop)
            elif s.nbytes <= one_shot_steps_max(lane):
                made = StepPlan(self, lane, desc, s.dtype, all_reduce_one_shot_steps(
                    lane, s.count, one_shot_step(lane) // s.itemsize), rop)
            else:
                made = StepPlan(self, lane, desc, s.dtype, all_reduce_steps(
                    lane, s.count, lane.step // s.itemsize), rop)
            if lane.registered and s.nbytes >= ZERO_COPY_MIN:
                made = ZeroCopyAllReduce(self, lane, desc, s.dtype, s.count, rop, made)
            kept: _LanePlans | _ScaledLaneCall = made
            if scaling is not None:  # (a reused plan scales the arrays of its call)
                kept = _ScaledLaneCall(made, None, self.mem, self.size)
            key = _plan_key(send, op)
            if key is not None:
                if len(self._lane_plans) >= _LANE_PLANS:  # the oldest goes
                    del self._lane_plans[next(iter(self._lane_plans))]
                self._lane_plans[key] = kept
            await self._lane_run(kept, sent.array,
                                 sent.array if r is sent or self.mem.same(r, sent) else r.array)
            return out
        one = self._p2p is not None and s.nbytes <= self._p2p.one_shot_max
        make = self._p2p_make(Mode.ALL_REDUCE_ONE_SHOT if one else Mode.ALL_REDUCE_TWO_SHOT,
                              "all_reduce", s, r, s.count, order, op=rop, asked=asked)
        if rop is asked:  # (a scaled AVG is not kept: its calls scale first)
            self._learn("all_reduce", send, recv, op, 0, make)
        if make is None and order is not None and s.nbytes <= self._via_limit():
            native = self._via_native(s, rop, cls)
            await self._execute(desc, None, self._via_host(
                lambda ctx, hs, hr: cls(ctx, hs, hr, rop), s, r, order,
                self._via_pipe and pipelines(cls, s.nbytes),
                None if native is None else (native, rop)))
        elif (self._native is not None and make is None and order is None
              and cls is algos.RingAllReduce and self._native.takes(s, rop)):
            native = self._native
            await self._execute(desc, None, _scaled_first(
                lambda ctx: NativeRingAllReduce(ctx, s, r, rop, native), scaling))
        else:
            await self._execute(desc, make, self._ordered(
                _scaled_first(lambda ctx: cls(ctx, s, r, rop), scaling), order))
        return out

    def _via_host(self, make: Callable[[OpContext, Buffer, Buffer], Algorithm], send: Buffer,
                  recv: Buffer, order: StreamOrder, ring: bool = False,
                  native: tuple[NativeRing, ReduceOp] | None = None) -> MakeAlgorithm:
        """A device op run by its host algorithm on a page-locked copy (see
        ``ACOLL_GPU_VIA_HOST_MAX`` and :mod:`acoll._comm.via_host`); ``native``: by the
        native ring instead (:meth:`_via_native`)."""
        host, mem, timeout = self._host_mem, self.mem, self.timeout
        return lambda ctx: ViaHost(ctx, make, send, recv, order, mem, host, timeout, ring,
                                   native)

    def _via_native(self, s: Buffer, rop: ReduceOp, cls: type) -> NativeRing | None:
        """The native ring, where it runs a device all_reduce of ``s`` that goes through
        the host (on one whole copy each way: :mod:`acoll._comm.via_host`). Every rank
        decides alike: the native ring of a device communicator exists only where every
        pair of ranks is joined over TCP and every rank has the same
        ``ACOLL_GPU_VIA_HOST_MAX`` (:meth:`NativeRing.usable`), so every rank sends the
        same calls through the host, and the rest is the call's own."""
        native = self._native
        if native is None or cls is not algos.RingAllReduce or not native.takes_copy_of(
                s, rop):
            return None
        return native

    def _via_limit(self) -> int:
        """``ACOLL_GPU_VIA_HOST_MAX`` for this communicator (auto: from its transports).

        Whether a call goes through the host is this rank's own choice: the host
        algorithm on the page-locked copy sends the messages the staged one would."""
        if self._via_auto:
            self._via_auto = False
            staging = self.mem.staging()
            staged_only = staging is not None and all(
                t is None or staging.kind not in t.memory_for(staging)
                for t in map(self._links.transport_for, range(self.size)))
            self._via_host_max = VIA_HOST_AUTO_STAGED if staged_only else VIA_HOST_AUTO_DIRECT
            log.info("rank %d: device all_reduce through the host up to %d bytes (%s)",
                     self.rank, self._via_host_max, "every peer's transport stages"
                     if staged_only else "a peer's transport moves device memory")
        return self._via_host_max

    async def _via_host_direct(self, s: Buffer, r: Buffer, rop: ReduceOp, stream: Any,
                               asked: ReduceOp) -> None:
        """A small device all_reduce made while the executor is idle: it starts at once
        (nothing runs before its download), so its two copies go on the caller's stream
        itself, in order after the caller's queued work with no event between streams,
        through a page-locked copy kept for calls like it (:mod:`acoll._comm.via_host`).
        A floating-point AVG (``asked``; ``rop`` SUM) scales that copy on the host before
        summing: no GPU work beyond the two copies (each piece of GPU work costs a context
        switch where processes time-slice a GPU)."""
        key = (s.count, s.dtype, asked)  # (a scaled AVG runs SUM, its descriptor says AVG)
        plans = self._via_plans
        plan = plans.pop(key, None)
        if plan is not None:
            plans[key] = plan  # (most recently used last)
        else:
            if len(plans) >= _VIA_PLANS:  # the least recently used goes
                plans.pop(next(iter(plans))).drop()
            cls = algos.choose("all_reduce", s.nbytes, self.size, self._algo, self.small)
            staging = self.mem.staging()
            assert isinstance(staging, DirectStaging)  # (_via_direct)
            plan = plans[key] = DirectPlan(
                staging, self._host_mem, s, rop, cls,
                descriptor(Coll.ALL_REDUCE, s, asked, algo=cls),
                avg_factor(s.dtype, self.size) if prescales(asked, s.dtype) else None)
        caller = plan.staging.caller_stream(stream)
        settle, host, timeout = stream is None, self._host_mem, self.timeout
        native = self._via_native(s, rop, plan.cls)
        # The download goes first: the GPU copies while the executor numbers the call (it
        # runs at once: nothing else can take the executor or the block in between).
        fence = plan.staging.download_on(caller, plan.view, s, plan.last)
        await self._exec.execute(plan.desc, lambda ctx: DirectCall(
            ctx, plan, fence, r, caller, settle, host, timeout, native))

    def _via_host_direct_large(self, s: Buffer, r: Buffer, rop: ReduceOp, stream: Any,
                               asked: ReduceOp) -> Awaitable[None] | None:
        """A larger device all_reduce made while the executor is idle: a pooled block and
        the copies on the caller's stream (:class:`~acoll._comm.via_host.DirectLarge`).
        ``None`` (nothing done) when the pool would need a new large block: the ordered
        path allocates it off the loop's thread, and later calls reuse it."""
        staging = self.mem.staging()
        assert isinstance(staging, DirectStaging)  # (_via_direct)
        caller = staging.caller_stream(stream)  # (checked before anything is leased)
        lease = staging.lease_now(s.nbytes)
        if lease is None:
            return None
        host = self._host_mem
        cls = algos.choose("all_reduce", s.nbytes, self.size, self._algo, self.small)
        desc = descriptor(Coll.ALL_REDUCE, s, asked, algo=cls)
        data = host.wrap(lease[0].array.view(s.dtype))
        # (the copies' pieces: element ranges, independent of the ring's own chunks)
        chunk = max(1, self.chunk_bytes // s.itemsize)
        # The download goes first, at the call (the executor runs the op at once).
        download: Fence | None = None
        stage: RingStaging | None = None
        copies: NativeCopies | None = None
        native = self._via_native(s, rop, cls)
        signals = (staging.signals(lease[1]) if native is not None and self._via_counters
                   and native_pipelines(s.nbytes, self.size)
                   and isinstance(staging, SignalledStaging) else None)
        if signals is not None:
            assert isinstance(staging, SignalledStaging)
            copies = NativeCopies(staging, signals, caller, s, r, lease[0], self.size,
                                  self.rank, self._via_counters, self._via_piece)
        elif (native is None and self._via_pipe and pipelines(cls, s.nbytes)
                and s.count > chunk):
            stage = RingStaging(CallerCopies(staging, caller), s, r, data, self.size,
                                self.rank, chunk)
        else:
            download = staging.download_on(caller, lease[0], s, own=True)
        call = DirectLarge(cls, rop, staging, lease, data, r, caller, download, stage,
                           stream is None, host, self.timeout, native, copies)
        return self._direct_large(desc, call)

    async def _direct_large(self, desc: Descriptor, call: DirectLarge) -> None:
        try:
            await self._exec.execute(desc, call.bind)
        finally:
            call.abandon()  # (nothing if it ran: its run gave the block back)

    @_announced
    async def broadcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> Any:
        """Copy ``root``'s ``buf`` into ``buf`` on every rank (the root's is only read: it
        may be read-only)."""
        if self._prepared is not None and await self._ran_prepared(
                "broadcast", buf, None, None, root, stream):
            return buf
        root = check_root(root, self.size)
        b = self.mem.adopt(buf, "buf", writable=self.rank != root)
        order = self.mem.order(stream)
        cls = algos.choose("broadcast", b.nbytes, self.size, self._algo, self.small)
        desc = descriptor(Coll.BROADCAST, b, 0, root, algo=cls)
        if await self._small_or_empty(desc, b.count):
            return buf
        if self.size == 1:
            self.check_usable()
            return buf
        lane = self._zero_copy_lane(b.nbytes)
        if lane is not None:
            raw = _bytes_of(b)
            fits = self._lane_fits(b.nbytes)
            await self._lane_run(ZeroCopyBroadcast(self, lane, desc, b.nbytes, root, lambda: (
                LanePlan(self, lane, desc, b, b, ReduceOp.SUM, root) if fits else StepPlan(
                    self, lane, desc, np.dtype(np.uint8),
                    broadcast_steps(lane, b.nbytes, lane.step, root)))), raw, raw)
            return buf
        if self._lane_fits(b.nbytes):
            await self._lane_call(desc, b, b, root=root)
            return buf
        if self._lane is not None:
            await self._lane_bytes(desc, b, b, broadcast_steps(
                self._lane, b.nbytes, self._lane.step, root))
            return buf
        make = self._p2p_make(Mode.BROADCAST, "broadcast", b, b, b.count, order, root=root)
        self._learn("broadcast", buf, None, None, root, make)
        await self._execute(desc, make, self._ordered(lambda ctx: cls(ctx, b, root), order))
        return buf

    @_announced
    async def reduce(self, send: Any, recv: Any = None, op: ReduceOp | str = ReduceOp.SUM,
                     root: int = 0, *, stream: Any = None) -> Any:
        """Reduce ``send`` across ranks into ``recv`` on ``root`` (``recv`` unused elsewhere).

        ``recv=None`` means in place on the root; non-root ranks' buffers are not changed.
        """
        if self._prepared is not None and await self._ran_prepared(
                "reduce", send, recv, op, root, stream):
            return send if recv is None else recv
        rop = ReduceOp.coerce(op)
        root = check_root(root, self.size)
        r: Buffer | None
        if self.rank == root:
            s, r, out = self._pair(send, recv, "reduce")
        else:
            s = self.mem.adopt(send, "send")
            r, out = None, recv if recv is not None else send
        check_op_dtype(rop, s.dtype, "reduce")
        asked, scaling = rop, None
        if prescales(rop, s.dtype) and s.count and self.size > 1 and self._p2p is None:
            # (scaled into the result on the root, elsewhere into memory of its own; the
            # P2P kernels scale each operand as they load it)
            s, scaling = self._scale_avg(s, r, stream)
            rop = ReduceOp.SUM
            if r is not None:
                r = s
        order = self.mem.order(stream)
        cls = algos.choose("reduce", s.nbytes, self.size, self._algo, self.small)
        desc = descriptor(Coll.REDUCE, s, asked, root, algo=cls)
        if await self._small_or_empty(desc, s.count):
            return out
        if self.size == 1:
            assert r is not None
            await self._local_copy(r, s, order)
            return out
        if self._lane_fits(s.nbytes):
            await self._lane_call(desc, s, r, rop, root, scaling)
            return out
        make = self._p2p_make(Mode.REDUCE, "reduce", s, s if r is None else r, s.count, order,
                              op=rop, root=root, asked=asked)
        if rop is asked:
            self._learn("reduce", send, recv, op, root, make)
        await self._execute(desc, make, self._ordered(
            _scaled_first(lambda ctx: cls(ctx, s, r, root, rop), scaling), order))
        return out

    @_announced
    async def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> Any:
        """Concatenate every rank's ``send`` into ``recv`` (``size * len(send)``, rank order).

        In place when ``send`` is this rank's block of ``recv``.
        """
        if self._prepared is not None and await self._ran_prepared(
                "all_gather", send, recv, None, 0, stream):
            return recv
        s, r, out = self._pair(send, recv, "all_gather", 1, self.size)
        order = self.mem.order(stream)
        desc = descriptor(Coll.ALL_GATHER, s)
        if await self._small_or_empty(desc, s.count):
            return out
        if self.size == 1:
            await self._local_copy(r, s, order)
            return out
        lane = self._zero_copy_lane(r.nbytes)
        if lane is not None:
            fits = self._lane_fits(s.nbytes)
            await self._lane_run(ZeroCopyAllGather(self, lane, desc, s.nbytes, lambda: (
                LanePlan(self, lane, desc, s, r) if fits else StepPlan(
                    self, lane, desc, np.dtype(np.uint8),
                    all_gather_steps(lane, s.nbytes, lane.step)))), _bytes_of(s), _bytes_of(r))
            return out
        if self._lane_fits(s.nbytes):
            await self._lane_call(desc, s, r)
            return out
        if self._lane is not None:
            block = s.nbytes
            await self._lane_bytes(desc, s, r, all_gather_steps(
                self._lane, block, self._lane.step))
            return out
        make = self._p2p_make(Mode.ALL_GATHER, "all_gather", s, r, s.count, order)
        self._learn("all_gather", send, recv, None, 0, make)
        native = self._native
        if (native is not None and make is None and order is None
                and native.takes(s, moved=r.nbytes)):
            await self._execute(desc, None, lambda ctx: NativeRingAllGather(ctx, s, r, native))
            return out
        await self._execute(desc, make, self._ordered(
            lambda ctx: algos.RingAllGather(ctx, s, r), order))
        return out

    @_announced
    async def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str = ReduceOp.SUM,
                             *, stream: Any = None) -> Any:
        """Reduce ``send`` (``size`` blocks) across ranks; block ``rank`` lands in ``recv``."""
        if self._prepared is not None and await self._ran_prepared(
                "reduce_scatter", send, recv, op, 0, stream):
            return recv
        rop = ReduceOp.coerce(op)
        s, r, out = self._pair(send, recv, "reduce_scatter", self.size, 1)
        check_op_dtype(rop, s.dtype, "reduce_scatter")
        asked, scaling = rop, None
        if prescales(rop, s.dtype) and r.count and self.size > 1 and self._p2p is None:
            # (scaled into memory of its own: the other blocks of ``send`` stay as they are;
            # the P2P kernels scale each operand as they load it)
            s, scaling = self._scale_avg(s, None, stream)
            rop = ReduceOp.SUM
        order = self.mem.order(stream)
        desc = descriptor(Coll.REDUCE_SCATTER, r, asked)
        if await self._small_or_empty(desc, r.count):
            return out
        if self.size == 1:
            await self._local_copy(r, s, order)
            return out
        zc = self._zero_copy_lane(s.nbytes)
        if zc is not None:
            fits = self._lane_fits(r.nbytes)
            await self._lane_run(_scaled_lane(ZeroCopyReduceScatter(
                self, zc, desc, r.dtype, r.count, rop,
                lambda: LanePlan(self, zc, desc, s, r, rop) if fits else StepPlan(
                    self, zc, desc, r.dtype, reduce_scatter_steps(
                        zc, r.count, zc.step // r.itemsize), rop)), scaling),
                s.array, r.array)
            return out
        if self._lane_fits(r.nbytes):
            await self._lane_call(desc, s, r, rop, 0, scaling)
            return out
        lane = self._lane
        if lane is not None:
            self.check_usable()
            await self._lane_run(_scaled_lane(StepPlan(
                self, lane, desc, r.dtype, reduce_scatter_steps(
                    lane, r.count, lane.step // r.itemsize), rop), scaling), s.array, r.array)
            return out
        make = self._p2p_make(Mode.REDUCE_SCATTER, "reduce_scatter", s, r, r.count, order,
                              op=rop, asked=asked)
        if rop is asked:
            self._learn("reduce_scatter", send, recv, op, 0, make)
        native = self._native
        if (native is not None and make is None and order is None
                and native.takes(r, rop, moved=s.nbytes)):
            await self._execute(desc, None, _scaled_first(
                lambda ctx: NativeRingReduceScatter(ctx, s, r, rop, native), scaling))
            return out
        await self._execute(desc, make, self._ordered(_scaled_first(
            lambda ctx: algos.RingReduceScatter(ctx, s, r, rop), scaling), order))
        return out

    @_announced
    async def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> Any:
        """Block ``p`` of ``send`` goes to rank ``p``; block ``q`` of ``recv`` comes from ``q``."""
        if self._prepared is not None and await self._ran_prepared(
                "all_to_all", send, recv, None, 0, stream):
            return recv
        s, r, out = self._pair(send, recv, "all_to_all")
        if s.count % self.size:
            raise InvalidUsage(f"all_to_all: {s.count} elements do not split into "
                               f"{self.size} equal blocks")
        order = self.mem.order(stream)
        desc = descriptor(Coll.ALL_TO_ALL, s, count=s.count // self.size)
        if await self._small_or_empty(desc, s.count):
            return out
        if self.size == 1:
            await self._local_copy(r, s, order)
            return out
        if self._lane_fits(s.nbytes // self.size):
            await self._lane_call(desc, s, r)
            return out
        if self._lane is not None:
            block = s.nbytes // self.size
            await self._lane_bytes(desc, s, r, all_to_all_steps(
                self._lane, block, self._lane.step))
            return out
        make = self._p2p_make(Mode.ALL_TO_ALL, "all_to_all", s, r, s.count // self.size,
                              order)
        self._learn("all_to_all", send, recv, None, 0, make)
        await self._execute(desc, make, self._ordered(
            lambda ctx: algos.DirectAllToAll(ctx, s, r), order))
        return out

    @_announced
    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self.check_usable()
        if self.size == 1:
            return
        desc = Descriptor(Coll.BARRIER, 0, 0, 0, 0)
        if self._lane is not None:
            await self._lane_call(desc, None, None)
            return
        await self._exec.execute(desc, self._barrier_algo())

    def _barrier_algo(self) -> MakeAlgorithm:
        if self.size == 1:
            return _Nothing
        return algos.DisseminationBarrier if self.size <= 64 else algos.TreeBarrier

    @_announced
    async def send(self, buf: Any, peer: int, *, stream: Any = None) -> Any:
        """Send ``buf`` to ``peer``, matched in order with ``peer``'s ``recv`` from us.

        ``peer`` may be this rank inside a group, paired with a ``recv`` from self in the
        same group (:mod:`acoll._comm.selfp2p`)."""
        b = self.mem.adopt(buf, "buf")
        peer = check_peer(peer, self.size)
        self.check_usable()
        order = self.mem.order(stream)
        if peer == self.rank:
            await self._to_self("send", b, order)
            return buf
        index = self._p2p_send[peer]
        self._p2p_send[peer] = index + 1
        desc = descriptor(Coll.SEND_RECV, b, root=self._exec.p2p_stamp())
        await self._exec.execute(desc, self._ordered(lambda ctx: _Send(ctx, peer, b), order),
                                 tag_base=p2p_tag(index))
        return buf

    @_announced
    async def recv(self, buf: Any, peer: int, *, stream: Any = None) -> Any:
        """Receive into ``buf`` the next message ``peer`` sends us; dtype and count must
        match the send's (``peer`` may be this rank inside a group, as for :meth:`send`)."""
        b = self.mem.adopt(buf, "buf", writable=True)
        peer = check_peer(peer, self.size)
        self.check_usable()
        order = self.mem.order(stream)
        if peer == self.rank:
            await self._to_self("recv", b, order)
            return buf
        index = self._p2p_recv[peer]
        self._p2p_recv[peer] = index + 1
        stamp = self._exec.p2p_stamp()
        desc = descriptor(Coll.SEND_RECV, b, root=stamp)
        checker = self._checker
        checker.recv_issued(peer, index, stamp)
        try:
            await self._exec.execute(desc, self._ordered(
                lambda ctx: _Recv(ctx, peer, b, checker, index), order),
                tag_base=p2p_tag(index))
        except BaseException:
            checker.recv_done(peer, index)
            raise
        return buf

    async def _to_self(self, side: str, b: Buffer, order: StreamOrder | None) -> None:
        """A send to self or recv from self: queued in the caller's group, paired there
        (see :mod:`acoll._comm.selfp2p`)."""
        pairs = self._self_pairs
        pair = pairs.post(side, b, self._exec.group_queue())
        algo = SelfSend if side == "send" else SelfRecv
        desc = descriptor(Coll.SEND_RECV, b, root=ANY_SEQ)
        await self._exec.execute(desc, self._ordered(lambda ctx: algo(ctx, pairs, pair), order),
                                 tag_base=p2p_tag(pair.index))

    # ------------------------------------------------------------------ registration
    async def register(self, buf: Any) -> Registration:
        """Prepare ``buf`` for repeated collectives (``ncclCommRegister``). Collective:
        every rank calls it, in the same order, each with its own buffer.

        On the intra-host GPU path between processes, a call whose send and receive
        buffers lie in registered allocations is read by the peers in place instead of
        going through the workspace: the whole CUDA allocation holding ``buf`` (for a
        memory-pool array, the pool's block) is mapped into every peer process once,
        here. It must stay allocated until :meth:`deregister` or ``close()``.

        Host buffers, ranks in processes of one host (the shared-memory lane): ``buf``
        must lie in memory from :func:`acoll.empty_shared` on every rank; the allocation
        holding it is mapped (read-only) by every peer, and an all_reduce, broadcast,
        all_gather or reduce_scatter of at least 512 KiB (``lane.ZERO_COPY_MIN``; the
        receive buffer of an all_gather, the send buffer of a reduce_scatter) whose send
        and receive buffers all lie in registered allocations (any offset, on every rank)
        reads the peers' buffers in place: no copy through shared mailboxes. If some
        rank's buffer is not in such memory, or cannot be mapped, or the ranks cannot map
        each other's memory at all (no boards), no rank registers it (the handle's
        ``index`` is -1, and an INFO log line says why).
        Deregister on every rank alike, in the same order.

        Elsewhere (ranks in one process, no intra-host path) this is a no-op that still
        returns a handle.
        """
        self._on_own_loop("register")
        self._not_in_group("register()")
        self.check_usable()
        try:
            b = self.mem.adopt(buf, "buf")
        except InvalidUsage as exc:
            self._misused("register", exc)
        if self._lane is not None:
            found = shared.find(b.ptr, b.nbytes)
            lane = self._lane
            index = await self._in_call_order(Coll.REGISTER,
                                              lambda: lane.register(found, self._boot))
            self._lane_plans.clear()  # (plans made before now do not look for it)
            return Registration(self, index, host=True)
        if self._p2p is None or self._p2p.direct:
            return Registration(self, -1)
        p2p = self._p2p
        index = await self._in_call_order(Coll.REGISTER,
                                          lambda: p2p.register(b.ptr, self._boot))
        return Registration(self, index)

    async def deregister(self, reg: Registration) -> None:
        """Undo :meth:`register` (collective, like it)."""
        self._on_own_loop("deregister")
        self._not_in_group("deregister()")
        self.check_usable()
        if not isinstance(reg, Registration) or reg.comm is not self:
            self._misused("deregister", InvalidUsage(
                "deregister takes a Registration of this communicator"))
        if reg.index < 0:
            return
        if reg.host:
            if self._lane is not None:
                async with self._exec.exclusive():
                    self._lane.deregister(reg.index)
                self._lane_plans.clear()
            reg.index = -1
            return
        if self._p2p is None:
            return
        p2p = self._p2p
        await self._in_call_order(Coll.DEREGISTER,
                                  lambda: p2p.deregister(reg.index, self._boot))
        reg.index = -1

    async def _in_call_order(self, coll: Coll, exchange: Callable[[], Awaitable[_R]]) -> _R:
        """Run ``exchange`` (a bootstrap exchange of split or registration, which takes no
        sequence number of its own) as one op in the call order: a barrier numbered like a
        collective, then the exchange, both while the op holds the communicator, so that no
        call made later runs between them on one rank and not on another (found by review:
        a deadlock). A rank that made another call at this point is named at once by the
        descriptor checks (the barrier's messages carry ``coll``), where both ranks used to
        wait for their deadlines."""
        if self.size == 1:
            async with self._exec.exclusive():
                return await exchange()
        step = _BarrierThen(exchange)
        barrier = self._barrier_algo()
        await self._exec.execute(Descriptor(coll, 0, 0, 0, 0), lambda ctx: step.on(barrier(ctx)))
        if step.error is not None:
            raise step.error
        return step.out[0]

    # ------------------------------------------------------------------ split
    async def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Make sub-communicators of the ranks passing the same ``color`` (``ncclCommSplit``).

        Ranks are ordered by ``key`` (then by parent rank). ``color=None`` joins none and
        returns ``None``. Every rank of this communicator must call it. Cancelled before it
        returns, it fails this communicator (as a cancelled collective does): the other
        ranks' split() raises RemoteError naming this rank, at once (or returned a child
        already, whose first call then fails).
        """
        self._on_own_loop("split")
        self._not_in_group("split()")
        self.check_usable()
        try:
            if color is not None:
                color = as_int(color, "color", 0, expect="an int >= 0 (below 2**63) or None")
            key = self.rank if key is None else as_int(key, "key", expect="an int of 64 bits")
        except InvalidUsage as exc:
            self._misused("split", exc)
        self._split_seq += 1
        nth = self._split_seq  # (read once: a concurrent split() moves the counter on)
        addr: list[Any] = []
        sock = None
        if color is not None:
            host = self._boot.addr[0]
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            sockaddr: tuple[Any, ...] = (host, 0, 0, self._boot.addr[2]) if fam == \
                socket.AF_INET6 else (host, 0)
            sock = listen_socket(sockaddr, fam)
            name = sock.getsockname()
            addr = [name[0], name[1], self._boot.addr[2]]
        try:
            record = msgpack.packb([color, key, addr])
            items = await self._in_call_order(
                Coll.SPLIT, lambda: self._boot.allgather(record, f"split() #{nth}"))
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, asyncio.CancelledError):
                # The peers are in (or on their way to) the same exchange and cannot finish
                # it: fail the parent, as a cancelled collective does, so that they hear.
                self._exec.cancelled("split", nth)
            raise
        if color is None:
            return None
        assert sock is not None
        members = sorted((k, r, a) for r, (c, k, a) in
                         ((r, msgpack.unpackb(it)) for r, it in enumerate(items)) if c == color)
        new_rank = next(i for i, (_, r, _) in enumerate(members) if r == self.rank)
        nkey = hashlib.blake2b(self._boot.key + f"/{nth}/{color}".encode(),
                               digest_size=16).digest()
        peer_addrs: list[Address] = [(a[0], a[1], a[2]) for _, _, a in members]

        handed: list[bool] = []  # (from_peers owns ``sock`` from its call on)

        async def join(make_info: Callable[[Address], bytes]
                       ) -> tuple[Bootstrap, list[bytes]]:
            handed.append(True)
            boot = await Bootstrap.from_peers(rank=new_rank, nranks=len(members), key=nkey,
                                              sock=sock, peer_addrs=peer_addrs,
                                              timeout=self.timeout)
            try:
                return boot, await boot.allgather(make_info(boot.addr))
            except BaseException:
                boot.abort()
                raise

        try:
            mem = HostSpace() if self.device is None else device_space(self.device)
            # (cancelled, this rank fails this communicator before it drops the child's
            # formation: the other members hear that cause, which ends their formation
            # too, rather than of the child's sockets closing)
            return await self._unless_ended(Communicator._form(
                join, sockaddr, fam, self.timeout, key=nkey, net=None, check=self.check,
                mem=mem, nranks=len(members)),
                lambda: self._exec.cancelled("split", nth))
        except BaseException:
            if not handed:  # (else the bootstrap's server closes it, off the loop's
                sock.close()  # watch first: see stream.serve_stream)
            raise

    async def _unless_ended(self, forming: Coroutine[Any, Any, Communicator],
                            on_cancel: Callable[[], None]) -> Communicator:
        """Await ``forming`` (a child's formation), unless this communicator fails or is
        aborted first: then the formation is cancelled and its error raised (a member
        that left the split, cancelled, fails this communicator: its peers learn it here
        instead of at the child's deadline). Cancelled itself, it calls ``on_cancel``
        first, then drops the formation."""
        task = asyncio.ensure_future(forming)
        ended = asyncio.get_running_loop().create_future()
        self._ended.append(ended)
        if self._error is not None or self._closed:  # (ended before this call got here)
            ended.set_result(None)
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            on_cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not task.cancelled() and task.exception() is None:
                task.result().abort()  # (formed as the cancel came: nobody gets it)
            raise
        finally:
            if ended in self._ended:
                self._ended.remove(ended)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is None:
            task.result().abort()  # (formed as the failure came: dropped)
        self.check_usable()
        raise AssertionError("unreachable: the communicator ended without an error")


class Registration:
    """A buffer registered with :meth:`Communicator.register` (pass it to
    :meth:`Communicator.deregister`); ``index`` is -1 where registering had no effect."""

    __slots__ = ("comm", "host", "index")

    def __init__(self, comm: Communicator, index: int, host: bool = False) -> None:
        self.comm, self.index, self.host = comm, index, host

    def __repr__(self) -> str:
        return f"<acoll.Registration #{self.index}>"


async def _native_lib(endpoints: list[tuple[Transport, Listener]],
                      mem: MemorySpace | None) -> NativeLib | None:
    """The native ring's library for a communicator with a TCP transport (built off the
    loop's thread on first use), unless ``ACOLL_NATIVE=0``; a device communicator's runs
    the all_reduces it sends through the host (``ACOLL_GPU_VIA_HOST_MAX``, not 0). Every
    communicator loads it for its 16-bit float loops (:func:`acoll._dtypes.combiner`),
    whatever its transports; ``ACOLL_NATIVE=0`` turns those off for the process again."""
    wanted = NATIVE.resolve()
    if wanted == 0:
        use_native_halves(None, None)
        return None
    lib = await load_native()
    # (process-wide, as the latest communicator found it: an ACOLL_NATIVE=0 one, or one
    # whose compiler failed, turns them off)
    use_native_halves(None if lib is None else lib.reduce, None if lib is None else lib.scale)
    if lib is None and wanted > 0:
        log.warning("ACOLL_NATIVE=1 but the native library could not be built (ACOLL_DEBUG="
                    "INFO says why): the Python ring and NumPy's loops run instead")
    if ((mem is not None and mem.kind != MemoryKind.HOST and VIA_HOST_MAX.resolve() == 0)
            or not any(isinstance(t, TcpTransport) for t, _ in endpoints)):
        return None
    return lib


def _p2p_wanted(mem: MemorySpace | None) -> bool:
    """Whether this rank offers the intra-host GPU path (a real CUDA space, not
    disabled)."""
    if mem is None or mem.kind != MemoryKind.CUDA:
        return False
    from ._memory.cuda import CudaSpace
    from ._p2p.domain import DISABLE
    return isinstance(mem, CudaSpace) and not DISABLE.resolve()


def device_space(device: int) -> MemorySpace:
    """The memory space of a communicator bound to CUDA ``device`` (CuPy is imported here;
    tests replace this function to run device code paths on fake device memory)."""
    from ._memory.cuda import CudaSpace

    return CudaSpace(device)


async def _yield() -> None:
    await asyncio.sleep(0)


def _release(endpoints: list[tuple[Transport, Listener]]) -> None:
    for transport, listener in endpoints:
        listener.close()
        transport.close()


def _parse_infos(raw: list[bytes]) -> tuple[list[PeerInfo], list[Address]]:
    """Every rank's info record (see ``make_info`` in :meth:`Communicator._form`).

    Raises:
        BootstrapError: a record is malformed.
    """
    infos, addrs = [], []
    for rank, item in enumerate(raw):
        try:
            d = msgpack.unpackb(item)
            handles = {str(k): bytes(v) for k, v in d["handles"].items()}
            infos.append(PeerInfo(rank=rank, host_hash=int(d["host_hash"]),
                                  proc=bytes(d["proc"]), loop=int(d["loop"]),
                                  pid=int(d["pid"]), handles=handles))
            boot = d["boot"]
            addrs.append((str(boot[0]), int(boot[1]), int(boot[2])))
        except Exception as exc:
            raise BootstrapError(f"rank {rank} sent a malformed info record: {exc!r}") \
                from None
    return infos, addrs


class _OnStream:
    """An algorithm fitted into the caller's stream on a device communicator: starts
    after the caller's queued work, orders the caller's later work after its own, and
    (without ``stream=``) waits for its work to finish, under the op's deadline."""

    def __init__(self, algo: Algorithm, order: StreamOrder, mem: MemorySpace,
                 timeout: float) -> None:
        self.algo, self.order, self.mem, self.timeout = algo, order, mem, timeout

    async def run(self) -> None:
        self.order.start()
        await self.algo.run()
        self.order.finish()
        if self.order.settle:
            await self.mem.settle(asyncio.get_running_loop().time() + self.timeout)


_LanePlans = AllReducePlan | StepPlan | ZeroCopyAllReduce
_LaneCalls = (LanePlan | _LanePlans | ZeroCopyAllGather | ZeroCopyBroadcast
              | ZeroCopyReduceScatter)


def _bytes_of(buf: Buffer) -> Any:
    """A host buffer's bytes as a flat uint8 NumPy array (no copy)."""
    return np.frombuffer(buf.view(), np.uint8)


def _plan_key(send: Any, op: Any) -> tuple[Any, int, Any] | None:
    """The key of the lane plans an all_reduce of ``send`` under ``op`` may reuse: NumPy
    arrays and ops given as ReduceOp or name only (others take the general path)."""
    if type(send) is np.ndarray and (type(op) is ReduceOp or type(op) is str):
        return send.dtype, send.size, op
    return None


class _Scaling:
    """AVG's scaling of this rank's input (``dst = src * 1/n``, see
    :meth:`Communicator._scale_avg`), run on host memory as its op starts."""

    __slots__ = ("done", "dst", "mem", "n", "src")

    def __init__(self, mem: MemorySpace, dst: Buffer, src: Buffer, n: int,
                 done: Callable[[], None] | None = None) -> None:
        self.mem, self.dst, self.src, self.n, self.done = mem, dst, src, n, done

    async def run(self) -> None:
        await self.mem.scale(self.dst, self.src, self.n, _yield)

    def succeeded(self) -> None:
        """The op that read ``dst`` (or, folding the scaling into its steps, ``src``)
        succeeded: ``dst``'s memory may be reused."""
        if self.done is not None:
            self.done()
            self.done = None


class _ScaledFirst:
    """An algorithm whose run starts with its input's scaling."""

    def __init__(self, algo: Algorithm, scaling: _Scaling) -> None:
        self.algo, self.scaling = algo, scaling

    async def run(self) -> None:
        await self.scaling.run()
        await self.algo.run()
        self.scaling.succeeded()


def _scaled_first(make: MakeAlgorithm, scaling: _Scaling | None) -> MakeAlgorithm:
    """``make``, its algorithm preceded by ``scaling`` (if any)."""
    if scaling is None:
        return make
    return lambda ctx: _ScaledFirst(make(ctx), scaling)


#: Bytes a reused lane plan scales in one go, unpaced (as host reductions do).
_SCALE_AT_ONCE = 64 << 10
#: Whether lane step plans scale AVG's input as they copy it: None, where their steps
#: say it pays (``Steps.folds_scaling``: all_reduce's two-shot steps, reduce_scatter's);
#: True or False always (``bench/avg_fold_ab.py``'s paired runs, tests)
_FOLD_AVG: bool | None = None


def _folds_avg(plan: StepPlan) -> bool:
    """Whether ``plan``'s AVG scales its input as its steps copy it rather than all of
    it first (see ``Steps.folds_scaling``)."""
    if _FOLD_AVG is not None:
        return _FOLD_AVG
    return plan.steps.folds_scaling


class _ScaledLaneCall:
    """A lane call preceded by its input's scaling, done in the op's turn (the lane's
    ops publish in the order of their numbers; see ``Lane.turns``): ``scaling``, or
    (``None``: an all_reduce plan, reused with each call's arrays) ``mine`` scaled into
    ``res`` by 1/``n``, and the call run in place on ``res``; a step plan whose steps
    fold (:func:`_folds_avg`: all_reduce's two-shot steps, reduce_scatter's) instead
    scales its input as it copies it (``factor`` of
    :meth:`~acoll._comm.lane.StepPlan.run`), from the caller's send buffer."""

    def __init__(self, call: _LaneCalls, scaling: _Scaling | None,
                 mem: MemorySpace | None = None, n: int = 0) -> None:
        self.call, self.scaling, self.desc = call, scaling, call.desc
        self.mem, self.n = mem, n

    async def run(self, seq: int, ctx: Any = None, mine: Any = None, res: Any = None
                  ) -> None:
        call = self.call
        await call.take_turn(seq)
        scaling = self.scaling
        if (isinstance(call, StepPlan) and _folds_avg(call)
                and (scaling is None or mine is scaling.dst.array)):
            # (the steps scale their input as they copy it: one pass over memory fewer;
            # the run gives the turn back. With a scaling, the plan was to read its
            # memory, laid out as its source: it reads the source instead, and the
            # scaling's memory is left unused)
            if scaling is None:
                await call.run(seq, ctx, mine, res, turned=True,
                               factor=avg_factor(res.dtype, self.n))
                return
            await call.run(seq, ctx, scaling.src.array, res, turned=True,
                           factor=avg_factor(res.dtype, scaling.n))
            scaling.succeeded()
            return
        try:
            if self.scaling is not None:
                await self.scaling.run()
            elif res.nbytes <= _SCALE_AT_ONCE:
                scale_into(res, mine, avg_factor(res.dtype, self.n))
                mine = res
            else:
                mem = self.mem
                assert mem is not None
                await mem.scale(Buffer(res, mem), Buffer(mine, mem), self.n, _yield)
                mine = res
        except BaseException:
            call.lane.turns.remove(seq)
            raise
        await call.run(seq, ctx, mine, res, turned=True)
        if self.scaling is not None:
            self.scaling.succeeded()


def _scaled_lane(call: _LaneCalls, scaling: _Scaling | None) -> _LaneCalls | _ScaledLaneCall:
    return call if scaling is None else _ScaledLaneCall(call, scaling)


class _PlanAt:
    """A lane call run by the executor as op ``seq`` (not wrapped)."""

    def __init__(self, call: _LaneCalls | _ScaledLaneCall, seq: int,
                 ctx: OpContext, mine: Any, res: Any) -> None:
        self.call, self.seq, self.ctx, self.mine, self.res = call, seq, ctx, mine, res

    async def run(self) -> None:
        await self.call.run(self.seq, self.ctx, self.mine, self.res)


class _Send:
    def __init__(self, ctx: OpContext, peer: int, buf: Buffer) -> None:
        self.ctx, self.peer, self.buf = ctx, peer, buf

    async def run(self) -> None:
        await self.ctx.connect(self.peer)
        await self.ctx.wait_send(self.ctx.post_send(self.peer, self.buf, 0), self.peer)


class _BarrierThen(Generic[_R]):
    """An algorithm: a barrier (``on``), then ``exchange``, whose result goes to ``out``
    (see :meth:`Communicator._in_call_order`). An error of the exchange is kept in
    ``error`` for the caller, not raised through the executor: the exchange fails the
    communicator itself where it must (a bootstrap failure does), while an error every
    rank raises together (a registration every rank refuses) leaves it usable, as
    before the barrier existed."""

    def __init__(self, exchange: Callable[[], Awaitable[_R]]) -> None:
        self.exchange = exchange
        self.first: Any = None
        self.out: list[_R] = []
        self.error: Exception | None = None

    def on(self, first: Any) -> _BarrierThen[_R]:
        self.first = first
        return self

    async def run(self) -> None:
        await self.first.run()
        try:
            self.out.append(await self.exchange())
        except Exception as exc:
            self.error = exc


class _Nothing:
    """The data part of a zero-element collective (the agreement does the checking)."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx

    async def run(self) -> None:
        return


class _Recv:
    def __init__(self, ctx: OpContext, peer: int, buf: Buffer, checker: OrderChecker,
                 index: int) -> None:
        self.ctx, self.peer, self.buf, self.checker, self.index = ctx, peer, buf, checker, index

    async def run(self) -> None:
        # (done when the recv ran, not when it was called: in a group that is later)
        try:
            await self.ctx.connect(self.peer)
            fut = self.ctx.post_recv(self.peer, self.buf, 0)
            self.checker.recv_futs[(self.peer, self.index & 0x7FFFFFFF)] = fut
            await self.ctx.wait_recv(fut, self.peer)
        finally:
            self.checker.recv_done(self.peer, self.index)


_nofile_raised = False


def _raise_nofile_once() -> None:
    """Listeners, peers and connections still authenticating all need descriptors: the
    first communicator of a process raises the soft limit to the hard one (once)."""
    global _nofile_raised
    if not _nofile_raised:
        _nofile_raised = True
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                log.info("open-file limit raised from %d to %s", soft, hard)


def raise_nofile_limit() -> None:
    """Raise the soft open-files limit to the hard one (many ranks in one process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # a privileged process may also lift the hard limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 1 << 20), max(hard, 1 << 20)))
        return
    except (ValueError, OSError):
        pass
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

