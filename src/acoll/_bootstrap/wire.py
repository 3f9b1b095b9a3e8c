"""The bootstrap/control wire format: a sans-IO codec (no sockets here).

A frame is a 12-byte header followed by a msgpack map::

    0  4s  magic    b"ACBS"
    4  B   version  (1)
    5  B   type     (:class:`MsgType`)
    6  2x  zero
    8  I   length of the msgpack body in bytes (at most ``max_frame``)

Each message type is a frozen dataclass whose fields are checked when decoded, so a frame
with a missing or mistyped field is reported by name as :class:`~acoll.errors.ProtocolError`.
msgpack is used with ``strict_map_key`` and without ``ext`` types: nothing on the wire can
create arbitrary Python objects (no pickle anywhere).

Use :func:`encode` to turn a message into bytes and :class:`FrameDecoder` to turn received
bytes back into messages (``feed`` then ``next_message`` until it returns ``None``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar

import msgpack

from ..errors import ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "HEADER",
    "Challenge",
    "Error",
    "FrameDecoder",
    "Hello",
    "Message",
    "MsgType",
    "PeerHello",
    "Proof",
    "RingInfo",
    "Tagged",
    "encode",
]

MAGIC = b"ACBS"
VERSION = 1
HEADER = struct.Struct("!4sBB2xI")
#: Largest body accepted (bootstrap messages are small; 64 MiB leaves room for
#: all-gathers of thousands of ranks' information and for split/bootstrap user payloads).
DEFAULT_MAX_FRAME = 64 << 20
_MAX_STR = 1 << 20


class MsgType(IntEnum):
    """Frame types."""

    HELLO = 1  # rank -> root: who I am and where I listen
    RING_INFO = 2  # root -> rank: the next rank's address
    ERROR = 3  # either way: the job failed, with the reason
    PEER_HELLO = 4  # rank -> rank: first frame on every rank-to-rank connection
    TAGGED = 5  # rank -> rank: a tagged bootstrap payload
    CHALLENGE = 6  # acceptor -> connector: first frame on every connection (a nonce)
    PROOF = 7  # acceptor -> connector: the acceptor's proof, once the connector's checked


Address = tuple[str, int, int]  # host, port, IPv6 scope id (0 for IPv4)


@dataclass(frozen=True)
class _Msg:
    TYPE: ClassVar[MsgType]

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _addr(value: object, name: str) -> Address:
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not isinstance(value[0], str) or type(value[1]) is not int
            or type(value[2]) is not int or not 0 < value[1] < 65536
            or not 0 <= value[2] < 1 << 32):
        raise ProtocolError(f"field {name!r} is not an address [host, port, scope]")
    return (value[0], value[1], value[2])


def _peers(value: object) -> tuple[tuple[int, Address], ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 64:
        raise ProtocolError("field 'peers' is not a list of at most 64 [rank, address]")
    out = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or type(item[0]) is not int
                or item[0] < 0):
            raise ProtocolError("field 'peers' has an entry that is not [rank, address]")
        out.append((item[0], _addr(item[1], "peers")))
    return tuple(out)


@dataclass(frozen=True)
class Challenge(_Msg):
    """Acceptor -> connector: the acceptor's nonce (see :mod:`acoll._auth`)."""

    TYPE: ClassVar[MsgType] = MsgType.CHALLENGE
    nonce: bytes


@dataclass(frozen=True)
class Proof(_Msg):
    """Acceptor -> connector: proof that the acceptor holds the job's key."""

    TYPE: ClassVar[MsgType] = MsgType.PROOF
    proof: bytes


@dataclass(frozen=True)
class Hello(_Msg):
    """Rank -> root: my rank, the job size, my listening address, and my proof.

    ``proof`` covers both nonces and :meth:`claims` (every other field)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    nonce: bytes
    proof: bytes
    rank: int
    nranks: int
    addr: Address
    host_hash: int
    pid: int
    info: bytes = b""  # opaque rank information the root may hand to every rank

    def claims(self) -> bytes:
        """The bytes the proof binds: every field but the nonce and the proof."""
        return bytes(msgpack.packb([self.rank, self.nranks, list(self.addr), self.host_hash,
                                    self.pid, self.info], use_bin_type=True))


@dataclass(frozen=True)
class RingInfo(_Msg):
    """Root -> rank: the next rank's address (``rank + 1`` mod ``nranks``), and ``peers``:
    ``(rank, address)`` of ranks ``rank - 2**k``, the first all-gather's partners."""

    TYPE: ClassVar[MsgType] = MsgType.RING_INFO
    nranks: int
    next_addr: Address
    peers: tuple[tuple[int, Address], ...] = ()
    infos: tuple[bytes, ...] = ()  # every rank's Hello.info, when the root sends the table

    def to_wire(self) -> dict[str, Any]:
        return {"nranks": self.nranks, "next_addr": self.next_addr,
                "peers": [[r, a] for r, a in self.peers], "infos": list(self.infos)}


