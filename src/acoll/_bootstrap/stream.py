"""Framed bootstrap connections: the asyncio driver of :mod:`.wire`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable

from .. import _auth, _forkguard
from .._deadline import deadline_after, wait_until
from ..errors import AcollError, ProtocolError, TransportError
from .wire import (
    DEFAULT_MAX_FRAME,
    Challenge,
    Error,
    FrameDecoder,
    Hello,
    Message,
    PeerHello,
    Proof,
    encode,
)

__all__ = ["AuthFailed", "FramedConnection", "PeerClosed", "close_if_cancelled",
           "close_server", "evict", "leave_gate", "serve_stream", "set_nodelay"]

_READ_SIZE = 1 << 15
#: StreamReader buffer limit of bootstrap connections (what a peer can make us hold
#: beyond the frame being decoded).
READ_LIMIT = 1 << 15


#: Connections accepted per loop wake-up by a bootstrap server: with asyncio's loop each
#: waits for a task before the pre-authentication gate sees it, so a large batch would
#: let a flood hold thousands of descriptors at once.
ACCEPT_BATCH = 64


async def serve_stream(on_connect: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None],
                       sock: socket.socket) -> asyncio.base_events.Server:
    """``asyncio.start_server`` on a listening ``sock``, accepting :data:`ACCEPT_BATCH`
    connections per wake-up while the kernel still queues ``SOMAXCONN`` (bursts of
    hundreds of ranks connecting at once are not dropped).

    ``sock`` is the server's from the call on: if this raises (or is cancelled), the
    socket is closed here, its reader removed from the loop first. (Closed by a caller
    while the loop still watched it, its descriptor number, reused by the next socket,
    would never be watched again: a later server of that loop accepted nothing.)
    """
    try:
        server = await asyncio.start_server(on_connect, sock=sock, backlog=ACCEPT_BATCH,
                                            limit=READ_LIMIT, start_serving=False)
    except BaseException:
        sock.close()
        raise
    try:
        await server.start_serving()
    except BaseException:
        close_server(server)
        raise
    with contextlib.suppress(OSError):  # start_server re-listened with the batch size
        sock.listen(socket.SOMAXCONN)
    return server


def close_server(server: asyncio.base_events.Server) -> None:
    """Stop accepting now and close ``server`` on the loop's next step.

    asyncio's own close() races with a connection accepted in the same loop step: that
    connection's transport is made a step later, finds the server gone (an AssertionError
    that debug mode reports to the loop's exception handler) and its socket is left open.
    Here the listening sockets stop being watched at once (plain asyncio: the loop's
    reader; uvloop accepts on its own and has no such race), and the close waits for the
    step in which such a transport is made; its handler sees the owner closed and ends
    it. On a loop that is not running it closes at once.
    """
    loop = server.get_loop()
    for sock in server.sockets:
        with contextlib.suppress(Exception):  # (a loop that does not own such a reader)
            loop.remove_reader(sock.fileno())
    if loop.is_running():
        loop.call_soon(_close_now, server)
    else:  # (no accept can be in flight; a step scheduled now might never run: abort()
        _close_now(server)  # after run_until_complete() returned)


def _close_now(server: asyncio.base_events.Server) -> None:
    # (a listening socket closed under the server by its owner makes asyncio's close
    # raise ValueError for its descriptor, -1; the server is shut all the same)
    with contextlib.suppress(ValueError):
        server.close()


def evict(writer: asyncio.StreamWriter, task: asyncio.Task[None]) -> None:
    """Drop a connection that has not authenticated (to make room): at once, no linger."""
    task.cancel()
    with contextlib.suppress(Exception):
        writer.transport.abort()


def leave_gate(gate: _auth.PreAuthGate, token: int, _task: object = None) -> None:
    """Done-callback form of ``gate.leave(token)`` (idempotent)."""
    gate.leave(token)


def close_if_cancelled(writer: asyncio.StreamWriter, task: asyncio.Task[None]) -> None:
    """Done-callback for a connection's handler task: a task cancelled before it ran
    never reached its own cleanup, so close the connection here (idempotent)."""
    if task.cancelled():
        writer.close()


class PeerClosed(TransportError):
    """The other end closed the connection (EOF or reset)."""


class AuthFailed(ProtocolError):
    """The other end did not prove that it holds the job's key."""


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class FramedConnection:
    """A stream connection carrying bootstrap frames.

    Until :meth:`accept_auth` or :meth:`connect_auth` succeeded, frames larger than
    :data:`acoll._auth.PREAUTH_MAX_FRAME` are refused; afterwards up to
    :data:`~.wire.DEFAULT_MAX_FRAME`.

    ``recv`` must not be called by two tasks at once; ``send`` may be called any time (it
    queues the frame; ``drain`` waits for the kernel to take it). Low-level errors leave as
    :class:`PeerClosed` (EOF, reset) or :class:`ProtocolError` (bad bytes).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame: int = _auth.PREAUTH_MAX_FRAME) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(max_frame)
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        _forkguard.hold(writer.get_extra_info("socket"))
        set_nodelay(writer)

    @classmethod
    async def connect(cls, sockaddr: tuple[str, int] | tuple[str, int, int, int]
                      ) -> FramedConnection:
        """Open one connection (no retries; raises ``OSError``)."""
        host, port = sockaddr[0], sockaddr[1]
        if len(sockaddr) == 4 and sockaddr[3]:
            host = f"{host}%{sockaddr[3]}"
        reader, writer = await asyncio.open_connection(host, port, limit=READ_LIMIT)
        return cls(reader, writer)

    async def recv(self) -> Message:
        """Return the next message (no deadline here: callers wrap it)."""
        while True:
            msg = self.decoder.next_message()
            if msg is not None:
                return msg
            try:
                data = await self.reader.read(_READ_SIZE)
            except OSError as exc:
                raise PeerClosed(f"connection to {self.peer} failed: {exc}") from exc
            if not data:
                if self.decoder.buffered:
                    raise ProtocolError(f"connection to {self.peer} closed mid-frame")
                raise PeerClosed(f"connection to {self.peer} closed by the peer")
            self.decoder.feed(data)

    def send(self, msg: Message) -> None:
        """Queue one message; raises :class:`PeerClosed` if the connection is gone."""
        if self.writer.is_closing():
            raise PeerClosed(f"connection to {self.peer} is closed")
        self.writer.write(encode(msg))

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except OSError as exc:
            raise PeerClosed(f"connection to {self.peer} failed: {exc}") from exc

    async def accept_or_refuse(self, key: bytes, context: bytes, timeout: float,
                               refusals: _auth.RefusalLog, who: str) -> Hello | PeerHello | None:
        """:meth:`accept_auth` within ``timeout``; on failure log the refusal (rate-limited,
        as ``who``), close, and return ``None``."""
        try:
            return await self.accept_auth(key, context, deadline_after(timeout))
        except PeerClosed as exc:
            # Closed without a word (a rank cancelled while connecting, a port probe):
            # nothing was refused, so no warning (session 57's note).
            refusals.closed("%s: connection from %s closed before authenticating: %s", who,
                            self.peer, exc)
            self.close()
            return None
        except (AcollError, OSError) as exc:
            refusals.refused("%s: refused connection from %s: %s", who, self.peer, exc)
            self.close()
            return None
        except BaseException:
            self.close()
            raise

    async def accept_auth(self, key: bytes, context: bytes, deadline: float
                          ) -> Hello | PeerHello:
        """Acceptor side of the exchange in :mod:`acoll._auth`: return the peer's hello.

        Raises:
            AuthFailed: the first frame is no hello, or its proof is wrong.
            PeerClosed, ProtocolError, acoll.TimeoutError: the exchange broke off.
        """
        nonce_a = _auth.new_nonce()
        self.send(Challenge(nonce_a))
        msg = await wait_until(self.recv(), deadline, "a hello")
        if not isinstance(msg, (Hello, PeerHello)):
            raise AuthFailed(f"{self.peer} sent {type(msg).__name__} instead of a hello")
        if not _auth.verify(msg.proof, key, _auth.CONNECT, context, nonce_a, msg.nonce,
                            msg.claims()):
            # Say why before closing: a rank with the wrong secret must not mistake this
            # for a busy listener and retry.
            self.send(Error("auth", "this rank does not hold the job's id or secret "
                            "(check ACOLL_COMM_SECRET on every rank)", -1))
            raise AuthFailed(f"{self.peer} does not hold this job's key (wrong id or secret)")
        self.send(Proof(_auth.prove(key, _auth.ACCEPT, context, nonce_a, msg.nonce,
                                    msg.claims())))
        self.decoder.max_frame = DEFAULT_MAX_FRAME
        return msg

    async def connect_auth(self, key: bytes, context: bytes, hello: Hello | PeerHello,
                           deadline: float) -> None:
        """Connector side: answer the challenge with ``hello`` (its nonce and proof are
        filled in here) and check the acceptor's proof.

        Raises:
            AuthFailed: the acceptor's proof is wrong, or it sent something else.
            PeerClosed, ProtocolError, acoll.TimeoutError: the exchange broke off.
        """
        msg = await wait_until(self.recv(), deadline, "the acceptor's challenge")
        if not isinstance(msg, Challenge) or len(msg.nonce) != _auth.NONCE_SIZE:
            raise AuthFailed(f"{self.peer} sent {type(msg).__name__} instead of a challenge")
        nonce_c = _auth.new_nonce()
        claims = hello.claims()
        proof = _auth.prove(key, _auth.CONNECT, context, msg.nonce, nonce_c, claims)
        self.send(dataclasses.replace(hello, nonce=nonce_c, proof=proof))
        reply = await wait_until(self.recv(), deadline, "the acceptor's proof")
        if isinstance(reply, Error):
            raise AuthFailed(f"{self.peer} refused us: {reply.message}")
        if not isinstance(reply, Proof) or not _auth.verify(
                reply.proof, key, _auth.ACCEPT, context, msg.nonce, nonce_c, claims):
            raise AuthFailed(f"{self.peer} failed to prove it holds this job's key")
        self.decoder.max_frame = DEFAULT_MAX_FRAME

    def close(self) -> None:
        """Close now (idempotent, never raises)."""
        try:
            self.writer.close()
        except Exception:
            pass
