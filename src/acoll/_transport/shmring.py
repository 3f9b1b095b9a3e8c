"""Shared-memory rings of the SHM transport, as plain state machines over memory (sans-IO).

One *segment* (a memfd both processes map) carries a connection: a header page, then two
rings, one per direction. This module knows the layout, the record format and the
producer/consumer rules, and nothing about file descriptors, sockets or the event loop:
it works on any writable memoryview (tests use a bytearray).

Segment layout (little endian)::

    0                 header: 8s magic b"ACSHMSEG" | I version | I ring count (2)
                              | Q ring capacity | Q data bytes per ring | Q lane bytes
    PAGE              ring 0 control (one page), then ring 0 data
    PAGE + RING_SPAN  ring 1 control, then ring 1 data
    then              mailbox 0, mailbox 1 (each padded to pages; none when lane is 0)

Ring 0 and mailbox 0 carry the connector's data to the acceptor, ring 1 and mailbox 1 the
other way. The mailboxes serve the communicator's lane for small collectives
(:mod:`.shmlane`).

Control page of a ring, 64-bit words in two cache lines, each written by one side only:

- producer line: ``HEAD`` (bytes ever published), ``TX_WAIT`` (nonzero: "wake me when
  room is freed", a fresh value per request);
- consumer line: ``TAIL`` (bytes ever released), ``RX_WAIT`` (nonzero: "wake me when data
  is published").

Records start at multiples of 64 bytes in the data area and never wrap around its end: a
record that does not fit before the end is preceded by a *wrap* record that fills the
rest. A record is a 64-byte header, ``pad`` bytes, the payload, and padding to 64::

    H magic 0xAC5E | B kind (1 data, 2 wrap) | B pad | I payload length
    Q tag | Q message total size | Q offset of this part | 16s meta | 16x

``pad`` (0-63) lets the sender place the payload at the same address modulo 64 as its
source buffer: x86 string copies whose destination sits a few bytes past the source
modulo 4096 run at a tenth of their speed.

Ordering: the producer writes a record, then stores ``HEAD``; the consumer loads
``HEAD``, then reads records, copies payloads out, then stores ``TAIL``. On x86-64 (total
store order) plain loads and stores keep that order, which is all the data path needs.
The wake-up handshake is Dekker's: each side stores its own word, then loads the other's;
that needs a full barrier between the store and the load, which ``fence`` provides.

Beside the segment, the two processes share a Unix stream socket, the *control stream*:
it carries wake-up bytes (``W``) and, last, the close frame (``C`` | I length | notice) of an
orderly close; its end of file tells that the peer process is gone. :class:`ControlParser`
reads it.

Whatever the peer wrote is checked before use (positions, record bounds, sizes): a broken
or hostile peer gets :class:`~acoll.errors.ProtocolError`, never an out-of-bounds access.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

from ..errors import ProtocolError
from .shmlane import mailbox_span

__all__ = ["ALIGN", "HDR", "MAX_NOTICE", "PAGE", "WAKE", "Consumer", "ControlParser", "Producer",
           "Record", "Ring", "SegmentLayout", "close_frame", "fence", "footprint"]

PAGE = 4096
ALIGN = 64
SEG_MAGIC = b"ACSHMSEG"
SEG_VERSION = 2
_SEG_HDR = struct.Struct("<8sIIQQQ")
MAX_LANE = 2 << 20

HDR = struct.Struct("<HBBIQQQ16s16x")
assert HDR.size == ALIGN
REC_MAGIC = 0xAC5E
DATA, WRAP = 1, 2
_EMPTY_META = bytes(16)

# word indices in a control page (cast to unsigned 64-bit)
HEAD, TX_WAIT = 0, 1  # producer's cache line
TAIL, RX_WAIT = 16, 17  # consumer's cache line (byte offset 128)

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (store-load included) on x86-64.

    Acquiring and releasing a lock executes locked read-modify-write instructions, each a
    full barrier there (CPython's locks are built on them whatever the version). The SHM
    transport only runs on x86-64 (see :mod:`acoll._transport.shm`).
    """
    _fence_lock.acquire()
    _fence_lock.release()


