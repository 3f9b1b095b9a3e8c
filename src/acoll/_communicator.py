"""The communicator: init, collectives, groups, split, close and abort.

Execution model. Every rank must issue collectives on a communicator in the same order
(as with NCCL streams). Calls are numbered when made and run one at a time in that order
(a FIFO queue): two tasks may call collectives on one communicator concurrently, but the
order in which they *call* must match across ranks; a mismatch is detected by the
descriptor check and raised as :class:`~acoll.InvalidUsage` on every rank. Inside
``async with comm.group():`` calls only enqueue (they return at once, results are ready
when the block exits) and then run concurrently, like ``ncclGroupStart/End``.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt

from ._bootstrap.ring import Bootstrap, error_from_wire, error_to_wire
from ._bootstrap.root import RootServer, listen_socket, start_root
from ._bootstrap.wire import Address
from ._bootstrap.wire import Error as WireError
from ._coll import algorithms as algos
from ._coll.base import ANY_SEQ, Coll, Descriptor, OpContext
from ._config import TIMEOUT, Setting, get_logger, parse_bool
from ._deadline import deadline_after, wait_until
from ._dtypes import ReduceOp, as_host_array, check_op_dtype, dtype_code, empty_bytes
from ._net.interfaces import find_interfaces
from ._transport.base import Connection, ConnectionLost, Listener, Transport
from ._transport.select import select_transport
from ._uid import UniqueId
from .errors import (
    AcollError,
    BootstrapError,
    ClosedError,
    InvalidUsage,
    RemoteError,
)
from .errors import TimeoutError as AcollTimeoutError

__all__ = ["Communicator", "get_unique_id", "init_rank"]

log = get_logger("INIT")

COMM_ID = Setting("COMM_ID", str, "",
                  "host:port of the root; rank 0 hosts it there (like NCCL_COMM_ID).", "INIT")
CHECK = Setting("CHECK", parse_bool, True,
                "Check that every rank runs the same collective (count, dtype, op, root).",
                "COLL")

SPIN_US = Setting("SPIN_US", float, 25.0,
                  "Microseconds to busy-poll for a small op's message before sleeping in the "
                  "event loop (peers in other processes only, with a core per local rank).",
                  "NET")

_P2P = 1 << 63
_SEQ_MASK = 0x7FFFFFFF
_ISSUED_WINDOW = 1024  # sequence numbers whose descriptors are kept for late messages
_ROOTED = (Coll.BROADCAST, Coll.REDUCE)
_NO_DATA = (Coll.BARRIER, Coll.CLOSE, Coll.SEND_RECV)
_CHECK_STEP = 0xFFFFFFFF
_EMPTY = np.empty(0, np.uint8)
_LINGER = 5.0
_FAILED_LINGER = 0.5


class _Algo(Protocol):
    async def run(self) -> None: ...


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
        try:
            return await fn(self, *args, **kwargs)
        except InvalidUsage as exc:
            if self._error is None and not self._closed:
                self.fail(InvalidUsage(f"rank {self.rank} made an invalid "
                                       f"{fn.__name__} call: {exc}"))
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
        return UniqueId.from_address(comm_id)
    iface = find_interfaces(ifname, family)[0]
    sock = listen_socket(iface.sockaddr(0), iface.family)
    name = sock.getsockname()
    uid = UniqueId.new(name[0], name[1], iface.scope_id)
    start_root(RootServer(sock, uid.job_key, TIMEOUT.resolve()))
    log.info("unique id %r made on %s", uid, iface.name)
    return uid


async def init_rank(nranks: int, uid: UniqueId | bytes, rank: int, *,
                    device: int | None = None, timeout: float | None = None,
                    ifname: str | None = None, net: str | None = None,
                    check: bool | None = None) -> Communicator:
    """Join communicator ``uid`` as ``rank`` of ``nranks`` (NCCL's ``ncclCommInitRank``).

    Args:
        nranks: the number of ranks; every rank must pass the same value.
        uid: the id from :func:`get_unique_id` on one rank (or its 128 bytes).
        rank: this rank, ``0 <= rank < nranks``; each rank exactly once.
        device: a CUDA device for GPU buffers; host-only communicators pass ``None``.
        timeout: deadline in seconds for every network wait (default ``ACOLL_TIMEOUT``).
        ifname: interface rules overriding ``ACOLL_SOCKET_IFNAME``.
        net: data network overriding ``ACOLL_NET``.
        check: descriptor checks overriding ``ACOLL_CHECK``.

    Raises:
        InvalidUsage: bad arguments, a rank claimed twice, ranks disagreeing on nranks.
        acoll.TimeoutError: not every rank arrived within the timeout.
        BootstrapError: the root could not be reached.
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
    if device is not None:
        raise InvalidUsage("device=: GPU communicators need the CUDA transport, which this "
                           "release does not include; pass device=None for host buffers")
    timeout = TIMEOUT.resolve(timeout)
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
            infos = boot.infos or await boot.allgather(make_info(boot.addr))
        except BaseException:
            boot.abort()
            raise
        return boot, infos

    try:
        comm = await Communicator._form(join, sockaddr, iface.family, timeout,
                                        key=uid.job_key, net=net, check=check)
    except BaseException:
        if root is not None:  # do not keep the fixed ACOLL_COMM_ID port busy
            root.stop()
        raise
    log.info("rank %d/%d ready in %.1f ms", rank, nranks, (time.perf_counter() - start) * 1e3)
    return comm


class Communicator:
    """A group of ranks that run collectives together. Create with :func:`init_rank`.

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: the number of ranks.
        device: ``None`` (host buffers).
        local_rank / local_size: position among, and number of, ranks on this host.
    """

    def __init__(self, boot: Bootstrap, transport: Transport, listener: Listener,
                 infos: list[dict[str, Any]], timeout: float, check: bool) -> None:
        self._boot = boot
        self.rank = boot.rank
        self.size = boot.nranks
        self.device: int | None = None
        self.timeout = timeout
        self.check = check
        self._transport = transport
        self._listener = listener
        self._handles = [bytes(info["handle"]) for info in infos]
        hosts = [info["host_hash"] for info in infos]
        self.local_rank = hosts[: self.rank].count(hosts[self.rank])
        self.local_size = hosts.count(hosts[self.rank])
        self.chunk_bytes = algos.CHUNK.resolve()
        # Busy-poll budget per wait, per peer: only for peers in other processes, and only
        # when this host has a core per local rank (spinning on a shared core slows the
        # very peer we wait for; ranks in this process can never answer while we spin).
        spin = SPIN_US.resolve()
        spare = self.local_size <= (os.cpu_count() or 1)
        self._spin_ns = [int(spin * 1000) if spare and info["pid"] != os.getpid() else 0
                         for info in infos]
        self._algo = algos.ALGO.resolve()
        self._small = algos.SMALL.resolve()
        self._loop = asyncio.get_running_loop()
        self._conns: dict[int, Connection] = {}
        self._connecting: dict[int, asyncio.Future[Connection]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._seq = 0
        # Mismatch detection (see _on_arrival): what this rank issued at each recent
        # sequence number, the first foreign descriptor seen for sequence numbers it has
        # not issued yet, and the stamps of its issued, unmatched receives per peer.
        self._issued: dict[int, Descriptor] = {}
        self._early: dict[int, tuple[int, bytes]] = {}
        self._recv_stamps: dict[tuple[int, int], int] = {}
        self._recv_futs: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._p2p_seen: set[tuple[int, int]] = set()  # p2p messages that arrived early
        self._p2p_unclaimed: dict[tuple[int, int], int] = {}  # early sends, recv not issued
        self._running: set[OpContext] = set()
        self._p2p_send: defaultdict[int, int] = defaultdict(int)
        self._p2p_recv: defaultdict[int, int] = defaultdict(int)
        self._lock = asyncio.Lock()
        self._group: list[tuple[int, Descriptor, int, Callable[[OpContext], _Algo]]] | None
        self._group = None
        self._error: AcollError | None = None
        self._closed = False
        self._scratch_bufs: dict[int, np.ndarray[Any, Any]] = {}
        self._split_seq = 0
        boot.on_failure = self._on_boot_failure
        self._spawn(self._accept_loop())

    # ------------------------------------------------------------------ formation
    @classmethod
    async def _form(cls, join: Callable[[Callable[[Address], bytes]],
                                        Awaitable[tuple[Bootstrap, list[bytes]]]],
                    sockaddr: tuple[Any, ...], family: socket.AddressFamily, timeout: float,
                    *, key: bytes, net: str | None, check: bool | None) -> Communicator:
        """Set up the data network, then ``join`` the bootstrap and learn every rank's info.

        ``join(make_info)`` returns the bootstrap and all ranks' info records, in rank order
        (from the root's table, or an all-gather); ``make_info(boot_addr)`` builds ours.
        """
        transport = select_transport(sockaddr, family, timeout=timeout, key=key, net=net)
        listener = await transport.listen()
        host_hash = _host_hash() & 0x7FFFFFFFFFFFFFFF

        def make_info(boot_addr: Address) -> bytes:
            return msgpack.packb({"host_hash": host_hash, "pid": os.getpid(),
                                  "net": transport.name, "handle": listener.handle,
                                  "boot": list(boot_addr)})

        try:
            boot, raw = await join(make_info)
        except BaseException:
            listener.close()
            raise
        try:
            infos = [msgpack.unpackb(item) for item in raw]
            for rank, info in enumerate(infos):
                if info["net"] != transport.name:
                    raise InvalidUsage(f"rank {rank} uses network {info['net']!r} but rank "
                                       f"{boot.rank} uses {transport.name!r}")
            boot.set_peer_addrs([tuple(info["boot"]) for info in infos])
            comm = cls(boot, transport, listener, infos, timeout, CHECK.resolve(check))
        except BaseException:
            listener.close()
            boot.abort()
            raise
        try:
            if comm.size > 1:
                ring = {(comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size}
                await wait_until(asyncio.gather(*(comm._conn(p) for p in ring)),
                                 deadline_after(timeout), "ring connections")
        except BaseException:
            comm.abort()
            raise
        return comm

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("rank %d: background task failed: %r", self.rank, exc)
            if isinstance(exc, AcollError):
                self.fail(exc)

    # ------------------------------------------------------------------ connections
    def _hello(self, peer: int) -> bytes:
        # The transport proved that the connector holds the job's key and bound these
        # bytes into that proof; here they only say which rank connects to which.
        return msgpack.packb({"rank": self.rank, "to": peer})

    async def _accept_loop(self) -> None:
        while True:
            try:
                hello, conn = await self._listener.accept()
            except ClosedError:
                return
            try:
                info = msgpack.unpackb(hello)
                peer, to = info["rank"], info["to"]
            except Exception:
                peer, to = -1, -1
            if to != self.rank or not isinstance(peer, int) or not (
                    0 <= peer < self.size) or peer == self.rank or peer in self._conns:
                log.warning("rank %d: refused a data connection (hello from rank %s)",
                            self.rank, peer)
                conn.abort()
                continue
            self._register(peer, conn)

    def _register(self, peer: int, conn: Connection) -> None:
        if self._error is not None or self._closed:
            conn.abort()
            return
        self._conns[peer] = conn
        conn.set_failure_callback(lambda lost: self._on_conn_lost(peer, lost))
        conn.set_arrival_callback(functools.partial(self._on_arrival, peer))
        fut = self._connecting.pop(peer, None)
        if fut is not None and not fut.done():
            fut.set_result(conn)

    async def _conn(self, peer: int) -> Connection:
        conn = self._conns.get(peer)
        if conn is not None:
            return conn
        self._check_usable()
        fut = self._connecting.get(peer)
        if fut is None:
            fut = self._loop.create_future()
            self._connecting[peer] = fut
            if self.rank < peer:
                self._spawn(self._dial(peer, fut))
        return await fut

    async def _dial(self, peer: int, fut: asyncio.Future[Connection]) -> None:
        try:
            conn = await self._transport.connect(self._handles[peer], self._hello(peer),
                                                 deadline_after(self.timeout))
        except AcollError as exc:
            err = exc if isinstance(exc, AcollTimeoutError) else RemoteError(
                f"rank {self.rank} cannot connect to rank {peer}: {exc}", peer)
            if not fut.done():
                fut.set_exception(err)
            self.fail(err)
            return
        self._register(peer, conn)

    def _on_conn_lost(self, peer: int, lost: ConnectionLost) -> None:
        if self._closed or self._error is not None:
            return
        if lost.orderly and not lost.notice:
            log.info("rank %d: rank %d closed the communicator", self.rank, peer)
            return
        if lost.notice:
            try:
                body = msgpack.unpackb(lost.notice)
                err = error_from_wire(WireError(str(body["kind"]), str(body["message"]),
                                                int(body["rank"])), via=peer)
            except Exception:
                err = RemoteError(f"rank {peer} failed (unreadable notice)", peer)
        else:
            err = RemoteError(f"rank {peer} is gone: {lost} (process died, aborted, or the "
                              "network failed)", peer)
        self.fail(err)

    def _on_boot_failure(self, err: AcollError) -> None:
        self.fail(err)

    def _peer_error(self, peer: int, exc: ConnectionLost) -> AcollError:
        if self._error is not None:
            return self._error
        if exc.orderly:
            err: AcollError = RemoteError(f"rank {peer} closed the communicator", peer)
        else:
            err = RemoteError(f"rank {peer} is gone: {exc}", peer)
        self.fail(err)
        return err

    # ------------------------------------------------------------------ failure
    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClosedError("the communicator is closed")

    def fail(self, error: AcollError) -> None:
        """Put the communicator in the failed state and tell every peer (idempotent)."""
        if self._error is not None or self._closed:
            return
        self._error = error
        log.info("rank %d: communicator failed: %s", self.rank, error)
        wire = error_to_wire(error, self.rank)
        notice = msgpack.packb({"kind": wire.kind, "message": wire.message,
                                "rank": wire.rank})
        for conn in list(self._conns.values()):
            conn.close(notice, drop_queued=True)
        for fut in self._connecting.values():
            if not fut.done():
                fut.set_exception(error)
        self._connecting.clear()
        self._listener.close()
        self._boot.fail(error)

    @property
    def error(self) -> AcollError | None:
        """The error that failed this communicator, or ``None``."""
        return self._error

    def abort(self) -> None:
        """Drop every connection now. Local and immediate; peers see :class:`RemoteError`."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._error = ClosedError("the communicator was aborted")
        for conn in self._conns.values():
            conn.abort()
        for fut in self._connecting.values():
            if not fut.done():
                fut.set_exception(self._error)
        self._listener.close()
        self._boot.abort()
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        """Orderly close: wait for in-flight ops on every rank, then release everything.

        Every rank must call it; it starts with a barrier. A rank that closes while its
        peers are inside another call makes them fail at once (``InvalidUsage`` naming the
        close). Resources are always released; if the closing barrier failed (a peer
        died, or did not close within the deadline), the error is raised afterwards. A
        communicator that had already failed is released without waiting for anyone.
        """
        if self._closed:
            return
        failure: AcollError | None = None
        was_failed = self._error is not None
        if not was_failed:
            try:
                await self._execute(Descriptor(Coll.CLOSE, 0, 0, 0, 0), self._barrier_algo())
            except AcollError as exc:
                failure = exc
        self._closed = True
        for conn in self._conns.values():
            conn.close()
        self._listener.close()
        waits = [conn.wait_closed() for conn in self._conns.values()]
        if waits:
            # A failed communicator queued its failure notice when it failed: give it a
            # moment to leave, but never wait for a peer that stopped reading.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits),
                                       _FAILED_LINGER if was_failed or failure else _LINGER)
        for conn in self._conns.values():
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._boot.close()
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
    def _scratch(self, count: int, dtype: np.dtype[Any], slot: int) -> npt.NDArray[Any]:
        nbytes = count * dtype.itemsize
        buf = self._scratch_bufs.get(slot)
        if buf is None or buf.size < nbytes:
            buf = empty_bytes(max(nbytes, 64))  # no huge pages: see empty_bytes
            self._scratch_bufs[slot] = buf
        return buf[:nbytes].view(dtype)

    async def _execute(self, desc: Descriptor, make: Callable[[OpContext], _Algo],
                       tag_base: int | None = None) -> None:
        self._check_usable()
        if tag_base is None:
            seq = self._seq & _SEQ_MASK
            tag_base = seq << 32
            self._seq += 1
            self._issue(seq, desc)
        if self._group is not None:
            self._group.append((tag_base >> 32, desc, tag_base, make))
            return
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            # The op already has its sequence number: peers will wait for it. Fail now.
            self._cancelled(desc.coll.name.lower(), tag_base >> 32)
            raise
        try:
            self._check_usable()
            await self._run(OpContext(self, tag_base >> 32, desc, False, tag_base), make)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ mismatch detection
    def _issue(self, seq: int, desc: Descriptor) -> None:
        """Record what this rank runs at ``seq``; compare with what a peer already sent."""
        self._issued[seq] = desc
        self._issued.pop((seq - _ISSUED_WINDOW) & _SEQ_MASK, None)
        early = self._early.pop(seq, None)
        err: InvalidUsage | None = None
        if early is not None and self.check and early[1] != desc.packed:
            err = InvalidUsage(desc.describe_difference(Descriptor.unpack(early[1]),
                                                        self.rank, early[0]))
        elif self.check and self._p2p_unclaimed and self._group is None:
            # A send that arrived early and was stamped before this collective can no
            # longer be matched in order: the recv would come after the collective.
            for (peer, _index), stamp in self._p2p_unclaimed.items():
                if stamp <= seq:
                    err = InvalidUsage(
                        f"send/recv order mismatch between rank {self.rank} and rank "
                        f"{peer}: rank {peer} sent before its collective #{stamp}, but rank "
                        f"{self.rank} reached collective #{seq} without a matching recv")
                    break
        if err is not None:
            self.fail(err)
            raise err

    def _p2p_stamp(self) -> int:
        """The collective sequence number a send/recv issued now is stamped with.

        Inside a group the order of send/recv relative to the group's collectives does not
        matter (they run together, as in NCCL): such calls carry :data:`~._coll.base.ANY_SEQ`
        and are not order-checked.
        """
        return ANY_SEQ if self._group is not None else self._seq & _SEQ_MASK

    def _on_arrival(self, peer: int, tag: int, meta: bytes) -> None:
        """A message came from ``peer`` before any receive was posted for it.

        Legitimate early arrivals are for operations this rank will run later. Anything
        else proves the ranks disagree, and waiting would only end at the deadline:
        a message for an operation this rank runs (or ran) with another descriptor, a
        send issued before a collective this rank is already past, or a collective
        message from a peer this rank waits on in a receive issued before it.
        """
        if self._error is not None or self._closed or not self.check:
            return
        if tag & _P2P:
            self._p2p_arrival(peer, tag, meta)
            return
        seq = (tag >> 32) & _SEQ_MASK
        mine = self._issued.get(seq)
        if mine is None:
            self._early.setdefault(seq, (peer, meta))
            self._p2p_blocked(peer, seq, meta)
            return
        if meta != mine.packed:
            self.fail(InvalidUsage(mine.describe_difference(Descriptor.unpack(meta),
                                                            self.rank, peer)))

    def _p2p_arrival(self, peer: int, tag: int, meta: bytes) -> None:
        other = Descriptor.unpack(meta)
        key = (peer, (tag >> 32) & _SEQ_MASK)
        self._p2p_seen.add(key)  # forgotten when its recv completes
        stamp = self._recv_stamps.get(key)
        if other.root == ANY_SEQ or stamp == ANY_SEQ:
            return
        if stamp is None:
            # Our matching receive is not issued yet: it will carry at least this stamp.
            stamp = self._seq & _SEQ_MASK
            if other.root >= stamp:
                self._p2p_unclaimed[key] = other.root  # checked as collectives are issued
                return
        elif other.root == stamp:
            return
        mine = self._issued.get(other.root)
        where = f"collective #{other.root}" + (
            f" ({mine.coll.name.lower()})" if mine is not None else "")
        self.fail(InvalidUsage(
            f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
            f"{peer} sent before its {where}, but rank {self.rank} "
            + ("was already past it" if other.root < stamp else
               f"posts the matching recv before collective #{stamp}")))

    def _p2p_blocked(self, peer: int, seq: int, meta: bytes) -> None:
        """``peer`` runs collective ``seq`` while we still wait for its send issued earlier."""
        for (frm, _index), stamp in self._recv_stamps.items():
            if (frm == peer and stamp != ANY_SEQ and stamp <= seq and seq not in self._issued
                    and (frm, _index) in self._recv_futs):
                # Its send (stamped before seq) should have come first; give messages that
                # travel on other sockets a moment before calling it a mismatch.
                self._loop.call_later(0.2, self._p2p_blocked_check, peer, _index, seq, meta)
                return

    def _p2p_blocked_check(self, peer: int, index: int, seq: int, meta: bytes) -> None:
        key = (peer, index)
        fut = self._recv_futs.get(key)
        if (key not in self._recv_stamps or key in self._p2p_seen
                or (fut is not None and fut.done()) or self._error is not None or self._closed):
            return
        coll = Descriptor.unpack(meta).coll.name.lower()
        self.fail(InvalidUsage(
            f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
            f"{self.rank} waits in recv from rank {peer}, which is already in {coll} "
            f"#{seq}: the ranks issued their calls in different orders"))

    def _cancelled(self, name: str, seq: int) -> None:
        self.fail(RemoteError(f"rank {self.rank} cancelled {name} #{seq}; the "
                              "communicator was aborted", self.rank))

    async def _run(self, ctx: OpContext, make: Callable[[OpContext], _Algo]) -> None:
        name = ctx.desc.coll.name.lower()
        timer = self._loop.call_later(self.timeout, self._timed_out, name, ctx)
        self._running.add(ctx)
        check: asyncio.Task[None] | None = None
        try:
            if ctx.check and self.size > 1 and (ctx.desc.coll in _ROOTED or (
                    ctx.desc.count == 0 and ctx.desc.coll not in _NO_DATA)):
                check = await self._start_agreement(ctx)
            await make(ctx).run()
            if check is not None:
                await check
            if self._error is not None:
                # A disagreement found while this op ran (by a message check that ran
                # after the op's own last receive): do not report success.
                raise self._error
        except asyncio.CancelledError:
            self._cancelled(name, ctx.seq)
            raise
        except AcollError as exc:
            first = self._error
            self.fail(exc)
            raise (first or exc) from None
        finally:
            timer.cancel()
            self._running.discard(ctx)
            if check is not None and not check.done():
                check.cancel()
                with contextlib.suppress(BaseException):
                    await check
            elif check is not None and not check.cancelled():
                check.exception()  # already raised through fail(); mark it retrieved

    async def _start_agreement(self, ctx: OpContext) -> asyncio.Task[None]:
        """Check that every rank runs the same rooted op, alongside the op itself.

        In a broadcast the root, and in a reduce the leaves, receive nothing, so the
        descriptor carried by data messages cannot reach them. Instead every rank computes
        the smallest and largest descriptor over all ranks with a dissemination exchange
        (ceil(log2 n) rounds of 40-byte messages, concurrent with the op): when they differ,
        every rank raises the same :class:`InvalidUsage`, naming the field. Failing the
        communicator also wakes an op that is stuck because of the disagreement.
        """
        n, r = self.size, self.rank
        peers = []
        dist = 1
        while dist < n:
            peers.append(((r + dist) % n, (r - dist) % n))
            dist <<= 1
        await ctx.connect(*{p for pair in peers for p in pair})
        state = bytearray(ctx.desc.packed + r.to_bytes(4, "little") + ctx.desc.packed
                          + r.to_bytes(4, "little"))
        inbox = [np.empty(40, np.uint8) for _ in peers]
        recvs = [ctx.post_recv(frm, inbox[i], _CHECK_STEP - i)
                 for i, (_, frm) in enumerate(peers)]

        async def run() -> None:
            try:
                for i, (to, frm) in enumerate(peers):
                    send = ctx.post_send(to, np.frombuffer(bytes(state), np.uint8),
                                         _CHECK_STEP - i)
                    try:
                        ctx.progress(recvs[i], frm)
                        await recvs[i]
                        await send
                    except ConnectionLost as exc:
                        raise self._peer_error(frm, exc) from None
                    got = inbox[i].tobytes()
                    if got[:16] < state[:16]:
                        state[:20] = got[:20]
                    if got[20:36] > state[20:36]:
                        state[20:] = got[20:]
                if state[:16] != state[20:36]:
                    low, high = Descriptor.unpack(bytes(state[:16])), Descriptor.unpack(
                        bytes(state[20:36]))
                    raise InvalidUsage(low.describe_difference(
                        high, int.from_bytes(state[16:20], "little"),
                        int.from_bytes(state[36:40], "little")))
            except AcollError as exc:
                self.fail(exc)
                raise

        return self._loop.create_task(run())

    def _timed_out(self, name: str, ctx: OpContext) -> None:
        """The op's deadline passed: fail, naming the rank(s) it was waiting for.

        A rank waiting only on peers that did send something in this op is blocked behind
        someone else: it waits a short grace first, so that the rank that heard nothing
        from the stalled one reports first and its cause is the one every rank sees.
        """
        if self._error is not None or self._closed or ctx not in self._running:
            return
        ops = tuple(self._running)
        peers = sorted({c.waiting_on for c in ops if c.waiting_on is not None})
        silent = [p for p in peers if not any(p in c.heard for c in ops)]
        if peers and not silent and not ctx.grace_used:
            ctx.grace_used = True
            self._loop.call_later(min(5.0, self.timeout / 10 + 0.2), self._timed_out,
                                  name, ctx)
            return
        peers = silent or peers
        waited = (f"; it was waiting for rank{'s' if len(peers) > 1 else ''} "
                  f"{', '.join(map(str, peers))}, "
                  + ("which sent nothing in this call (stalled, or not in this call)"
                     if silent else "which had started this call")
                  if peers else "")
        self.fail(AcollTimeoutError(f"{name} #{ctx.seq} did not complete within "
                                    f"{self.timeout:g} s on rank {self.rank}{waited}",
                                    peers[0] if len(peers) == 1 else None))

    @contextlib.asynccontextmanager
    async def group(self) -> AsyncIterator[None]:
        """Run the operations issued inside together (``ncclGroupStart/End``).

        Calls inside the block return at once; their buffers hold results only after the
        block exits. Nested groups join the outermost one.
        """
        self._check_usable()
        if self._group is not None:
            yield
            return
        self._group = []
        try:
            yield
        except BaseException:
            ops, self._group = self._group, None
            if ops:  # enqueued ops hold sequence numbers the peers will wait for
                self._cancelled("group", ops[0][0])
            raise
        ops, self._group = self._group, None
        if not ops:
            return
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            self._cancelled("group", ops[0][0])
            raise
        try:
            self._check_usable()
            results = await asyncio.gather(
                *(self._run(OpContext(self, seq, desc, True, tag), make)
                  for seq, desc, tag, make in ops), return_exceptions=True)
        finally:
            self._lock.release()
        for res in results:
            if isinstance(res, BaseException):
                raise res

    # ------------------------------------------------------------------ collectives
    def _desc(self, coll: Coll, arr: npt.NDArray[Any], op: int = 0, root: int = 0,
              count: int | None = None, algo: type | None = None) -> Descriptor:
        return Descriptor(coll, dtype_code(arr.dtype), op, root,
                          arr.size if count is None else count,
                          algos.ALGO_CODES.get(algo, 0) if algo is not None else 0)

    def _root(self, root: int) -> int:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidUsage(f"root must be in [0, {self.size}), got {root!r}")
        return root

    @staticmethod
    def _same(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
        return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                    and a.nbytes == b.nbytes)

    def _pair(self, send: Any, recv: Any, what: str, ratio_send: int = 1,
              ratio_recv: int = 1) -> tuple[npt.NDArray[Any], npt.NDArray[Any], Any]:
        s = as_host_array(send, "send")
        if recv is None:
            if ratio_send != ratio_recv:
                raise InvalidUsage(f"{what} needs a recv buffer")
            r = as_host_array(send, "send", writable=True)
            recv = send
        else:
            r = as_host_array(recv, "recv", writable=True)
        if s.dtype != r.dtype:
            raise InvalidUsage(f"{what}: send has dtype {s.dtype}, recv has {r.dtype}")
        if s.size * ratio_recv != r.size * ratio_send:
            if ratio_send > ratio_recv:  # reduce_scatter: the send side is the multiple
                need = f"send must hold {r.size * ratio_send // ratio_recv} ({self.size} x recv)"
            else:
                need = f"recv must hold {s.size * ratio_recv // ratio_send}"
                if ratio_recv > 1:
                    need += f" ({self.size} x send)"
            raise InvalidUsage(f"{what}: send holds {s.size} elements and recv {r.size}; "
                               f"{need}")
        if not self._same(s, r) and np.shares_memory(s, r) and not (
                (what == "all_gather" and self._inside(s, r))
                or (what == "reduce_scatter" and self._inside(r, s))):
            raise InvalidUsage(f"{what}: send and recv overlap without being the same buffer")
        return s, r, recv

    def _inside(self, block: npt.NDArray[Any], whole: npt.NDArray[Any]) -> bool:
        """``block`` is exactly this rank's block of ``whole`` (NCCL's in-place layout)."""
        base = whole.__array_interface__["data"][0]
        return bool(block.__array_interface__["data"][0] == base + self.rank * block.nbytes)

    async def _small_or_empty(self, desc: Descriptor, count: int) -> bool:
        """Handle 0 elements (check only) and reserve no network for 1 rank.

        With checks on, a zero-element call still runs the full agreement (every rank
        learns every rank's descriptor), so that no rank returns from a call its peers
        did not make.
        """
        if count == 0:
            if self.size > 1 and self.check:
                await self._execute(desc, _Nothing)
            elif self.size > 1:
                self._seq += 1
            return True
        return False

    @_announced
    async def all_reduce(self, send: Any, recv: Any = None,
                         op: ReduceOp | str = ReduceOp.SUM) -> Any:
        """Reduce ``send`` across ranks into ``recv`` on every rank (in place if ``None``)."""
        rop = ReduceOp.coerce(op)
        s, r, out = self._pair(send, recv, "all_reduce")
        check_op_dtype(rop, s.dtype, "all_reduce")
        cls = algos.choose("all_reduce", s.nbytes, self.size, self._algo, self._small)
        desc = self._desc(Coll.ALL_REDUCE, s, rop, algo=cls)
        if await self._small_or_empty(desc, s.size):
            return out
        if self.size == 1:
            self._check_usable()
            if not self._same(s, r):
                r[...] = s
            return out
        await self._execute(desc, lambda ctx: cls(ctx, s, r, rop))
        return out

    @_announced
    async def broadcast(self, buf: Any, root: int = 0) -> Any:
        """Copy ``root``'s ``buf`` into ``buf`` on every rank."""
        b = as_host_array(buf, "buf", writable=True)
        root = self._root(root)
        cls = algos.choose("broadcast", b.nbytes, self.size, self._algo, self._small)
        desc = self._desc(Coll.BROADCAST, b, 0, root, algo=cls)
        if await self._small_or_empty(desc, b.size) or self.size == 1:
            return buf
        await self._execute(desc, lambda ctx: cls(ctx, b, root))
        return buf

    @_announced
    async def reduce(self, send: Any, recv: Any = None, op: ReduceOp | str = ReduceOp.SUM,
                     root: int = 0) -> Any:
        """Reduce ``send`` across ranks into ``recv`` on ``root`` (``recv`` unused elsewhere).

        ``recv=None`` means in place on the root; non-root ranks' buffers are not changed.
        """
        rop = ReduceOp.coerce(op)
        root = self._root(root)
        if self.rank == root:
            s, r, out = self._pair(send, recv, "reduce")
        else:
            s = as_host_array(send, "send")
            r, out = None, recv if recv is not None else send
        check_op_dtype(rop, s.dtype, "reduce")
        cls = algos.choose("reduce", s.nbytes, self.size, self._algo, self._small)
        desc = self._desc(Coll.REDUCE, s, rop, root, algo=cls)
        if await self._small_or_empty(desc, s.size):
            return out
        if self.size == 1:
            assert r is not None
            if not self._same(s, r):
                r[...] = s
            return out
        await self._execute(desc, lambda ctx: cls(ctx, s, r, root, rop))
        return out

    @_announced
    async def all_gather(self, send: Any, recv: Any) -> Any:
        """Concatenate every rank's ``send`` into ``recv`` (``size * len(send)``, rank order).

        In place when ``send`` is this rank's block of ``recv``.
        """
        s, r, out = self._pair(send, recv, "all_gather", 1, self.size)
        desc = self._desc(Coll.ALL_GATHER, s)
        if await self._small_or_empty(desc, s.size):
            return out
        if self.size == 1:
            if not self._same(s, r):
                r[...] = s
            return out
        await self._execute(desc, lambda ctx: algos.RingAllGather(ctx, s, r))
        return out

    @_announced
    async def reduce_scatter(self, send: Any, recv: Any,
                             op: ReduceOp | str = ReduceOp.SUM) -> Any:
        """Reduce ``send`` (``size`` blocks) across ranks; block ``rank`` lands in ``recv``."""
        rop = ReduceOp.coerce(op)
        s, r, out = self._pair(send, recv, "reduce_scatter", self.size, 1)
        check_op_dtype(rop, s.dtype, "reduce_scatter")
        desc = self._desc(Coll.REDUCE_SCATTER, r, rop)
        if await self._small_or_empty(desc, r.size):
            return out
        if self.size == 1:
            if not self._same(s, r):
                r[...] = s
            return out
        await self._execute(desc, lambda ctx: algos.RingReduceScatter(ctx, s, r, rop))
        return out

    @_announced
    async def all_to_all(self, send: Any, recv: Any) -> Any:
        """Block ``p`` of ``send`` goes to rank ``p``; block ``q`` of ``recv`` comes from ``q``."""
        s, r, out = self._pair(send, recv, "all_to_all")
        if s.size % self.size:
            raise InvalidUsage(f"all_to_all: {s.size} elements do not split into "
                               f"{self.size} equal blocks")
        desc = self._desc(Coll.ALL_TO_ALL, s, count=s.size // self.size)
        if await self._small_or_empty(desc, s.size):
            return out
        if self.size == 1:
            if not self._same(s, r):
                r[...] = s
            return out
        await self._execute(desc, lambda ctx: algos.DirectAllToAll(ctx, s, r))
        return out

    @_announced
    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._check_usable()
        if self.size == 1:
            return
        desc = Descriptor(Coll.BARRIER, 0, 0, 0, 0)
        await self._execute(desc, self._barrier_algo())

    def _barrier_algo(self) -> Callable[[OpContext], _Algo]:
        if self.size == 1:
            return _Nothing
        return algos.DisseminationBarrier if self.size <= 64 else algos.TreeBarrier

    def _peer(self, peer: int) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.size:
            raise InvalidUsage(f"peer must be in [0, {self.size}), got {peer!r}")
        if peer == self.rank:
            raise InvalidUsage("send/recv to self: use a local copy")
        return peer

    @_announced
    async def send(self, buf: Any, peer: int) -> Any:
        """Send ``buf`` to ``peer``, matched in order with ``peer``'s ``recv`` from us."""
        b = as_host_array(buf, "buf")
        peer = self._peer(peer)
        self._check_usable()
        seq = self._p2p_send[peer]
        self._p2p_send[peer] = seq + 1
        tag = _P2P | ((seq & _SEQ_MASK) << 32)
        desc = self._desc(Coll.SEND_RECV, b, root=self._p2p_stamp())
        await self._execute(desc, lambda ctx: _Send(ctx, peer, b), tag_base=tag)
        return buf

    @_announced
    async def recv(self, buf: Any, peer: int) -> Any:
        """Receive into ``buf`` the next message ``peer`` sends us; sizes must match."""
        b = as_host_array(buf, "buf", writable=True)
        peer = self._peer(peer)
        self._check_usable()
        seq = self._p2p_recv[peer]
        self._p2p_recv[peer] = seq + 1
        tag = _P2P | ((seq & _SEQ_MASK) << 32)
        stamp = self._p2p_stamp()
        desc = self._desc(Coll.SEND_RECV, b, root=stamp)
        key = (peer, seq & _SEQ_MASK)
        self._recv_stamps[key] = stamp
        early_stamp = self._p2p_unclaimed.pop(key, None)
        if early_stamp is not None and stamp not in (early_stamp, ANY_SEQ) and self.check:
            err = InvalidUsage(
                f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
                f"{peer} sent before its collective #{early_stamp}, rank {self.rank} posts "
                f"the recv before collective #{stamp}")
            self.fail(err)
            raise err
        try:
            await self._execute(desc, lambda ctx: _Recv(ctx, peer, b, self._recv_futs, key),
                                tag_base=tag)
        finally:
            self._recv_stamps.pop(key, None)
            self._recv_futs.pop(key, None)
            self._p2p_seen.discard(key)
        return buf

    # ------------------------------------------------------------------ split
    async def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Make sub-communicators of the ranks passing the same ``color`` (``ncclCommSplit``).

        Ranks are ordered by ``key`` (then by parent rank). ``color=None`` joins none and
        returns ``None``. Every rank of this communicator must call it.
        """
        self._check_usable()
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise InvalidUsage(f"color must be a non-negative int or None, got {color!r}")
        key = self.rank if key is None else key
        self._split_seq += 1
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
            async with self._lock:
                items = await self._boot.allgather(msgpack.packb([color, key, addr]))
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if color is None:
            return None
        assert sock is not None
        members = sorted((k, r, a) for r, (c, k, a) in
                         ((r, msgpack.unpackb(it)) for r, it in enumerate(items)) if c == color)
        new_rank = next(i for i, (_, r, _) in enumerate(members) if r == self.rank)
        nkey = hashlib.blake2b(self._boot.key + f"/{self._split_seq}/{color}".encode(),
                               digest_size=16).digest()
        peer_addrs: list[Address] = [(a[0], a[1], a[2]) for _, _, a in members]

        async def join(make_info: Callable[[Address], bytes]
                       ) -> tuple[Bootstrap, list[bytes]]:
            boot = await Bootstrap.from_peers(rank=new_rank, nranks=len(members), key=nkey,
                                              sock=sock, peer_addrs=peer_addrs,
                                              timeout=self.timeout)
            try:
                return boot, await boot.allgather(make_info(boot.addr))
            except BaseException:
                boot.abort()
                raise

        try:
            return await Communicator._form(join, sockaddr, fam, self.timeout, key=nkey,
                                            net=None, check=self.check)
        except BaseException:
            sock.close()  # harmless if the bootstrap server already owns and closed it
            raise


class _Send:
    def __init__(self, ctx: OpContext, peer: int, arr: npt.NDArray[Any]) -> None:
        self.ctx, self.peer, self.arr = ctx, peer, arr

    async def run(self) -> None:
        await self.ctx.connect(self.peer)
        await self.ctx.wait_send(self.ctx.post_send(self.peer, self.arr, 0), self.peer)


class _Nothing:
    """The data part of a zero-element collective (the agreement does the checking)."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx

    async def run(self) -> None:
        return


class _Recv:
    def __init__(self, ctx: OpContext, peer: int, arr: npt.NDArray[Any],
                 posted: dict[tuple[int, int], asyncio.Future[bytes]], key: tuple[int, int]
                 ) -> None:
        self.ctx, self.peer, self.arr, self.posted, self.key = ctx, peer, arr, posted, key

    async def run(self) -> None:
        await self.ctx.connect(self.peer)
        fut = self.posted[self.key] = self.ctx.post_recv(self.peer, self.arr, 0)
        await self.ctx.wait_recv(fut, self.peer)


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

