"""The transport interface: what every data network (TCP, RDMA, ...) provides.

Modelled on NCCL's net plugin (listen / connect / accept / isend / irecv / test), shaped
for asyncio: posting an operation returns a future, and the transport completes it from
the event loop. The communicator never touches sockets or verbs itself.

A communicator holds several transports at once and picks one per peer, as NCCL's
``selectTransport`` does (see :mod:`.select`): every rank publishes a :class:`PeerInfo`
listing the transports it serves with their listener handles, and for each peer the first
transport of the ordered list that both serve and whose :meth:`Transport.can_connect`
accepts the pair carries all traffic with that peer.

Contracts shared by every implementation (checked by ``tests/transport_conformance.py``):

- Buffers are :class:`~acoll._memory.Buffer` objects; a transport only accepts memory of
  the kinds in its :attr:`Transport.memory` (host memory for sockets and shared memory),
  or of :meth:`Transport.memory_for` the communicator's device (GPUDirect RDMA).
- A :class:`Connection` joins two endpoints and carries *messages* both ways. Each message
  has a ``tag`` (an int below 2**64) and a 16-byte ``meta`` chosen by the sender. Messages
  are matched to receives by tag, not by order: a message that arrives before its receive
  is posted is kept until it is (an extra copy); one posted first is filled in place.
- At most one message per tag may be in flight per direction; reusing a tag before the
  previous message with it was received is a caller bug.
- ``isend`` may return before the bytes left the machine; the buffer must stay untouched
  until the returned future completes. It may also complete only once the peer posted the
  matching receive (the in-process transport hands large messages over by reference, as
  MPI's rendezvous protocol does): never wait for a send before posting the receive that
  the peer's own send needs. ``irecv`` completes once the whole message is in
  the buffer, with the sender's ``meta``. A message whose size differs from the receive
  buffer fails that receive with :class:`MessageSizeError` (the connection stays usable),
  once the whole message has arrived and been dropped, so the tag may be posted again.
- When the connection breaks (peer died, reset, protocol violation, or the peer closed it)
  every pending and later operation fails with :class:`ConnectionLost`, and the callback
  given to :meth:`Connection.set_failure_callback` runs once.
- :meth:`Connection.close` is orderly: queued sends are flushed, then the peer learns that
  the connection ended on purpose (``ConnectionLost.orderly``), with an optional notice;
  receives the peer posted in time for those messages complete first, and a message that
  had fully arrived before the peer's close can still be received afterwards (everything
  sent before an orderly close is delivered).
  Cancelling a posted operation's future is not supported: close or abort instead.
- Connections are authenticated: a transport is made with the job's key, and its listener
  hands out only connections whose connector proved that key with a fresh challenge (and
  the connector only returns once the listener proved it too); see :mod:`acoll._auth`.
  Work on unauthenticated connections is bounded in number, time and bytes.
- All methods are called from the event loop thread; none blocks, and no exception
  escapes into the event loop's callbacks: failures end the connection instead.
- ``can_connect`` is symmetric (``t.can_connect(a, b) == t.can_connect(b, a)``), so both
  ranks of a pair pick the same transport without talking.
- A connection with a finite :attr:`Connection.max_inflight` accepts at most that many
  posted, unfinished operations per direction; callers window their posting (the
  collectives' op context queues the rest in order and posts them as earlier ones finish).
- :meth:`Transport.register` prepares a buffer for repeated use (RDMA memory registration,
  CUDA IPC handle export) and returns a handle to pass to :meth:`Transport.deregister`;
  transports with nothing to prepare return ``None``. Registration is an optimisation:
  every transport must accept unregistered buffers (registering, or copying, on the way).
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from .._memory import Buffer, MemoryKind, Staging
from ..errors import ClosedError, ProtocolError, TransportError

__all__ = [
    "META_SIZE",
    "Capability",
    "Connection",
    "ConnectionLost",
    "Listener",
    "MessageSizeError",
    "PeerInfo",
    "QueuedListener",
    "Transport",
]

META_SIZE = 16


class ConnectionLost(TransportError):
    """The connection ended.

    Attributes:
        orderly: the peer closed it on purpose (``Connection.close``), not a crash.
        notice: the bytes the peer passed to ``close(notice=...)`` (empty otherwise).
    """

    def __init__(self, message: str, *, orderly: bool = False, notice: bytes = b"") -> None:
        super().__init__(message)
        self.orderly = orderly
        self.notice = notice


class MessageSizeError(ProtocolError):
    """A message's size differs from the buffer posted for it."""

    def __init__(self, tag: int, expected: int, got: int, meta: bytes) -> None:
        super().__init__(f"message tag {tag:#x}: receive buffer holds {expected} bytes, "
                         f"the sender sent {got}")
        self.tag = tag
        self.expected = expected
        self.got = got
        self.meta = meta