@dataclass(frozen=True)
class Error(_Msg):
    """The job failed. ``kind``: ``usage``, ``timeout``, ``bootstrap``, ``remote`` or ``closed``."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    kind: str
    message: str
    rank: int  # the rank the error is about, -1 when none


@dataclass(frozen=True)
class PeerHello(_Msg):
    """First frame a rank sends on a connection to another rank (``to``), with its proof."""

    TYPE: ClassVar[MsgType] = MsgType.PEER_HELLO
    nonce: bytes
    proof: bytes
    rank: int
    to: int
    nranks: int

    def claims(self) -> bytes:
        return bytes(msgpack.packb([self.rank, self.to, self.nranks]))


@dataclass(frozen=True)
class Tagged(_Msg):
    """A bootstrap payload for the receiver's ``recv(peer, tag)``."""

    TYPE: ClassVar[MsgType] = MsgType.TAGGED
    tag: int
    payload: bytes


Message = Hello | RingInfo | Error | PeerHello | Tagged | Challenge | Proof
_CLASSES: dict[MsgType, type[_Msg]] = {
    c.TYPE: c for c in (Hello, RingInfo, Error, PeerHello, Tagged, Challenge, Proof)
}
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "nonce": bytes, "proof": bytes, "to": int, "rank": int, "nranks": int, "host_hash": int,
    "pid": int,
    "kind": str, "message": str, "tag": int, "payload": bytes, "info": bytes,
}


def encode(msg: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Serialise one message to a complete frame.

    Raises:
        ProtocolError: the message could not be decoded by a peer (a field out of range,
            a string over 1 MiB, or a body over ``max_frame``), so it is refused here.
    """
    try:
        body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(body) > max_frame:
        raise ProtocolError(f"{type(msg).__name__} of {len(body)} bytes exceeds the frame "
                            f"limit {max_frame}")
    for name in ("message", "kind"):
        if len(getattr(msg, name, "")) > _MAX_STR:
            raise ProtocolError(f"{type(msg).__name__} field {name!r} is over 1 MiB")
    return HEADER.pack(MAGIC, VERSION, int(msg.TYPE), len(body)) + body


def _build(mtype: MsgType, body: object) -> Message:
    cls = _CLASSES[mtype]
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__} body is not a map")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            raise ProtocolError(f"{cls.__name__} frame lacks field {f.name!r}")
        value = body[f.name]
        if f.name in ("addr", "next_addr"):
            value = _addr(value, f.name)
        elif f.name == "peers":
            value = _peers(value)
        elif f.name == "infos":
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(item, bytes) for item in value):
                raise ProtocolError("field 'infos' is not a list of bytes")
            value = tuple(value)
        else:
            want = _FIELD_TYPES[f.name]
            if not isinstance(value, want) or isinstance(value, bool):
                raise ProtocolError(
                    f"{cls.__name__} field {f.name!r} has type {type(value).__name__}")
        kwargs[f.name] = value
    extra = set(body) - set(kwargs)
    if extra:
        raise ProtocolError(f"{cls.__name__} frame has unknown fields {sorted(extra)}")
    return cls(**kwargs)  # type: ignore[return-value]


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes in, take whole messages out.

    Contract: ``next_message`` returns the next complete message, or ``None`` when more
    bytes are needed. Any violation of the format raises :class:`ProtocolError` and
    leaves the decoder failed (every later call raises again): the stream cannot be
    resynchronised, so the connection must be dropped.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame
        self._failed: ProtocolError | None = None

    @property
    def max_frame(self) -> int:
        """Largest body accepted; raise it once the peer has authenticated."""
        return self._max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._max_frame = value

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes (raises the earlier error if the decoder has failed)."""
        if self._failed is not None:
            raise self._failed
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf)

    def next_message(self) -> Message | None:
        """Return the next message, ``None`` if incomplete; raise ``ProtocolError`` if bad."""
        if self._failed is not None:
            raise self._failed
        try:
            return self._next()
        except ProtocolError as exc:
            self._failed = exc
            raise

    def _next(self) -> Message | None:
        if len(self._buf) < HEADER.size:
            if self._buf and not MAGIC.startswith(bytes(self._buf[:4])):
                raise ProtocolError(f"bad frame magic {bytes(self._buf[:4])!r}")
            return None
        magic, version, mtype, length = HEADER.unpack_from(self._buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}")
        if version != VERSION:
            raise ProtocolError(f"frame version {version} not supported (this is {VERSION})")
        if self._buf[6:8] != b"\0\0":
            raise ProtocolError("frame header padding is not zero")
        try:
            kind = MsgType(mtype)
        except ValueError:
            raise ProtocolError(f"unknown frame type {mtype}") from None
        if length > self._max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit {self._max_frame}")
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        raw = bytes(self._buf[HEADER.size:end])
        del self._buf[:end]
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                   max_bin_len=self._max_frame, max_str_len=_MAX_STR)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"{kind.name} frame body is not valid msgpack: {exc}") from exc
        return _build(kind, body)
