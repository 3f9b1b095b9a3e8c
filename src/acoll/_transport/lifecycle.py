"""How a loop-driven connection ends: the part the TCP, shared-memory and RDMA connections
share.

Rules of :meth:`LoopConnection._lost`, the one way these connections end on an error:

- The first error recorded ends the connection (``_failed``); later ones are ignored.
- When the peer closes in order, messages that had fully arrived stay receivable: they are
  handed to their posted (or later) receives before anything else is failed.
- An error that arrives while this side is closing is reported as an orderly end (the
  close was asked for), and the owner's failure callback is not called for it.
- The owner's failure callback is called once, synchronously (before the waiters of the
  failed operations resume); one set after the failure is scheduled with ``call_soon``.
  If it raises, that is logged (:func:`call_failure_callback`) and the connection still
  ends.
- A bug inside one of the connection's loop callbacks (``_internal_error``) fails that
  connection with the error named, never the event loop.

(A transport may also end a connection without ``_lost``: the RDMA connection records a
staging failure during its own close directly.) ``tests/transport_conformance.py`` checks,
for every transport, what these rules promise the owner: the error kept, messages
delivered after an orderly close, no callback for the closing side, one callback, a
raising callback; the TCP and shared-memory tests check internal errors.

:class:`FutureConnection` adds the delivery of the connections whose receives are
futures (TCP, shared memory; it needs ``_copies``) and their ``irecv``. A subclass
provides ``_loop``, ``peer`` and ``_match``, sets ``_failed = None``, ``_on_failure =
None`` and ``_closing = False`` in its ``__init__``, and implements :meth:`_settle_lost`
(fail what is pending and release the resources), :meth:`_release`, and :meth:`_deliver`
unless :class:`FutureConnection` provides it.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

from .._config import get_logger
from .._memory import Buffer
from ..errors import ProtocolError
from .base import Connection, ConnectionLost
from .copyout import PacedCopies
from .matching import Matcher, Message

log = get_logger("NET")

T = TypeVar("T")
R = TypeVar("R")


def call_failure_callback(callback: Callable[[ConnectionLost], None],
                          exc: ConnectionLost) -> None:
    """Call an owner's failure callback; if it raises, log that (never the loop's
    exception handler, never the connection's own ending)."""
    try:
        callback(exc)
    except Exception:
        log.exception("connection failure callback raised")


class LoopConnection(Connection, Generic[T, R]):
    """A :class:`~.base.Connection` whose work runs in event-loop callbacks, with the
    ending rules of the module docstring. ``T``, ``R``: its :class:`~.matching.Matcher`'s
    receive and stored-message types."""

    _loop: asyncio.AbstractEventLoop
    _match: Matcher[T, R]
    peer: str
    _failed: ConnectionLost | None
    _on_failure: Callable[[ConnectionLost], None] | None
    _closing: bool

    @property
    def failed(self) -> ConnectionLost | None:
        return self._failed

    def set_failure_callback(self, callback: Callable[[ConnectionLost], None]) -> None:
        self._on_failure = callback
        if self._failed is not None:
            self._loop.call_soon(call_failure_callback, callback, self._failed)

    def _ended(self) -> bool:
        """Whether the connection is already over in a way ``_failed`` does not record
        (released without an error); ``_lost`` then does nothing."""
        return False

    def _lost(self, exc: ConnectionLost) -> None:
        """End the connection with ``exc`` (the first such call wins)."""
        if self._failed is not None or self._ended():
            return
        self._failed = exc
        if exc.orderly and not self._closing:
            # messages that had fully arrived stay receivable (everything sent before an
            # orderly close is delivered)
            for msg in self._match.peer_closed(exc):
                self._deliver(msg)
        if self._closing and not exc.orderly:
            exc = ConnectionLost(str(exc), orderly=True)
        self._settle_lost(exc)
        if self._on_failure is not None and not self._closing:
            # Synchronously, so the owner's state is updated before waiters resume.
            call_failure_callback(self._on_failure, exc)

    def _release_guarded(self) -> None:
        try:
            self._release()
        except Exception as exc:
            self._internal_error("releasing the connection to", exc)

    def _internal_error(self, what: str, exc: BaseException) -> None:
        """Last resort of every loop callback: a bug fails the connection, never the loop."""
        log.error("internal error while %s %s", what, self.peer, exc_info=exc)
        try:
            self._lost(ConnectionLost(f"internal error while {what} {self.peer}: {exc!r}"))
        except Exception:
            log.exception("failing the connection to %s raised", self.peer)

    @abstractmethod
    def _deliver(self, msg: Message[T, R]) -> None:
        """Hand a fully arrived message to its receive (or keep it for a later one)."""

    @abstractmethod
    def _settle_lost(self, exc: ConnectionLost) -> None:
        """After ``_failed`` is set: fail whatever is pending with ``exc`` and release the
        connection's resources."""

    @abstractmethod
    def _release(self) -> None:
        """Free every resource of the connection, failing what is still pending. Idempotent."""


class FutureConnection(LoopConnection["asyncio.Future[bytes]", None]):
    """A :class:`LoopConnection` whose receives are futures of the sender's meta, and whose
    messages kept in storage are copied out into their receive by ``_copies``."""

    _copies: PacedCopies

    def irecv(self, buffer: Buffer, tag: int) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = self._loop.create_future()
        try:
            msg = self._match.post(tag, buffer.view(), fut, owned=buffer.owned)
        except ProtocolError as exc:  # a receive for the tag is already posted
            fut.set_exception(exc)
            return fut
        if msg is not None:
            self._deliver(msg)
        return fut

    def _deliver(self, msg: Message[asyncio.Future[bytes], None]) -> None:
        """Carry out a delivery the matcher handed back (see :class:`~.matching.Message`)."""
        fut = msg.token
        if fut is None or fut.done():
            return
        if msg.error is not None:
            fut.set_exception(msg.error)
            fut.exception()  # awaiting it still raises; abandoned, it must not log
        elif msg.storage is not None:
            assert msg.dest is not None
            self._copies.start(msg.dest, msg.storage, fut, msg.meta)
        else:
            fut.set_result(msg.meta)