class Capability(enum.Flag):
    """What a transport can do beyond the basic contract."""

    NONE = 0
    #: register() does real work: buffers reused across calls should be registered
    REGISTRATION = enum.auto()
    #: the transport can write into (or read from) the peer's memory without the peer's
    #: CPU (RDMA, CUDA peer access): algorithms may use one-sided schemes
    ONE_SIDED = enum.auto()
    #: peers in this process only / on this host only
    SAME_PROCESS = enum.auto()
    SAME_HOST = enum.auto()


@dataclass(frozen=True)
class PeerInfo:
    """What a rank tells every other rank about itself at formation.

    Attributes:
        rank: its rank in the communicator.
        host_hash: the same for ranks on one host (host name and boot id).
        proc: a random id of its process (pids repeat across hosts and containers).
        loop: which event loop of that process runs it.
        pid: its process id (for logs and busy-poll decisions).
        handles: transport name -> that transport's listener handle, for every transport
            it serves.
    """

    rank: int
    host_hash: int
    proc: bytes
    loop: int
    pid: int
    handles: Mapping[str, bytes] = field(default_factory=dict)

    def same_process(self, other: PeerInfo) -> bool:
        return self.proc == other.proc

    def same_host(self, other: PeerInfo) -> bool:
        return self.host_hash == other.host_hash