def footprint(length: int, pad: int) -> int:
    """Bytes a record with ``length`` payload bytes after ``pad`` bytes occupies."""
    return (ALIGN + pad + length + ALIGN - 1) & ~(ALIGN - 1)


class SegmentLayout:
    """Where things are in a segment whose rings hold ``capacity`` bytes of records each.

    Each ring's data area is ``capacity`` plus one page, so that ``capacity // 4``-byte
    parts (the largest a producer writes by default) fit four at a time with their
    headers.
    """

    def __init__(self, capacity: int, lane: int = 0) -> None:
        if capacity < 4 * PAGE or capacity % PAGE:
            raise ValueError(f"ring capacity {capacity}: must be a multiple of {PAGE} "
                             f"and at least {4 * PAGE}")
        if not 0 <= lane <= MAX_LANE:
            raise ValueError(f"lane of {lane} bytes: at most {MAX_LANE}")
        self.capacity = capacity
        self.lane = lane
        self.data_size = capacity + PAGE
        self.span = PAGE + self.data_size  # one ring: control page + data
        self.box = mailbox_span(lane)
        self.box_span = (self.box + PAGE - 1) & ~(PAGE - 1)
        self.size = PAGE + 2 * self.span + 2 * self.box_span

    def box_offset(self, index: int) -> int:
        """Offset of mailbox ``index`` (0 or 1; only when ``lane`` is not 0)."""
        return PAGE + 2 * self.span + index * self.box_span

    def ring_offsets(self, index: int) -> tuple[int, int]:
        """(control offset, data offset) of ring ``index`` (0 or 1)."""
        ctl = PAGE + index * self.span
        return ctl, ctl + PAGE

    def write_header(self, mem: memoryview) -> None:
        """Initialise a fresh (zeroed) segment: the creator calls this before sharing it."""
        _SEG_HDR.pack_into(mem, 0, SEG_MAGIC, SEG_VERSION, 2, self.capacity, self.data_size,
                           self.lane)

    @classmethod
    def read_header(cls, mem: memoryview) -> SegmentLayout:
        """The layout a segment's header announces, checked against the segment's size.

        Raises:
            ProtocolError: not an acoll segment, another version, or sizes that disagree.
        """
        if mem.nbytes < PAGE:
            raise ProtocolError(f"shared segment of {mem.nbytes} bytes is too small")
        magic, version, nrings, capacity, data_size, lane = _SEG_HDR.unpack_from(mem, 0)
        if magic != SEG_MAGIC or version != SEG_VERSION or nrings != 2:
            raise ProtocolError("not an acoll shared-memory segment (or another version)")
        try:
            layout = cls(capacity, lane)
        except ValueError as exc:
            raise ProtocolError(f"bad shared segment header: {exc}") from None
        if layout.data_size != data_size or layout.size != mem.nbytes:
            raise ProtocolError(f"shared segment of {mem.nbytes} bytes does not match its "
                                f"header (capacity {capacity})")
        return layout


class Ring:
    """One direction of a segment: its control words and data area (views of ``mem``)."""

    def __init__(self, mem: memoryview, layout: SegmentLayout, index: int) -> None:
        ctl, data = layout.ring_offsets(index)
        self.ctl = mem[ctl:ctl + PAGE].cast("Q")
        self.data = mem[data:data + layout.data_size]
        self.size = layout.data_size

    def release(self) -> None:
        """Drop the views (the segment can then be unmapped)."""
        self.ctl.release()
        self.data.release()


class Record:
    """A data record the consumer is looking at (valid until :meth:`Consumer.release`)."""

    __slots__ = ("length", "meta", "offset", "payload", "tag", "total")

    def __init__(self, tag: int, total: int, offset: int, length: int, meta: bytes,
                 payload: memoryview) -> None:
        self.tag = tag
        self.total = total
        self.offset = offset
        self.length = length
        self.meta = meta
        self.payload = payload


