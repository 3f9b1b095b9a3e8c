"""The shared-memory rings and the control stream as plain values (no fds, no loop): records
in and out, wrap-around, a full ring, the wake-up requests, and malformed peer data."""

from __future__ import annotations

import pytest

from acoll._transport import shmring
from acoll._transport.shmring import (
    ALIGN,
    HDR,
    PAGE,
    Consumer,
    ControlParser,
    Producer,
    Ring,
    SegmentLayout,
    close_frame,
    footprint,
)
from acoll.errors import ProtocolError

META = bytes(range(16))


def _segment(capacity: int = 4 * PAGE) -> tuple[memoryview, SegmentLayout]:
    layout = SegmentLayout(capacity)
    mem = memoryview(bytearray(layout.size))
    layout.write_header(mem)
    return mem, layout


def _ends(capacity: int = 4 * PAGE, index: int = 0) -> tuple[Producer, Consumer]:
    mem, layout = _segment(capacity)
    fences: list[int] = []
    p = Producer(Ring(mem, layout, index), fence=lambda: fences.append(1))
    c = Consumer(Ring(mem, layout, index), fence=lambda: fences.append(1))
    return p, c


def test_layout_and_header_round_trip() -> None:
    mem, layout = _segment(64 << 10)
    assert layout.size == PAGE + 2 * (PAGE + (64 << 10) + PAGE)
    again = SegmentLayout.read_header(mem)
    assert (again.capacity, again.data_size, again.size) == (64 << 10, (64 << 10) + PAGE,
                                                             layout.size)
    ctl0, data0 = layout.ring_offsets(0)
    ctl1, data1 = layout.ring_offsets(1)
    assert data0 == ctl0 + PAGE
    assert ctl1 == data0 + layout.data_size
    assert data1 + layout.data_size == layout.size
    assert all(x % PAGE == 0 for x in (ctl0, data0, ctl1, data1))


@pytest.mark.parametrize("capacity", [0, PAGE, 3 * PAGE, 4 * PAGE + 1])
def test_layout_rejects_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        SegmentLayout(capacity)


def test_read_header_rejects_foreign_or_mismatched_segments() -> None:
    mem, layout = _segment()
    with pytest.raises(ProtocolError, match="does not match"):
        SegmentLayout.read_header(mem[:layout.size - PAGE])
    bad = memoryview(bytearray(layout.size))
    with pytest.raises(ProtocolError, match="not an acoll"):
        SegmentLayout.read_header(bad)
    with pytest.raises(ProtocolError, match="too small"):
        SegmentLayout.read_header(memoryview(bytearray(10)))


def test_record_round_trip_keeps_everything() -> None:
    p, c = _ends()
    assert c.peek() is None
    assert p.write(7, 100, 40, memoryview(b"abc"), META)
    assert p.write(2**64 - 1, 0, 0, memoryview(b""), bytes(16))
    rec = c.peek()
    assert rec is not None
    assert (rec.tag, rec.total, rec.offset, rec.length, rec.meta) == (7, 100, 40, 3, META)
    assert bytes(rec.payload) == b"abc"
    c.release()
    rec = c.peek()
    assert rec is not None
    assert (rec.tag, rec.length) == (2**64 - 1, 0)
    c.release()
    assert c.peek() is None
    assert not c.pending()
    assert p.head == c.tail == footprint(3, 0) + footprint(0, 0)


def test_pad_places_payload_at_the_source_alignment() -> None:
    p, c = _ends()
    for pad in (0, 1, 16, 63):
        assert p.write(1, 5000, 0, memoryview(bytes(5000)), META, pad)
        start = p.head - footprint(5000, pad)
        rec = c.peek()
        assert rec is not None
        # the payload starts pad bytes after the 64-byte header
        assert rec.payload.nbytes == 5000
        assert (start + ALIGN + pad) % ALIGN == pad
        c.release()


def test_full_ring_refuses_then_accepts_after_release() -> None:
    p, c = _ends(4 * PAGE)
    part = PAGE  # four parts of a quarter fill the ring (the page of slack takes headers)
    for i in range(4):
        assert p.write(i, part, 0, memoryview(bytes(part)), META)
    assert not p.write(9, part, 0, memoryview(bytes(part)), META)
    assert not p.fits(part, 0)
    rec = c.peek()
    assert rec is not None
    assert rec.tag == 0
    c.release()
    assert p.fits(part, 0)
    assert p.write(9, part, 0, memoryview(bytes(part)), META)


def test_wrap_around_many_times_keeps_order_and_data() -> None:
    p, c = _ends(4 * PAGE)
    size = p._size
    sent: list[tuple[int, bytes]] = []
    got: list[tuple[int, bytes]] = []
    for rnd in range(400):
        length = (rnd * 977) % (PAGE + 300)
        data = bytes([rnd % 251]) * length
        while not p.write(rnd, length, 0, memoryview(data), META, rnd % 64):
            rec = c.peek()
            assert rec is not None
            got.append((rec.tag, bytes(rec.payload)))
            c.release()
        sent.append((rnd, data))
    while (rec := c.peek()) is not None:
        got.append((rec.tag, bytes(rec.payload)))
        c.release()
    assert got == sent
    assert p.head > 20 * size  # it went round many times