class Connection(ABC):
    """A bidirectional, tag-matched message connection to one peer.

    Attributes:
        max_inflight: most posted, unfinished operations per direction (``None``: no cap).
    """

    max_inflight: int | None = None

    @abstractmethod
    def isend(self, buf: Buffer, tag: int, meta: bytes) -> asyncio.Future[None]:
        """Post a send of ``buf`` under ``tag`` with 16-byte ``meta``."""

    @abstractmethod
    def irecv(self, buf: Buffer, tag: int) -> asyncio.Future[bytes]:
        """Post a receive into writable ``buf``; the future gives the sender's ``meta``."""

    @abstractmethod
    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        """Call ``callback`` once when the connection breaks or the peer closes it."""

    @abstractmethod
    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        """Flush queued sends, tell the peer (with ``notice``), then release everything.

        Idempotent. Pending receives fail with :class:`ConnectionLost`. With
        ``drop_queued`` (the failure path) sends not yet started fail at once instead of
        being flushed, so nothing waits on a peer that stopped reading. Sends still
        pending when the connection is finally released fail too: none is left hanging.
        """

    @abstractmethod
    def abort(self) -> None:
        """Release everything now; queued sends are dropped. Idempotent.

        A send whose bytes a transport thread is writing at that moment settles when that
        write returns (within milliseconds: it is cut short): done if every byte went
        out, else failed with :class:`ConnectionLost`, and then the peer's receive fails.
        """

    @abstractmethod
    async def wait_closed(self) -> None:
        """Return once every resource of the connection is released (after close/abort)."""

    @property
    @abstractmethod
    def failed(self) -> ConnectionLost | None:
        """The error that ended the connection, or ``None`` while it works."""

    _arrival: Callable[[int, bytes], None] | None = None

    def set_arrival_callback(self, callback: Callable[[int, bytes], None] | None) -> None:
        """Call ``callback(tag, meta)`` for each message that arrives before a receive was
        posted for it (once per message, from the event loop, never from inside the
        transport's own read path). The communicator uses it to spot a peer that runs a
        different operation, whose messages no receive will ever match."""
        self._arrival = callback

    def _notify_arrival(self, loop: asyncio.AbstractEventLoop, tag: int, meta: bytes) -> None:
        """For implementations: schedule the arrival callback, if any."""
        if self._arrival is not None:
            loop.call_soon(self._arrival, tag, meta)

    def poll(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Make progress now without waiting for the event loop (optional; may do nothing).

        Called by a waiter right before it would sleep: a transport that can check for
        arrived data cheaply (one non-blocking read) completes receives here and saves a
        trip through the loop's poller.
        """

    async def send(self, buf: Buffer, tag: int, meta: bytes = bytes(META_SIZE)) -> None:
        """``await isend(...)``."""
        await self.isend(buf, tag, meta)

    async def recv(self, buf: Buffer, tag: int) -> bytes:
        """``await irecv(...)``."""
        return await self.irecv(buf, tag)


class Listener(ABC):
    """Accepts connections. ``handle`` is the opaque address peers pass to ``connect``."""

    handle: bytes

    @abstractmethod
    async def accept(self) -> tuple[bytes, Connection]:
        """Wait for the next connection; return the connector's hello bytes and it.

        Raises:
            ClosedError: the listener was closed.
        """

    @abstractmethod
    def close(self, notice: bytes = b"") -> None:
        """Stop accepting (idempotent). Connections already returned stay open; those made
        but never returned end, with ``notice`` for their connectors when one is given
        (why this rank stopped: a connector then learns the cause, not a crash)."""


class QueuedListener(Listener):
    """A listener whose made connections wait in a queue for :meth:`accept`.

    Implementations call :meth:`_offer` for each authenticated connection and
    :meth:`_close_queue` when closing (connections never accepted are aborted, after
    their notice, if any, was handed to the peer).
    """

    def __init__(self) -> None:
        self._closed = False
        self._ready: asyncio.Queue[tuple[bytes, Connection] | None] = asyncio.Queue()

    def _offer(self, hello: bytes, conn: Connection) -> None:
        self._ready.put_nowait((hello, conn))

    async def accept(self) -> tuple[bytes, Connection]:
        if self._closed:
            raise ClosedError("listener is closed")
        item = await self._ready.get()
        if item is None:
            self._ready.put_nowait(None)  # for the next waiter
            raise ClosedError("listener is closed")
        return item

    def _close_queue(self, notice: bytes = b"") -> None:
        while not self._ready.empty():  # made but never accepted: nobody owns them
            item = self._ready.get_nowait()
            if item is None:
                continue
            if notice:  # (the notice gets one non-blocking chance to leave, then release:
                item[1].close(notice, drop_queued=True)  # nobody would abort it later)
            item[1].abort()
        self._ready.put_nowait(None)


class Transport(ABC):
    """A way to reach peers: makes listeners and outgoing connections.

    Class attributes:
        name: how settings and logs call it (``inproc``, ``socket``, ``ib``, ...).
        memory: the memory kinds its connections move.
        capabilities: see :class:`Capability`.
    """

    name: ClassVar[str]
    memory: ClassVar[frozenset[MemoryKind]] = frozenset({MemoryKind.HOST})
    capabilities: ClassVar[Capability] = Capability.NONE

    def can_connect(self, mine: PeerInfo, theirs: PeerInfo) -> bool:
        """Whether this transport can join rank ``mine`` (this process) and ``theirs``.

        Called only when both serve it; symmetric. The default (a network) reaches anyone.
        """
        return True

    def joins(self, a: PeerInfo, b: PeerInfo) -> bool:
        """Whether :meth:`can_connect` would join ranks ``a`` and ``b`` when one of them
        asked, judged from their records alone (so any rank can tell for any pair, as
        the native ring's choice needs: :mod:`acoll._comm.native_ring`). The default is
        :meth:`can_connect` itself, for transports whose answer uses only the records."""
        return self.can_connect(a, b)

    def memory_for(self, staging: Staging | None) -> frozenset[MemoryKind]:
        """The memory kinds its connections move for a communicator whose device buffers
        ``staging`` would carry (``None``: a host communicator). The default is
        :attr:`memory`; a transport that can reach that device's memory directly
        (GPUDirect RDMA) adds its kind, and the communicator then skips staging."""
        return self.memory

    def register(self, buf: Buffer) -> object | None:
        """Prepare ``buf`` for repeated use; the handle goes to :meth:`deregister`."""
        return None

    def deregister(self, handle: object | None) -> None:  # noqa: B027 - usually nothing
        """Undo :meth:`register` (``None`` is ignored)."""

    def close(self) -> None:  # noqa: B027 - transports without shared state need nothing
        """Release what the transport holds beyond its listeners and connections."""

    @abstractmethod
    async def listen(self) -> Listener:
        """Start listening on this rank's interface."""

    @abstractmethod
    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> Connection:
        """Connect to the listener behind ``handle``; the acceptor receives ``hello``.

        Raises:
            TransportError: the peer could not be reached (refused, unreachable, bad handle).
            acoll.TimeoutError: ``deadline`` passed before the connection was made.
        """
