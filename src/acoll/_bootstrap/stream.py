"""Framed bootstrap connections: the asyncio driver of :mod:`.wire`."""

from __future__ import annotations

import asyncio
import socket

from ..errors import ProtocolError, TransportError
from .wire import DEFAULT_MAX_FRAME, FrameDecoder, Message, encode

__all__ = ["FramedConnection", "PeerClosed", "set_nodelay"]

_READ_SIZE = 1 << 16


class PeerClosed(TransportError):
    """The other end closed the connection (EOF or reset)."""


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class FramedConnection:
    """A stream connection carrying bootstrap frames.

    ``recv`` must not be called by two tasks at once; ``send`` may be called any time (it
    queues the frame; ``drain`` waits for the kernel to take it). Low-level errors leave as
    :class:`PeerClosed` (EOF, reset) or :class:`ProtocolError` (bad bytes).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(max_frame)
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        set_nodelay(writer)

    @classmethod
    async def connect(cls, sockaddr: tuple[str, int] | tuple[str, int, int, int]
                      ) -> FramedConnection:
        """Open one connection (no retries; raises ``OSError``)."""
        host, port = sockaddr[0], sockaddr[1]
        if len(sockaddr) == 4 and sockaddr[3]:
            host = f"{host}%{sockaddr[3]}"
        reader, writer = await asyncio.open_connection(host, port)
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

    def close(self) -> None:
        """Close now (idempotent, never raises)."""
        try:
            self.writer.close()
        except Exception:
            pass
