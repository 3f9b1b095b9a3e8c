"""The rank side of bootstrap: join through the root, then talk over rank-to-rank links.

:meth:`Bootstrap.create` does what NCCL's ``bootstrapInit`` does: listen on this rank's
interface, connect to the root (retrying while it is not up yet, within bounds), send a
hello, and receive the next rank's address. Later messages go over persistent rank-to-rank
connections, opened on first use and kept for the life of the communicator.

Messages are matched by ``(peer, tag)``; one that arrives before its ``recv`` waits in a
mailbox. On top of that: ring :meth:`~Bootstrap.allgather`, :meth:`~Bootstrap.barrier`
and :meth:`~Bootstrap.broadcast` (NCCL's ``bootstrapAllGather`` / ``bootstrapBarrier``).

Failure handling: when any wait fails (a peer vanished, a deadline passed, a protocol
error), :meth:`Bootstrap.fail` records the error, wakes every waiter with it, and sends an
:class:`~.wire.Error` frame to every connected peer before closing; those peers do the
same, so the failure floods the job and every rank raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from .. import _auth
from .. import _topology as topo
from .._config import Setting, get_logger
from .._deadline import deadline_after, remaining, wait_for, wait_until
from ..errors import (
    AcollError,
    BootstrapError,
    ClosedError,
    InvalidUsage,
    ProtocolError,
    RemoteError,
    again,
)
from ..errors import TimeoutError as AcollTimeoutError
from .stream import (
    AuthFailed,
    FramedConnection,
    PeerClosed,
    close_if_cancelled,
    close_server,
    evict,
    leave_gate,
    serve_stream,
)
from .wire import Address, Error, Hello, PeerHello, RingInfo, Tagged

__all__ = ["Bootstrap", "error_from_wire", "error_to_wire"]

log = get_logger("BOOTSTRAP")

_INTERNAL_TAG = 1 << 48  # tags at or above this belong to allgather/barrier/broadcast
PEER_CONTEXT = b"bootstrap"
#: After this long without reaching an address, retries are reported at WARN.
_RETRY_WARN_S = 5.0
CONNECT_RETRIES = Setting("CONNECT_RETRIES", int, 60,
                          "Connection attempts to the root or a peer before giving up (a peer's "
                          "address that refuses three in a row is taken as gone at once).",
                          "BOOTSTRAP", lo=1)


def error_to_wire(exc: BaseException, rank: int) -> Error:
    """Describe a local failure for the peers."""
    if isinstance(exc, InvalidUsage):  # (relayed: the rank it came from)
        return Error("usage", str(exc), rank if exc.rank is None else exc.rank)
    if isinstance(exc, AcollTimeoutError):
        return Error("timeout", str(exc), -1 if exc.rank is None else exc.rank)
    if isinstance(exc, RemoteError):
        return Error("remote", str(exc), rank if exc.rank is None else exc.rank)
    return Error("remote", f"rank {rank} failed: {exc}", rank)


def error_from_wire(err: Error, via: int | None = None) -> AcollError:
    """Turn a received :class:`Error` frame back into the exception to raise locally."""
    rank = err.rank if err.rank >= 0 else via
    if err.kind == "usage":
        usage = InvalidUsage(err.message)
        usage.rank = rank
        return usage
    if err.kind == "timeout":
        return AcollTimeoutError(err.message, err.rank if err.rank >= 0 else None)
    if err.kind == "bootstrap":
        return BootstrapError(err.message)
    if err.kind == "closed":
        return RemoteError(f"rank {rank} closed the communicator: {err.message}", rank)
    return RemoteError(err.message, rank)


#: seconds past its deadline a rank waits for the root's answer (see Bootstrap.create)
_ROOT_ANSWER_GRACE_S = 1.0
#: A peer's bootstrap socket listens before its address is given out (by the root, or in
#: the all-gather of a split), so refusals from it mean it has closed: this many in a row
#: (a few milliseconds) end the attempts, where other errors are retried until the bounds.
_PEER_REFUSALS = 3


async def connect_with_retry(sockaddr: tuple[Any, ...], deadline: float, what: str,
                             stop: Callable[[], AcollError | None] | None = None,
                             refusals: int = 0) -> FramedConnection:
    """Connect, retrying refused/unreachable attempts with backoff, within bounds.

    Gives up after ``ACOLL_CONNECT_RETRIES`` attempts or at ``deadline``, whichever is first,
    or raises what ``stop()`` returns once it returns an error (checked between attempts:
    a bootstrap that failed meanwhile does not keep a sender retrying until the deadline).
    With ``refusals > 0``, that many refusals in a row end it: for an address whose
    socket listened before the address was given out, a refusal means the socket closed.

    Raises:
        BootstrapError: naming the address, the attempts made and the last error.
        ConnectionRefusedError: ``refusals`` refusals in a row.
    """
    delay = 0.01
    last: OSError | None = None
    limit = CONNECT_RETRIES.resolve()
    attempts = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    warned = False
    refused = 0
    where = f"{sockaddr[0]}:{sockaddr[1]}"
    while attempts < limit:
        left = remaining(deadline)
        if left <= 0:
            break
        if stop is not None and (stopped := stop()) is not None:
            raise stopped
        attempts += 1
        try:
            return await wait_for(FramedConnection.connect(sockaddr), min(left, 10.0))
        except asyncio.TimeoutError:  # (before OSError: on 3.11 it is one)
            # None: the deadline cut this attempt short (see the end)
            last = None if left <= 10.0 else OSError("no answer within 10 s")
        except OSError as exc:
            last = exc
            refused = refused + 1 if isinstance(exc, ConnectionRefusedError) else 0
            if refusals and refused >= refusals:
                raise
        waited = loop.time() - start
        if not warned and waited >= _RETRY_WARN_S:
            warned = True
            log.warning("%s at %s still unreachable after %.0f s (%d attempts, last error: "
                        "%s); retrying until %d attempts or the deadline", what, where,
                        waited, attempts, last, limit)
        else:
            log.info("%s at %s: attempt %d/%d failed (%s); retrying in %.2f s", what, where,
                     attempts, limit, last, delay)
        await asyncio.sleep(min(delay, remaining(deadline)))
        delay = min(delay * 1.5, 1.0)
    if last is None:  # (no attempt, or the last one still connecting at the deadline)
        raise AcollTimeoutError(
            f"the deadline passed before {what} at {where} could be reached (" + (
                f"{attempts} attempts over {loop.time() - start:.1f} s, the last one cut "
                "short by the deadline)" if attempts else "before a first attempt)"))
    hint = (" (a root stops listening once every rank has joined: was this rank started "
            "late, or twice?)" if what == "the root" else "")
    raise BootstrapError(f"{what} at {where} unreachable after {attempts} attempts over "
                         f"{loop.time() - start:.1f} s: {last}{hint}") from last


async def connect_authenticated(sockaddr: tuple[Any, ...], deadline: float, what: str,
                                key: bytes, context: bytes, hello: Hello | PeerHello,
                                stop: Callable[[], AcollError | None] | None = None,
                                refusals: int = 0) -> FramedConnection:
    """Connect (see :func:`connect_with_retry`) and authenticate (:mod:`acoll._auth`).

    A connection the acceptor closes without refusing it (it was busy, or dropped us to
    admit newer connections) is retried, within the same bounds.

    Raises:
        AuthFailed: the acceptor refused our proof or could not prove itself.
        PeerClosed, ProtocolError: the exchange broke off after the challenge.
        BootstrapError, acoll.TimeoutError, ConnectionRefusedError: as
            :func:`connect_with_retry`.
    """
    delay = 0.01
    for _ in range(CONNECT_RETRIES.resolve()):
        conn = await connect_with_retry(sockaddr, deadline, what, stop, refusals)
        try:
            await conn.connect_auth(key, context, hello, deadline)
            return conn
        except PeerClosed:
            # Closed without a refusal (a refusal comes as an Error frame: AuthFailed): the
            # acceptor was busy or dropped us to make room under a flood.
            conn.close()
            if remaining(deadline) <= 0:
                raise
            log.info("%s at %s:%s closed the connection during authentication; retrying",
                     what, sockaddr[0], sockaddr[1])
        except BaseException:
            conn.close()
            raise
        await asyncio.sleep(min(delay, remaining(deadline)))
        delay = min(delay * 2, 0.5)
    raise BootstrapError(f"{what} at {sockaddr[0]}:{sockaddr[1]} kept closing connections "
                         "before authenticating them")


class Bootstrap:
    """One rank's bootstrap network. Create it with :meth:`create`."""

    def __init__(self, rank: int, nranks: int, key: bytes, timeout: float) -> None:
        self.rank = rank
        self.nranks = nranks
        self.key = key
        self.timeout = timeout
        self.addr: Address = ("", 0, 0)
        self._server: asyncio.base_events.Server | None = None
        self._out: dict[int, FramedConnection] = {}
        self._out_lock: dict[int, asyncio.Lock] = {}
        self._in: dict[int, FramedConnection] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._gate = _auth.PreAuthGate()
        self._refusals = _auth.RefusalLog(log)
        self._preauth_timeout = _auth.PREAUTH_TIMEOUT.resolve()
        self._mailbox: dict[tuple[int, int], deque[bytes]] = {}
        self._waiters: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._op = 0
        self._closed_peers: set[int] = set()
        self.error: AcollError | None = None
        self.closing = False
        self.on_failure: Callable[[AcollError], None] | None = None
        self.next_addr: Address = ("", 0, 0)
        self._known: dict[int, Address] = {}
        self.infos: list[bytes] | None = None  # every rank's info, when the root sent it
        self.peer_addrs: list[Address] = []
        # Kept from the ring's arrival until the all-gather of infos ended (see gathered()).
        self._root: FramedConnection | None = None

    # ------------------------------------------------------------------ set-up
    @classmethod
    async def create(cls, *, rank: int, nranks: int, key: bytes,
                     root: tuple[Any, ...], listen: tuple[Any, ...],
                     family: socket.AddressFamily, host_hash: int, timeout: float,
                     make_info: Callable[[Address], bytes] | None = None) -> Bootstrap:
        """Join the job through the root at ``root`` and return the connected bootstrap.

        Raises:
            InvalidUsage: the root reported conflicting ranks or sizes.
            acoll.TimeoutError: not every rank arrived in time.
            BootstrapError: the root could not be reached or broke the protocol.
        """
        self = cls(rank, nranks, key, timeout)
        deadline = deadline_after(timeout)
        from .root import ROOT_CONTEXT, listen_socket

        try:
            sock = listen_socket(listen, family)
        except OSError as exc:
            raise BootstrapError(f"rank {rank} cannot listen on {listen[0]}: {exc}") from exc
        self._server = await serve_stream(self._on_connect, sock)
        name = sock.getsockname()
        self.addr = (name[0], name[1], name[3] if family == socket.AF_INET6 else 0)
        info = make_info(self.addr) if make_info is not None else b""
        hello = Hello(b"", b"", rank, nranks, self.addr, host_hash, os.getpid(), info)
        where = f"{root[0]}:{root[1]}"
        try:
            root_conn = await connect_authenticated(root, deadline, "the root", key,
                                                    ROOT_CONTEXT, hello)
        except AuthFailed as exc:
            self._close_all()
            raise BootstrapError(f"rank {rank} could not authenticate with the root at "
                                 f"{where}: {exc}") from exc
        except (PeerClosed, ProtocolError) as exc:
            self._close_all()
            raise BootstrapError(f"root at {where} failed during authentication: {exc}"
                                 ) from exc
        except BaseException:
            self._close_all()
            raise
        self._root = root_conn  # (closed by _close_all on every failure below)
        try:
            try:
                # The root's own deadline (from the first rank's arrival) is about ours:
                # a moment more lets its answer naming the ranks that never came arrive
                # instead of a bare timeout here.
                reply = await wait_until(root_conn.recv(), deadline + _ROOT_ANSWER_GRACE_S,
                                         "the root's ring info")
            except (PeerClosed, ProtocolError) as exc:
                raise BootstrapError(f"root at {where} failed: {exc}") from exc
        except BaseException as exc:
            if isinstance(exc, AcollTimeoutError):
                # Tell the root why this rank leaves: it ends the formation for every
                # rank at once, naming the missing ranks (a rank that just closes is
                # reported as having left). Flushed by the close below.
                with contextlib.suppress(AcollError, OSError):
                    root_conn.send(Error("timeout", f"rank {rank} timed out", rank))
            self._close_all()
            raise
        if isinstance(reply, Error):
            self._close_all()
            raise error_from_wire(reply)
        if not isinstance(reply, RingInfo) or reply.nranks != nranks:
            self._close_all()
            raise BootstrapError(f"root sent an unexpected reply {type(reply).__name__}")
        self.next_addr = reply.next_addr
        self._known = {(rank + 1) % nranks: reply.next_addr, **dict(reply.peers)}
        self.infos = list(reply.infos) if len(reply.infos) == nranks else None
        if self.infos is None:  # the ranks all-gather them: the root relays failures
            task = asyncio.get_running_loop().create_task(self._watch_root(root_conn, where))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)
        else:
            self._root = None
            root_conn.close()
        log.info("rank %d/%d: bootstrap up at %s:%d, next rank at %s:%d", rank, nranks,
                 self.addr[0], self.addr[1], reply.next_addr[0], reply.next_addr[1])
        return self

    @classmethod
    async def from_peers(cls, *, rank: int, nranks: int, key: bytes, sock: socket.socket,
                         peer_addrs: list[Address], timeout: float) -> Bootstrap:
        """A bootstrap whose members already know each other (``split``): no root.

        ``sock`` is this rank's listening socket, whose address is ``peer_addrs[rank]``;
        it is the bootstrap's from the call on (closed by it, also if this raises).
        """
        self = cls(rank, nranks, key, timeout)
        self._server = await serve_stream(self._on_connect, sock)
        self.addr = peer_addrs[rank]
        self.next_addr = peer_addrs[(rank + 1) % nranks]
        self.peer_addrs = list(peer_addrs)
        return self

    async def _watch_root(self, conn: FramedConnection, where: str) -> None:
        """From the ring's arrival until the root closes the connection (every rank has
        all infos): a frame from the root is another rank's failure (or one that left),
        which fails this rank's bootstrap (and so its formation or new communicator) at
        once. A root that closes without one (done, or its process ended) only stops the
        relay: the ranks need nothing more from it."""
        msg: object = None
        try:
            msg = await conn.recv()
        except PeerClosed:
            pass
        except (AcollError, OSError) as exc:
            msg = BootstrapError(f"the root at {where} broke the protocol: {exc}")
        if self._root is not conn:
            return
        self._root = None
        conn.close()
        if msg is None:
            log.debug("rank %d: the root at %s closed its connection", self.rank, where)
        elif isinstance(msg, Error):
            # Passed on to the peers too: one still reading from this rank must learn the
            # cause, not that this rank closed its connections (found on Python 3.12).
            self.fail(error_from_wire(msg))
        else:
            self.fail(msg if isinstance(msg, BootstrapError) else BootstrapError(
                f"the root at {where} sent an unexpected {type(msg).__name__}"))

    def gathered(self) -> None:
        """The all-gather of infos ended on this rank: tell the root. Its connection stays
        open until every rank has said so (see :meth:`_watch_root`). Does nothing when the
        root sent the table."""
        if self._root is not None:
            with contextlib.suppress(AcollError):
                self._root.send(Error("closed", "gathered", self.rank))

    def _sockaddr(self, addr: Address) -> tuple[Any, ...]:
        if ":" in addr[0]:
            return (addr[0], addr[1], 0, addr[2])
        return (addr[0], addr[1])

    def set_peer_addrs(self, addrs: list[Address]) -> None:
        """Record every rank's bootstrap address (after the first all-gather)."""
        self.peer_addrs = addrs

    # ------------------------------------------------------------------ incoming
    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.closing or self.error is not None:  # (accepted as the server closed)
            writer.transport.abort()
            return
        holder: list[int] = []  # the gate token, set before the task first runs
        task = asyncio.get_running_loop().create_task(self._read_peer(reader, writer, holder))
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
        task.add_done_callback(functools.partial(close_if_cancelled, writer))
        # Counted from the moment the connection exists, not when its task first runs.
        holder.append(self._gate.admit(functools.partial(evict, writer, task)))
        task.add_done_callback(functools.partial(leave_gate, self._gate, holder[0]))

    async def _read_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         gate_token: list[int]) -> None:
        conn = FramedConnection(reader, writer)
        try:
            hello = await conn.accept_or_refuse(self.key, PEER_CONTEXT, self._preauth_timeout,
                                                self._refusals, f"rank {self.rank}")
        finally:
            self._gate.leave(gate_token[0])
        if hello is None:
            return
        if (not isinstance(hello, PeerHello) or hello.to != self.rank
                or hello.nranks != self.nranks or not 0 <= hello.rank < self.nranks):
            log.warning("rank %d: refused connection from %s (hello for another rank or "
                        "job size)", self.rank, conn.peer)
            conn.close()
            return
        peer = hello.rank
        self._in[peer] = conn
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Tagged):
                    self._deliver(peer, msg.tag, msg.payload)
                elif isinstance(msg, Error) and msg.kind == "closed":
                    self._peer_closed(peer)
                    return
                elif isinstance(msg, Error):
                    self.fail(error_from_wire(msg, via=peer), propagate=True)
                    return
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} frame from rank {peer}")
        except PeerClosed:
            if not self.closing and peer not in self._closed_peers:
                self.fail(RemoteError(f"rank {peer} closed its bootstrap connection to rank "
                                      f"{self.rank} (process died or aborted)", peer))
        except ProtocolError as exc:
            self.fail(RemoteError(f"rank {peer} broke the bootstrap protocol: {exc}", peer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must fail the job loudly, not silently
            log.exception("rank %d: bootstrap reader for rank %d failed", self.rank, peer)
            self.fail(RemoteError(f"rank {self.rank} failed reading from rank {peer}: "
                                  f"{exc!r}", self.rank))
        finally:
            conn.close()

    def _peer_closed(self, peer: int) -> None:
        """``peer`` closed in an orderly way: only waits on that peer fail."""
        self._closed_peers.add(peer)
        err = RemoteError(f"rank {peer} closed the communicator", peer)
        for key, fut in list(self._waiters.items()):
            if key[0] == peer and not fut.done():
                fut.set_exception(again(err))

    def _deliver(self, peer: int, tag: int, payload: bytes) -> None:
        key = (peer, tag)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(payload)
        else:
            self._mailbox.setdefault(key, deque()).append(payload)

    # ------------------------------------------------------------------ outgoing
    async def _out_conn(self, peer: int, deadline: float) -> FramedConnection:
        conn = self._out.get(peer)
        if conn is not None:
            return conn
        lock = self._out_lock.setdefault(peer, asyncio.Lock())
        async with lock:
            conn = self._out.get(peer)
            if conn is None:
                if self.peer_addrs:
                    addr = self.peer_addrs[peer]
                elif peer in self._known:
                    addr = self._known[peer]
                else:
                    raise BootstrapError(f"rank {self.rank} does not know rank {peer}'s "
                                         "address yet")
                try:
                    conn = await connect_authenticated(
                        self._sockaddr(addr), deadline, f"rank {peer}", self.key,
                        PEER_CONTEXT, PeerHello(b"", b"", self.rank, peer, self.nranks),
                        lambda: self.error, _PEER_REFUSALS)
                except (PeerClosed, ProtocolError) as exc:
                    raise RemoteError(f"rank {self.rank} could not authenticate with rank "
                                      f"{peer} at {addr[0]}:{addr[1]}: {exc}", peer) from exc
                except ConnectionRefusedError as exc:
                    raise RemoteError(
                        f"rank {peer} is gone: its bootstrap address {addr[0]}:{addr[1]} "
                        f"refused rank {self.rank}'s connection (its process ended, or its "
                        "init_rank failed or was cancelled, or it closed or aborted)",
                        peer) from exc
                self._out[peer] = conn
        return conn

    def _check(self) -> None:
        if self.error is not None:
            raise again(self.error)
        if self.closing:
            raise ClosedError("the bootstrap network is closed")

    async def send(self, peer: int, tag: int, payload: bytes) -> None:
        """Send ``payload`` to ``peer`` under ``tag`` (returns once the kernel has it)."""
        self._check()
        if peer == self.rank:
            self._deliver(peer, tag, payload)
            return
        deadline = deadline_after(self.timeout)
        try:
            conn = await self._out_conn(peer, deadline)
            conn.send(Tagged(tag, payload))
            await wait_until(conn.drain(), deadline, f"sending to rank {peer}")
        except PeerClosed as exc:
            err = RemoteError(f"rank {peer} is gone: {exc}", peer)
            self.fail(err)
            raise err from exc
        except AcollError as exc:
            self.fail(exc)
            raise

    async def recv(self, peer: int, tag: int, what: str = "") -> bytes:
        """Receive the payload ``peer`` sent under ``tag`` (waits at most the timeout);
        ``what`` names the exchange in a timeout's message."""
        self._check()
        key = (peer, tag)
        box = self._mailbox.get(key)
        if box:
            payload = box.popleft()
            if not box:
                del self._mailbox[key]
            return payload
        if key in self._waiters:
            raise InvalidUsage(f"two receives wait for rank {peer} tag {tag} at once")
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            return await wait_until(
                fut, deadline_after(self.timeout),
                f"rank {peer} in {what} on rank {self.rank} (is rank {peer} in another "
                "call?)" if what else f"rank {peer} (bootstrap tag {tag}) on rank {self.rank}")
        except AcollTimeoutError as exc:
            self.fail(exc)
            raise
        finally:
            self._waiters.pop(key, None)

    # ------------------------------------------------------------------ collectives
    def _next_tag(self) -> int:
        self._op += 1
        return _INTERNAL_TAG + self._op

    async def allgather(self, data: bytes, what: str = "") -> list[bytes]:
        """Every rank's ``data``, in rank order (Bruck's algorithm, ceil(log2 n) steps);
        ``what`` names the exchange in a timeout's message (``split() #2``).

        At step ``k`` (distance ``d = 2**k``) each rank sends the items it holds so far
        (its own and the next ``d - 1`` ranks', at most ``n - d``) to rank ``r - d`` and
        receives the same from rank ``r + d``. NCCL walks a ring instead (``n - 1`` steps);
        with hundreds of ranks in one process that is n**2 messages, this is n log n.
        """
        n, r = self.nranks, self.rank
        tag = self._next_tag()
        held = [data]
        for dist, (frm, to) in enumerate(topo.dissemination(r, n)):
            count = min(1 << dist, n - (1 << dist))
            await self.send(to, tag, msgpack.packb(held[:count]))
            got = msgpack.unpackb(await self.recv(frm, tag, what))
            if not isinstance(got, list) or len(got) != count or not all(
                    isinstance(item, bytes) for item in got):
                raise RemoteError(f"rank {frm} sent a malformed all-gather message", frm)
            held.extend(got)
        # held[i] is rank (r + i) % n's item
        return [held[(q - r) % n] for q in range(n)]

    async def barrier(self) -> None:
        """Return once every rank has called ``barrier`` (dissemination, log2 n rounds)."""
        n, r = self.nranks, self.rank
        tag = self._next_tag()
        for to, frm in topo.dissemination(r, n):
            await self.send(to, tag, b"")
            await self.recv(frm, tag)

    async def broadcast(self, data: bytes | None, root: int) -> bytes:
        """``root``'s ``data`` on every rank (binomial tree)."""
        n, r = self.nranks, self.rank
        tag = self._next_tag()
        tree = topo.binomial_tree(r, n, root)
        if tree.parent is not None:
            data = await self.recv(tree.parent, tag)
        assert data is not None
        for child in tree.children:
            await self.send(child, tag, data)
        return data

    # ------------------------------------------------------------------ failure and close
    def fail(self, error: AcollError, *, propagate: bool = True) -> None:
        """Fail every pending and later operation with ``error``; tell every peer."""
        if self.error is not None or self.closing:
            return
        self.error = error
        log.info("rank %d: bootstrap failed: %s", self.rank, error)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(again(error))  # (a copy each: tracebacks of their own)
        self._waiters.clear()
        if self.on_failure is not None:
            self.on_failure(error)
        if propagate:
            frame = error_to_wire(error, self.rank)
            for conn in [*self._out.values(), *([self._root] if self._root else [])]:
                with contextlib.suppress(AcollError):
                    conn.send(frame)
        self._close_all()

    def _close_all(self) -> None:
        # FramedConnection.close flushes frames already queued (an error or close notice).
        if self._server is not None:
            close_server(self._server)
        if self._root is not None:
            self._root.close()
            self._root = None
        for conn in list(self._out.values()):
            conn.close()
        self._out.clear()
        for conn in list(self._in.values()):
            conn.close()
        self._in.clear()
        for task in list(self._readers):
            task.cancel()

    async def close(self) -> None:
        """Tell connected peers this rank is closing, then close every connection.

        Peers treat the end of such a connection as orderly: only their waits on this
        rank fail. Call after a barrier so that no peer still needs this rank.
        """
        self.closing = True
        notice = Error("closed", "closed", self.rank)
        for conn in list(self._out.values()):
            with contextlib.suppress(AcollError):
                conn.send(notice)
        self._close_all()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ClosedError("the bootstrap network was closed"))
        self._waiters.clear()
        if self._readers:
            await asyncio.gather(*self._readers, return_exceptions=True)
        if self._server is not None:
            # (close_server closes it a loop step later: until then 3.11's wait_closed
            # would wait for the accepted connections too)
            await asyncio.sleep(0)
            # Python >= 3.12.1 waits here for every accepted connection: bound it.
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._server.wait_closed(), 5.0)

    def abort(self) -> None:
        """Close everything now, without telling peers (they see closed connections);
        pending operations raise ClosedError at once."""
        self.closing = True
        self._close_all()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ClosedError("the bootstrap network was aborted"))
                fut.exception()  # (abandoned by an aborted caller, it must not log)
        self._waiters.clear()