def test_a_record_larger_than_the_ring_is_a_caller_bug() -> None:
    p, _c = _ends(4 * PAGE)
    with pytest.raises(ValueError, match="cannot fit"):
        p.write(1, 10 * PAGE, 0, memoryview(bytes(10 * PAGE)), META)


def test_wake_requests_are_answered_once_each() -> None:
    p, c = _ends()
    assert not p.consumer_wants_wake()  # nobody asked
    assert not c.arm()  # nothing pending
    p.write(1, 1, 0, memoryview(b"x"), META)
    assert p.consumer_wants_wake()
    p.write(2, 1, 0, memoryview(b"y"), META)
    assert not p.consumer_wants_wake()  # already woken for that request
    assert c.arm()  # a fresh request; data is pending already
    assert p.consumer_wants_wake()
    c.disarm()
    p.write(3, 1, 0, memoryview(b"z"), META)
    assert not p.consumer_wants_wake()  # the consumer polls by itself
    # the other way: room
    assert not c.producer_wants_wake()
    p.want_room()
    assert c.producer_wants_wake()
    assert not c.producer_wants_wake()
    p.want_room()
    assert c.producer_wants_wake()
    p.room_found()
    assert not c.producer_wants_wake()


def test_stores_and_loads_of_the_handshake_are_fenced() -> None:
    mem, layout = _segment()
    calls: list[str] = []
    p = Producer(Ring(mem, layout, 1), fence=lambda: calls.append("p"))
    c = Consumer(Ring(mem, layout, 1), fence=lambda: calls.append("c"))
    c.arm()
    p.write(1, 0, 0, memoryview(b""), META)
    p.consumer_wants_wake()
    p.want_room()
    c.producer_wants_wake()
    assert calls == ["c", "p", "p", "c"]


def _corrupt(c: Consumer, p: Producer, **fields: int) -> None:
    """Rewrite the header of the record at the consumer's position."""
    pos = c.tail % c._size
    values = dict(zip(("magic", "kind", "pad", "length", "tag", "total", "offset", "meta"),
                      HDR.unpack_from(c._data, pos), strict=True))
    values.update(fields)
    HDR.pack_into(c._data, pos, *values.values())


@pytest.mark.parametrize(("fields", "match"), [
    ({"magic": 0x1234}, "bad record magic"),
    ({"kind": 9}, "unknown record kind"),
    ({"pad": 64}, "overruns"),
    ({"length": 1 << 30}, "overruns"),
    ({"length": 200}, "overruns"),  # past the published data
])
def test_malformed_records_are_protocol_errors(fields: dict[str, int], match: str) -> None:
    p, c = _ends()
    p.write(1, 10, 0, memoryview(b"0123456789"), META)
    _corrupt(c, p, **fields)
    with pytest.raises(ProtocolError, match=match):
        c.peek()


def test_impossible_positions_are_protocol_errors() -> None:
    p, c = _ends()
    p.write(1, 1, 0, memoryview(b"x"), META)
    c._ctl[shmring.HEAD] = c.tail + c._size + 64  # more than a ring ahead
    with pytest.raises(ProtocolError, match="producer position"):
        c.peek()
    p2, c2 = _ends()
    c2._ctl[shmring.TAIL] = p2.head + 64  # the consumer claims to be ahead
    with pytest.raises(ProtocolError, match="consumer position"):
        p2.write(1, 1, 0, memoryview(b"x"), META)


def test_wrap_record_past_published_data_is_a_protocol_error() -> None:
    _p, c = _ends()
    HDR.pack_into(c._data, 0, shmring.REC_MAGIC, shmring.WRAP, 0, 0, 0, 0, 0, bytes(16))
    c._ctl[shmring.HEAD] = 64  # a wrap claims the whole rest of the ring
    with pytest.raises(ProtocolError, match="wrap record"):
        c.peek()


# ---------------------------------------------------------------------- control stream
def test_control_stream_wakes_and_close_frame_in_pieces() -> None:
    parser = ControlParser()
    frame = close_frame(b"bye now")
    parser.feed(b"WWW" + frame[:2])
    assert parser.notice is None
    parser.feed(frame[2:6])
    assert parser.notice is None
    parser.feed(frame[6:])
    assert parser.notice == b"bye now"
    parser.feed(b"")  # end of file after the close is fine


def test_control_stream_empty_notice() -> None:
    parser = ControlParser()
    parser.feed(b"W" + close_frame(b""))
    assert parser.notice == b""


@pytest.mark.parametrize(("data", "match"), [
    (b"WX", "unknown frame"),
    (close_frame(b"n") + b"W", "after the close frame"),
    (bytes([ord("C")]) + (1 << 20).to_bytes(4, "little"), "close notice of"),
])
def test_control_stream_rejects_garbage(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        ControlParser().feed(data)


def test_close_frame_limit() -> None:
    with pytest.raises(ValueError, match="close notice"):
        close_frame(bytes(shmring.MAX_NOTICE + 1))
