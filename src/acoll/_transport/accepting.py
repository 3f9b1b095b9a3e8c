"""Accepting sockets for a listener that authenticates each one (TCP and shared memory).

What it does (the conformance battery checks that strangers and garbage are refused and
that close fails ``accept``; ``tests/test_transport_tcp.py`` checks the pre-auth limit, over
TCP):

- Sockets are accepted from a readiness callback of the listening socket, at most
  ``_ACCEPT_BUDGET`` per callback; an accept error (EMFILE and friends) is logged and the
  next wake-up tries again. (Not a task awaiting ``sock_accept``: one cancelled just after
  the kernel handed it a socket would drop that socket.)
- Each accepted socket runs the subclass's ``_handshake`` as a task within the pre-auth
  gate of :mod:`acoll._auth`: at most ``ACOLL_PREAUTH_LIMIT`` at once, the oldest cancelled
  for a newcomer. A handshake cancelled before it ran has its socket closed here.
- :meth:`close` stops accepting, cancels every handshake, closes the listening socket and
  aborts connections made but never accepted. Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from abc import abstractmethod
from typing import Any, ClassVar

from .. import _auth, _forkguard
from .._config import get_logger
from .base import QueuedListener

log = get_logger("NET")

_ACCEPT_BUDGET = 64  # sockets accepted per readiness callback


class Evicted(Exception):
    """The listener closed a handshake without answering (not a refusal): try again."""


def close_if_cancelled(sock: socket.socket, task: asyncio.Task[None]) -> None:
    """A task's done callback: close ``sock`` if the task was cancelled (even before it
    ran, when its own cleanup never started)."""
    if task.cancelled():
        sock.close()


def _evict(task: asyncio.Task[None], conn: socket.socket) -> None:
    """Drop a handshake to make room: cancel it, and shut its socket down, which ends
    whatever wait it is in at once (a cancel alone can be lost: Python 3.11's
    ``asyncio.wait_for`` returns the result, not the cancellation, of a step that
    completed in the same loop iteration, and the handshake then waits in its next step
    for its whole deadline). The task closes the socket."""
    task.cancel("pre-auth limit")
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class HandshakeListener(QueuedListener):
    """A :class:`~.base.QueuedListener` on a listening socket whose accepted sockets each
    run :meth:`_handshake` (see the module docstring). Subclasses set their own fields
    before calling ``super().__init__``, which starts accepting."""

    #: the listener's kind in log lines ("data", "shm")
    kind: ClassVar[str]

    def __init__(self, sock: socket.socket, handshake_timeout: float) -> None:
        self._sock = sock
        self._timeout = min(handshake_timeout, _auth.PREAUTH_TIMEOUT.resolve())
        self._gate = _auth.PreAuthGate()
        self._refusals = _auth.RefusalLog(log)
        super().__init__()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        _forkguard.hold(sock)
        self._loop.add_reader(sock.fileno(), self._on_acceptable)

    def _on_acceptable(self) -> None:
        for _ in range(_ACCEPT_BUDGET):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: say so, try again on next wake-up
                log.warning("%s listener accept failed: %s", self.kind, exc)
                return
            _forkguard.hold(conn)
            conn.setblocking(False)
            self._start_handshake(conn, addr)

    def _start_handshake(self, conn: socket.socket, addr: Any) -> None:
        task = self._loop.create_task(self._handshake(conn, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # cancelled before it ran, the handshake never reached its own cleanup
        task.add_done_callback(functools.partial(close_if_cancelled, conn))
        token = self._gate.admit(functools.partial(_evict, task, conn))
        task.add_done_callback(functools.partial(self._left_gate, token))

    def _left(self, deadline: float) -> float:
        """Seconds left of a handshake that must end by ``deadline`` (loop time): one
        deadline for the whole handshake, not one per step (a peer trickling bytes
        would otherwise stretch it step by step)."""
        return max(0.0, deadline - self._loop.time())

    def _left_gate(self, token: int, _task: asyncio.Task[None]) -> None:
        self._gate.leave(token)

    def _handshake_deadline(self) -> float:
        return self._loop.time() + self._timeout

    @abstractmethod
    async def _handshake(self, sock: socket.socket, addr: Any) -> None:
        """Authenticate ``sock`` (accepted from ``addr``) and :meth:`_offer` what it makes,
        or close it (refusals go to ``self._refusals``). Always closes ``sock`` on
        failure or cancellation."""

    def _close_pending(self) -> None:
        """On close, after the handshakes are cancelled: release what a subclass holds
        between handshake and connection (nothing by default)."""

    def close(self, notice: bytes = b"") -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        for task in self._tasks:
            task.cancel()
        self._close_pending()
        self._sock.close()
        self._close_queue(notice)