class Producer:
    """The writing side of a ring.

    :meth:`write` appends a record and publishes it; it returns ``False`` when the ring has
    no room, after which the owner calls :meth:`want_room` and, if that also says no room,
    waits to be woken by the consumer. After publishing, :meth:`consumer_wants_wake` says
    whether to wake the consumer.
    """

    def __init__(self, ring: Ring, fence: Callable[[], None] = fence) -> None:
        self.ring = ring
        self._ctl = ring.ctl
        self._data = ring.data
        self._size = ring.size
        self._fence = fence
        self.head = self._ctl[HEAD]
        self._woken = 0  # the consumer's wait request we already woke it for
        self._epoch = 0
        self.waiting = False  # TX_WAIT is set

    def free(self) -> int:
        """Bytes the consumer has released and not yet refilled.

        Raises:
            ProtocolError: the consumer's position is impossible.
        """
        used = self.head - self._ctl[TAIL]
        if not 0 <= used <= self._size:
            raise ProtocolError(f"shared ring: consumer position is {used} bytes behind "
                                f"the producer's (ring of {self._size})")
        return self._size - used

    def fits(self, length: int, pad: int) -> bool:
        """Whether a record of ``length`` payload bytes after ``pad`` fits now."""
        need = footprint(length, pad)
        pos = self.head % self._size
        if need > self._size - pos:
            need += self._size - pos
        return need <= self.free()

    def write(self, tag: int, total: int, offset: int, payload: memoryview, meta: bytes,
              pad: int = 0) -> bool:
        """Append and publish one data record; ``False`` (nothing written) if it does not
        fit now. ``payload`` is copied into the ring."""
        length = payload.nbytes
        need = footprint(length, pad)
        size = self._size
        if need > size:
            raise ValueError(f"a record of {length} bytes cannot fit a ring of {size}")
        head = self.head
        pos = head % size
        free = self.free()
        data = self._data
        if need > size - pos:  # wrap first
            if need + size - pos > free:
                return False
            HDR.pack_into(data, pos, REC_MAGIC, WRAP, 0, 0, 0, 0, 0, _EMPTY_META)
            head += size - pos
            pos = 0
        elif need > free:
            return False
        HDR.pack_into(data, pos, REC_MAGIC, DATA, pad, length, tag, total, offset, meta)
        if length:
            start = pos + ALIGN + pad
            data[start:start + length] = payload
        self.head = head + need
        self._ctl[HEAD] = self.head  # publish (stores are not reordered on x86-64)
        return True

    def consumer_wants_wake(self) -> bool:
        """Whether the consumer asked to be woken and was not woken for that request yet
        (then it is counted as woken). Call after publishing."""
        self._fence()
        want = self._ctl[RX_WAIT]
        if want and want != self._woken:
            self._woken = want
            return True
        return False

    def want_room(self) -> None:
        """Ask the consumer to wake us when it frees room (a fresh request each call);
        the owner re-checks :meth:`fits` afterwards, as room may have come meanwhile."""
        self._epoch += 1
        self._ctl[TX_WAIT] = self._epoch
        self.waiting = True
        self._fence()

    def room_found(self) -> None:
        """Withdraw the request of :meth:`want_room` (nothing is waiting for room now)."""
        if self.waiting:
            self._ctl[TX_WAIT] = 0
            self.waiting = False


