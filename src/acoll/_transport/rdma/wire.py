"""Frames sent with verbs SEND between the two ends of an RDMA connection (sans-IO).

Every SEND carries one frame: a fixed header, then (for ``DATA`` and ``CLOSE``) ``length``
payload bytes. Bulk data of large messages does not travel in frames: it is written by
RDMA WRITE (with immediate) into the buffer the receiver advertised in a ``CTS`` frame.

Header (little endian, 72 bytes)::

    B kind | B flags | H 0 | I credits | Q tag | Q total | Q offset | I length
    I send id | Q addr | I rkey | I receive id | 16s meta

``credits`` returns receive credits on every frame (see :class:`~.flow.Credits`).

=========  ==========================================================================
kind       meaning (fields used)
=========  ==========================================================================
DATA       a part of an eagerly sent message: ``length`` bytes at ``offset`` of message
           ``tag`` (``total`` bytes, ``meta``). With flag ``PUSH``: a part of the
           rendezvous message ``send id``, sent this way because its sender is closing.
RTS        "ready to send": message ``tag`` of ``total`` bytes (``meta``) waits at the
           sender as ``send id`` for a buffer to be written into.
CTS        "clear to send": write ``send id`` into ``addr``/``rkey`` (``total`` bytes),
           the last write with immediate data ``receive id``.
DROP       the receive for ``send id`` failed (wrong size): the message is dropped.
CREDIT     nothing but ``credits``.
CLOSE      the sender closes the connection in order; the payload is ``length`` bytes at
           ``offset`` of its notice (``total`` bytes; a long notice takes several).
=========  ==========================================================================
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ...errors import ProtocolError
from ..base import META_SIZE

__all__ = ["CLOSE", "CREDIT", "CTS", "DATA", "DROP", "HEADER", "PUSH", "RTS", "Frame",
           "pack_into", "parse"]

HEADER = struct.Struct("<BBHIQQQIIQII16s")
DATA, RTS, CTS, DROP, CREDIT, CLOSE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {DATA: "DATA", RTS: "RTS", CTS: "CTS", DROP: "DROP", CREDIT: "CREDIT",
              CLOSE: "CLOSE"}
PUSH = 1  # DATA flag
_ZERO_META = bytes(META_SIZE)
_MAX_U64 = (1 << 64) - 1


class Frame(NamedTuple):
    """One parsed header (see the module doc for which fields each kind uses)."""

    kind: int
    flags: int
    credits: int
    tag: int
    total: int
    offset: int
    length: int
    send_id: int
    addr: int
    rkey: int
    rid: int
    meta: bytes


def pack_into(buf: memoryview, kind: int, *, credits: int = 0, tag: int = 0, total: int = 0,
              offset: int = 0, length: int = 0, send_id: int = 0, addr: int = 0,
              rkey: int = 0, rid: int = 0, meta: bytes = _ZERO_META, flags: int = 0) -> int:
    """Write a header at the start of ``buf``; return the frame's size (header + length)."""
    HEADER.pack_into(buf, 0, kind, flags, 0, credits, tag, total, offset, length, send_id,
                     addr, rkey, rid, meta)
    return HEADER.size + length


def parse(buf: memoryview, nbytes: int) -> Frame:
    """Parse the frame of ``nbytes`` bytes at the start of ``buf`` (a receive slot).

    Raises:
        ProtocolError: too short, unknown kind or flags, a size that does not add up, a
            part outside its message.
    """
    if nbytes < HEADER.size:
        raise ProtocolError(f"RDMA frame of {nbytes} bytes is shorter than its header")
    fields = HEADER.unpack_from(buf, 0)
    if fields[2]:
        raise ProtocolError("RDMA frame with non-zero reserved bits")
    frame = Frame(fields[0], fields[1], *fields[3:])
    kind = frame.kind
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown RDMA frame kind {kind}")
    body = nbytes - HEADER.size
    if kind in (DATA, CLOSE):
        if frame.length != body:
            raise ProtocolError(f"{KIND_NAMES[kind]} frame announces {frame.length} bytes "
                                f"and carries {body}")
    elif body or frame.length:
        raise ProtocolError(f"{KIND_NAMES[kind]} frame carries {body} unexpected bytes")
    if frame.flags & ~PUSH or (frame.flags and kind != DATA):
        raise ProtocolError(f"bad flags {frame.flags:#x} on a {KIND_NAMES[kind]} frame")
    if kind in (DATA, CLOSE) and (frame.offset > frame.total
                                  or frame.length > frame.total - frame.offset):
        raise ProtocolError(f"{KIND_NAMES[kind]} part {frame.offset}+{frame.length} exceeds "
                            f"its message of {frame.total} bytes")
    return frame
