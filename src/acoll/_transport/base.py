"""The transport interface: what every data network (TCP, RDMA, ...) provides.

Modelled on NCCL's net plugin (listen / connect / accept / isend / irecv / test), shaped
for asyncio: posting an operation returns a future, and the transport completes it from
the event loop. The communicator never touches sockets or verbs itself.

Contracts shared by every implementation (checked by ``tests/transport_conformance.py``):

- A :class:`Connection` joins two endpoints and carries *messages* both ways. Each message
  has a ``tag`` (an int below 2**64) and a 16-byte ``meta`` chosen by the sender. Messages
  are matched to receives by tag, not by order: a message that arrives before its receive
  is posted is kept until it is (an extra copy); one posted first is filled in place.
- At most one message per tag may be in flight per direction; reusing a tag before the
  previous message with it was received is a caller bug.
- ``isend`` may return before the bytes left the machine; the buffer must stay untouched
  until the returned future completes. ``irecv`` completes once the whole message is in
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
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from ..errors import ProtocolError, TransportError

__all__ = [
    "META_SIZE",
    "Connection",
    "ConnectionLost",
    "Listener",
    "MessageSizeError",
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


class Connection(ABC):
    """A bidirectional, tag-matched message connection to one peer."""

    @abstractmethod
    def isend(self, buf: memoryview, tag: int, meta: bytes) -> asyncio.Future[None]:
        """Post a send of ``buf`` (contiguous bytes) under ``tag`` with 16-byte ``meta``."""

    @abstractmethod
    def irecv(self, buf: memoryview, tag: int) -> asyncio.Future[bytes]:
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
        """Release everything now; queued sends are dropped. Idempotent."""

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

    async def send(self, buf: memoryview, tag: int, meta: bytes = bytes(META_SIZE)) -> None:
        """``await isend(...)``."""
        await self.isend(buf, tag, meta)

    async def recv(self, buf: memoryview, tag: int) -> bytes:
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
    def close(self) -> None:
        """Stop accepting (idempotent). Connections already returned stay open."""


class Transport(ABC):
    """A data network: makes listeners and outgoing connections.

    Class attributes:
        name: what ``ACOLL_NET`` calls it (``socket``, ``ib``, ...).
    """

    name: ClassVar[str]

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