class Consumer:
    """The reading side of a ring: :meth:`peek` the next data record, copy its payload
    out, :meth:`release` it, then :meth:`producer_wants_wake` says whether to wake the
    producer (it waits for room)."""

    def __init__(self, ring: Ring, fence: Callable[[], None] = fence) -> None:
        self.ring = ring
        self._ctl = ring.ctl
        self._data = ring.data
        self._size = ring.size
        self._fence = fence
        self.tail = self._ctl[TAIL]
        self._next = self.tail  # where the record being looked at ends
        self._woken = 0
        self._epoch = 0
        self.armed = False  # RX_WAIT is set

    def pending(self) -> bool:
        """Whether anything was published that is not released yet."""
        return bool(self._ctl[HEAD] != self.tail)

    def peek(self) -> Record | None:
        """The next data record, or ``None`` if the ring holds no more (wrap records are
        skipped and released).

        Raises:
            ProtocolError: the producer's position or the record is malformed.
        """
        head = self._ctl[HEAD]
        tail = self.tail
        size = self._size
        while head != tail:
            avail = head - tail
            if not 0 < avail <= size:
                raise ProtocolError(f"shared ring: producer position is {avail} bytes ahead "
                                    f"of the consumer's (ring of {size})")
            pos = tail % size
            magic, kind, pad, length, tag, total, offset, meta = HDR.unpack_from(
                self._data, pos)
            if magic != REC_MAGIC:
                raise ProtocolError(f"shared ring: bad record magic {magic:#x}")
            if kind == WRAP:
                if size - pos > avail:
                    raise ProtocolError("shared ring: wrap record past the published data")
                tail += size - pos
                self.tail = tail
                self._ctl[TAIL] = tail
                continue
            if kind != DATA:
                raise ProtocolError(f"shared ring: unknown record kind {kind}")
            need = footprint(length, pad)
            if pad >= ALIGN or need > size - pos or need > avail:
                raise ProtocolError(f"shared ring: record of {length} bytes (pad {pad}) "
                                    f"overruns the ring or the published data")
            start = pos + ALIGN + pad
            self._next = tail + need
            return Record(tag, total, offset, length, meta,
                          self._data[start:start + length])
        return None

    def release(self) -> None:
        """Give the record returned by the last :meth:`peek` back to the producer."""
        self.tail = self._next
        self._ctl[TAIL] = self.tail

    def producer_wants_wake(self) -> bool:
        """Whether the producer waits for room and was not woken for that request yet
        (then it is counted as woken). Call after releasing."""
        self._fence()
        want = self._ctl[TX_WAIT]
        if want and want != self._woken:
            self._woken = want
            return True
        return False

    def arm(self) -> bool:
        """Ask the producer to wake us on its next publish (a fresh request); returns
        whether data is pending already (then read it: no wake-up may come for it)."""
        self._epoch += 1
        self._ctl[RX_WAIT] = self._epoch
        self.armed = True
        self._fence()
        return self.pending()

    def disarm(self) -> None:
        """Withdraw the request (the owner polls the ring itself for a while)."""
        if self.armed:
            self._ctl[RX_WAIT] = 0
            self.armed = False


# ---------------------------------------------------------------------- control stream
WAKE = b"W"
_CLOSE = ord("C")
_CLOSE_HDR = struct.Struct("<BI")
MAX_NOTICE = 1 << 16


def close_frame(notice: bytes) -> bytes:
    """The control-stream frame of an orderly close carrying ``notice``."""
    if len(notice) > MAX_NOTICE:
        raise ValueError(f"close notice of {len(notice)} bytes (at most {MAX_NOTICE})")
    return _CLOSE_HDR.pack(_CLOSE, len(notice)) + notice


class ControlParser:
    """Reads the control stream: wake-ups (nothing to report) and the close frame.

    Attributes:
        notice: the close frame's notice once it has come whole, else ``None``.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self.notice: bytes | None = None

    def feed(self, data: bytes) -> None:
        """Take bytes read from the stream.

        Raises:
            ProtocolError: an unknown frame, a notice longer than :data:`MAX_NOTICE`, or
                bytes after the close frame.
        """
        if self.notice is not None:
            if data:
                raise ProtocolError("control stream: data after the close frame")
            return
        if not self._buf:
            data = data.lstrip(WAKE)
            if not data:
                return
        buf = self._buf
        buf += data
        if buf[0] != _CLOSE:
            raise ProtocolError(f"control stream: unknown frame {bytes(buf[:1])!r}")
        if len(buf) < _CLOSE_HDR.size:
            return
        _, length = _CLOSE_HDR.unpack_from(buf, 0)
        if length > MAX_NOTICE:
            raise ProtocolError(f"control stream: close notice of {length} bytes")
        end = _CLOSE_HDR.size + length
        if len(buf) < end:
            return
        if len(buf) > end:
            raise ProtocolError("control stream: data after the close frame")
        self.notice = bytes(buf[_CLOSE_HDR.size:end])
        buf.clear()
