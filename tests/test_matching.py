"""The tag-matching rules of :mod:`acoll._transport.matching`, with bytes only: no sockets,
no event loop. Tokens are strings; storage is plain ``bytearray`` memory whose allocations
are recorded."""

from __future__ import annotations

import itertools
import random

import pytest

from acoll._transport.base import ConnectionLost, MessageSizeError
from acoll._transport.matching import Matcher, Message
from acoll.errors import ProtocolError

M = Matcher[str, str]
Msg = Message[str, str]


class Alloc:
    """A storage allocator that records the sizes it was asked for."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, n: int) -> memoryview:
        self.sizes.append(n)
        return memoryview(bytearray(n))


def meta(n: int) -> bytes:
    return n.to_bytes(16, "little")


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def matcher(max_early: int | None = None) -> tuple[M, Alloc]:
    alloc = Alloc()
    return Matcher(alloc, max_early=max_early, limit_name="TEST_LIMIT"), alloc


def stream(m: M, tag: int, payload: bytes, parts: list[tuple[int, int]] | None = None,
           mt: bytes = b"", total: int | None = None) -> list[Msg]:
    """Feed ``payload`` as parts ``(offset, length)`` (default: one part); return the
    deliveries handed back."""
    total = len(payload) if total is None else total
    out: list[Msg] = []
    for offset, length in parts or [(0, len(payload))]:
        msg, dest = m.place(tag, total, offset, length, mt or meta(tag))
        if dest is not None:
            dest[:] = payload[offset:offset + length]
        done = m.landed(msg, length)
        if done is not None:
            out.append(done)
    return out


def finish(d: Msg) -> bytes:
    """Carry out a successful delivery the way a transport does; return the meta."""
    assert d.error is None
    assert d.dest is not None
    if d.storage is not None:
        d.dest[:] = d.storage
    elif d.ref is not None:
        d.dest[:] = d.ref.encode()
    return d.meta


# ------------------------------------------------------------------ the two orders
def test_posted_then_arrived_lands_in_place() -> None:
    m, alloc = matcher()
    buf = bytearray(1000)
    assert m.post(7, memoryview(buf), "r7") is None
    msg, dest = m.place(7, 1000, 0, 1000, meta(7))
    assert dest is not None
    dest[:] = data(1000)
    assert buf == data(1000)  # zero copy: the part went straight into the buffer
    [d] = [x for x in [m.landed(msg, 1000)] if x is not None]
    assert (d.token, d.meta, d.error, d.storage, d.ref) == ("r7", meta(7), None, None, None)
    assert alloc.sizes == []
    assert m.take_arrivals() == []
    assert len(m) == 0


def test_arrived_then_posted_comes_from_storage() -> None:
    m, alloc = matcher()
    assert stream(m, 3, data(500)) == []
    assert alloc.sizes == [500]
    assert m.take_arrivals() == [(3, meta(3))]
    buf = bytearray(500)
    d = m.post(3, memoryview(buf), "r3")
    assert d is not None
    assert d.token == "r3"
    assert d.storage is not None
    assert bytes(d.storage) == data(500)
    assert finish(d) == meta(3)
    assert buf == data(500)
    assert len(m) == 0


def test_parts_at_offsets_out_of_order() -> None:
    payload = data(3000, 1)
    parts = [(2000, 1000), (0, 1000), (1000, 1000)]
    # posted first: each part lands at its offset of the posted buffer
    m, alloc = matcher()
    buf = bytearray(3000)
    m.post(1, memoryview(buf), "r")
    [d] = stream(m, 1, payload, parts)
    assert d.token == "r"
    assert buf == payload
    assert alloc.sizes == []
    # early: into storage at the same offsets, then copied out whole
    m, alloc = matcher()
    assert stream(m, 1, payload, parts) == []
    assert m.take_arrivals() == [(1, meta(1))]  # once for the message, not per part
    out = bytearray(3000)
    d2 = m.post(1, memoryview(out), "r")
    assert d2 is not None
    finish(d2)
    assert out == payload
    assert alloc.sizes == [3000]


def test_interleaved_parts_landing_piecewise() -> None:
    """Two parts announced before either lands (two sockets), bytes landing in pieces;
    only the last byte completes the message."""
    m, _ = matcher()
    buf = bytearray(200)
    m.post(5, memoryview(buf), "r")
    a, da = m.place(5, 200, 100, 100, meta(5))
    b, db = m.place(5, 200, 0, 100, meta(5))
    assert a is b
    assert da is not None
    assert db is not None
    payload = data(200, 2)
    da[:] = payload[100:]
    db[:] = payload[:100]
    for n in (30, 70, 99):
        assert m.landed(a, n) is None
    d = m.landed(a, 1)
    assert d is not None
    assert d.token == "r"
    assert buf == payload


def test_receive_posted_while_early_message_is_arriving() -> None:
    m, _ = matcher()
    payload = data(300, 3)
    msg, dest = m.place(9, 300, 0, 300, meta(9))
    assert dest is not None
    dest[:150] = payload[:150]
    assert m.landed(msg, 150) is None
    out = bytearray(300)
    assert m.post(9, memoryview(out), "r") is None  # delivered once complete
    dest[150:] = payload[150:]
    d = m.landed(msg, 150)
    assert d is not None
    assert d.token == "r"
    assert d.storage is not None
    finish(d)
    assert out == payload


def test_zero_byte_messages() -> None:
    m, alloc = matcher()
    m.post(1, memoryview(bytearray(0)), "r1")
    [d] = stream(m, 1, b"")
    assert d.token == "r1"
    assert stream(m, 2, b"") == []
    d2 = m.post(2, memoryview(bytearray(0)), "r2")
    assert d2 is not None
    assert finish(d2) == meta(2)
    assert alloc.sizes == []


# ------------------------------------------------------------------ size mismatch
def test_size_mismatch_posted_first_is_drained_then_failed() -> None:
    m, alloc = matcher()
    m.post(4, memoryview(bytearray(8)), "r")
    payload = data(100, 4)
    msg, dest = m.place(4, 100, 0, 60, meta(4))
    assert dest is None  # dropped, never stored
    assert m.landed(msg, 60) is None  # not failed before the whole message is consumed
    with pytest.raises(ProtocolError, match="already posted"):  # the tag is still taken
        m.post(4, memoryview(bytearray(100)), "again")
    [d] = stream(m, 4, payload, [(60, 40)])
    assert d.token == "r"
    assert isinstance(d.error, MessageSizeError)
    assert (d.error.tag, d.error.expected, d.error.got, d.error.meta) == (4, 8, 100, meta(4))
    assert alloc.sizes == []
    # drain-then-repost: the same tag may be posted at once, and gets the next message
    out = bytearray(100)
    assert m.post(4, memoryview(out), "r2") is None
    [d2] = stream(m, 4, payload)
    assert d2.token == "r2"
    assert out == payload


def test_size_mismatch_arrived_first_complete_fails_at_once() -> None:
    m, _ = matcher()
    stream(m, 2, data(50))
    d = m.post(2, memoryview(bytearray(49)), "r")
    assert d is not None
    assert isinstance(d.error, MessageSizeError)
    assert (d.error.expected, d.error.got) == (49, 50)
    assert len(m) == 0  # the message is dropped
    assert m.post(2, memoryview(bytearray(50)), "r2") is None  # waits for a new message


def test_size_mismatch_arrived_first_partial_drops_storage() -> None:
    m, _ = matcher()
    payload = data(100, 5)
    msg, dest = m.place(6, 100, 0, 100, meta(6))
    assert dest is not None
    assert m.landed(msg, 40) is None
    assert m.post(6, memoryview(bytearray(10)), "r") is None
    assert msg.storage is None  # released at once
    with pytest.raises(ProtocolError, match="already posted"):
        m.post(6, memoryview(bytearray(100)), "dup")
    d = m.landed(msg, 60)  # the rest of the part (read into the old view, or dropped)
    assert d is not None
    assert isinstance(d.error, MessageSizeError)
    assert (d.error.expected, d.error.got, d.error.meta) == (10, 100, meta(6))
    out = bytearray(100)
    assert m.post(6, memoryview(out), "r2") is None
    [d2] = stream(m, 6, payload)
    assert d2.token == "r2"
    assert out == payload


def test_parts_of_a_drained_message_on_several_sockets() -> None:
    m, _ = matcher()
    m.post(1, memoryview(bytearray(5)), "r")
    a, da = m.place(1, 20, 10, 10, meta(1))
    b, db = m.place(1, 20, 0, 10, meta(1))
    assert a is b
    assert (da, db) == (None, None)
    assert m.landed(a, 10) is None
    d = m.landed(b, 10)
    assert d is not None
    assert isinstance(d.error, MessageSizeError)


# ------------------------------------------------------------------ caller and peer bugs
def test_duplicate_post_is_refused_and_changes_nothing() -> None:
    m, _ = matcher()
    buf = bytearray(4)
    m.post(1, memoryview(buf), "first")
    with pytest.raises(ProtocolError, match="a receive for tag 0x1 is already posted"):
        m.post(1, memoryview(bytearray(4)), "second")
    [d] = stream(m, 1, b"abcd")
    assert d.token == "first"
    assert buf == b"abcd"
    # a receive attached to an early message that is still arriving counts too
    msg, _dest = m.place(2, 4, 0, 4, meta(2))
    m.landed(msg, 2)
    m.post(2, memoryview(bytearray(4)), "first")
    with pytest.raises(ProtocolError, match="already posted"):
        m.post(2, memoryview(bytearray(4)), "second")
    d = m.landed(msg, 2)
    assert d is not None
    assert d.token == "first"


def test_early_limit() -> None:
    m, alloc = matcher(max_early=100)
    stream(m, 1, data(100))  # at the limit: kept
    assert alloc.sizes == [100]
    with pytest.raises(ProtocolError, match=r"101 bytes arrived before .* \(TEST_LIMIT\)"):
        m.place(2, 101, 0, 1, meta(2))
    # a posted receive takes any size that matches it ...
    m.post(3, memoryview(bytearray(1000)), "r3")
    assert stream(m, 3, data(1000))[0].token == "r3"
    # ... but a wrong-sized message is drained only up to the limit
    m.post(4, memoryview(bytearray(10)), "r4")
    with pytest.raises(ProtocolError, match="of 101 bytes, where a receive of 10 bytes"):
        m.place(4, 101, 0, 1, meta(4))
    assert alloc.sizes == [100]


@pytest.mark.parametrize(("total", "offset", "length"), [
    (16, 0, 17), (16, 12, 8), (16, (1 << 64) - 4, 8)])
def test_part_outside_message(total: int, offset: int, length: int) -> None:
    m, _ = matcher()
    with pytest.raises(ProtocolError, match="exceeds message size"):
        m.place(1, total, offset, length, meta(1))


def test_parts_disagree_or_exceed() -> None:
    m, _ = matcher()
    m.place(1, 16, 0, 8, meta(1))
    with pytest.raises(ProtocolError, match="disagree on its size"):
        m.place(1, 32, 8, 8, meta(1))
    m.post(2, memoryview(bytearray(16)), "r")
    m.place(2, 16, 0, 12, meta(2))
    with pytest.raises(ProtocolError, match="disagree on its size"):  # not a size mismatch
        m.place(2, 20, 12, 8, meta(2))
    with pytest.raises(ProtocolError, match="exceed its size"):
        m.place(2, 16, 4, 12, meta(2))


def test_tag_reused_before_receive_is_a_protocol_error() -> None:
    m, _ = matcher()
    stream(m, 1, b"abc")
    with pytest.raises(ProtocolError, match="exceed its size"):
        m.place(1, 3, 0, 3, meta(1))
    m.hold(2, 3, meta(2), "ref")
    with pytest.raises(ProtocolError, match="before the previous message"):
        m.hold(2, 3, meta(2), "ref2")


# ------------------------------------------------------------------ arrival notification
def test_arrival_notified_once_per_early_message() -> None:
    m, _ = matcher()
    stream(m, 1, data(30), [(0, 10), (20, 10), (10, 10)], mt=meta(11))
    stream(m, 2, b"x")
    m.post(3, memoryview(bytearray(1)), "r3")
    stream(m, 3, b"y")  # posted: no notification
    m.hold(4, 5, meta(4), "ref")
    assert m.take_arrivals() == [(1, meta(11)), (2, meta(2)), (4, meta(4))]
    assert m.take_arrivals() == []
    assert not m.arrivals
    # received and sent again: a new early message, notified again
    d = m.post(2, memoryview(bytearray(1)), "r2")
    assert d is not None
    stream(m, 2, b"z")
    assert m.take_arrivals() == [(2, meta(2))]


# ------------------------------------------------------------------ held messages
def test_held_message_posted_later() -> None:
    m, alloc = matcher()
    assert m.hold(5, 4, meta(5), "abcd") is None
    assert m.take_arrivals() == [(5, meta(5))]
    assert [x.ref for x in m.early()] == ["abcd"]
    out = bytearray(4)
    d = m.post(5, memoryview(out), "r")
    assert d is not None
    assert (d.token, d.ref, d.storage, d.error) == ("r", "abcd", None, None)
    assert finish(d) == meta(5)
    assert out == b"abcd"
    assert alloc.sizes == []  # held by reference, never stored


def test_held_message_matching_a_posted_receive() -> None:
    m, _ = matcher()
    out = bytearray(4)
    m.post(5, memoryview(out), "r")
    d = m.hold(5, 4, meta(5), "wxyz")
    assert d is not None
    assert (d.token, d.ref) == ("r", "wxyz")
    finish(d)
    assert out == b"wxyz"
    assert m.take_arrivals() == []


@pytest.mark.parametrize("post_first", [True, False])
def test_held_message_size_mismatch_releases_it(post_first: bool) -> None:
    m, _ = matcher()
    if post_first:
        m.post(5, memoryview(bytearray(3)), "r")
        d = m.hold(5, 4, meta(5), "ref")
    else:
        m.hold(5, 4, meta(5), "ref")
        d = m.post(5, memoryview(bytearray(3)), "r")
    assert d is not None
    assert (d.token, d.ref) == ("r", "ref")
    assert isinstance(d.error, MessageSizeError)
    assert (d.error.expected, d.error.got) == (3, 4)
    assert len(m) == 0


def test_withdraw() -> None:
    m, _ = matcher()
    m.hold(1, 4, meta(1), "ref")
    assert not m.withdraw(1, "other")
    assert m.withdraw(1, "ref")
    assert not m.withdraw(1, "ref")
    assert m.post(1, memoryview(bytearray(4)), "r") is None  # nothing to match any more
    m.hold(2, 4, meta(2), "ref2")
    assert m.post(2, memoryview(bytearray(4)), "r2") is not None
    assert not m.withdraw(2, "ref2")  # already matched: the receive owns it


# ------------------------------------------------------------------ the end
def test_orderly_close_keeps_complete_messages_only() -> None:
    m, _ = matcher()
    stream(m, 1, b"complete")
    m.hold(2, 4, meta(2), "held")
    msg, _dest = m.place(3, 10, 0, 10, meta(3))
    m.landed(msg, 5)  # partial
    m.post(4, memoryview(bytearray(4)), "posted")
    m.post(5, memoryview(bytearray(1)), "draining")
    m.place(5, 9, 0, 9, meta(5))
    lost = ConnectionLost("peer closed", orderly=True, notice=b"bye")
    out = m.peer_closed(lost)
    assert sorted((d.token, d.ref) for d in out) == [("draining", None), ("posted", None)]
    assert all(d.error is lost for d in out)
    assert m.keeping
    assert m.ended is lost
    assert m.landed(msg, 5) is None  # the partial one is gone
    buf = bytearray(8)
    d = m.post(1, memoryview(buf), "late")
    assert d is not None
    assert finish(d) == meta(1)
    assert buf == b"complete"
    d = m.post(2, memoryview(bytearray(4)), "late2")
    assert d is not None
    assert d.ref == "held"
    # each kept message is received once; anything else fails with the close
    for tag in (1, 3, 9):
        d = m.post(tag, memoryview(bytearray(8)), "after")
        assert d is not None
        assert d.error is lost
    # nothing more can arrive: parts are dropped
    assert m.place(8, 4, 0, 4, meta(8))[1] is None
    assert m.peer_closed(lost) == []
    assert m.fail(ConnectionLost("x")) == []  # the first end decides


def test_failure_hands_back_every_token_once() -> None:
    m, _ = matcher()
    m.post(1, memoryview(bytearray(4)), "posted")
    m.post(2, memoryview(bytearray(1)), "draining")
    drained, _ = m.place(2, 9, 0, 9, meta(2))
    early, _ = m.place(3, 10, 0, 10, meta(3))
    m.landed(early, 5)
    m.post(3, memoryview(bytearray(10)), "waiting-for-early")
    stream(m, 4, b"stored")  # complete, unclaimed: just dropped
    m.hold(5, 4, meta(5), "held")
    filling, _ = m.place(1, 4, 0, 4, meta(1))
    lost = ConnectionLost("reset")
    out = m.fail(lost)
    assert sorted(str(d.token) for d in out) == ["None", "draining", "posted",
                                                 "waiting-for-early"]
    assert [d.ref for d in out if d.token is None] == ["held"]
    assert all(d.error is lost for d in out)
    assert len(m) == 0
    # stale messages complete nothing; later inputs fail or drop
    for msg in (drained, early, filling):
        assert m.landed(msg, 9) is None
    d = m.post(4, memoryview(bytearray(6)), "after")
    assert d is not None
    assert (d.token, d.error) == ("after", lost)
    d = m.hold(6, 1, meta(6), "late-ref")
    assert d is not None
    assert (d.token, d.ref, d.error) == (None, "late-ref", lost)
    assert m.fail(lost) == []
    assert m.peer_closed(lost) == []
    assert not m.keeping


# ------------------------------------------------------------------ random interleavings
@pytest.mark.parametrize("seed", range(60))
def test_random_interleavings(seed: int) -> None:
    """Messages cut into parts that arrive in any order, with receives (some of the wrong
    size) posted at random moments, and sometimes a failure in the middle: every token is
    handed back exactly once, right-sized messages arrive intact, wrong-sized ones fail
    with MessageSizeError, and nothing is left behind."""
    rng = random.Random(seed)
    m, _ = matcher()
    n = 12
    sizes = [rng.choice([0, 1, 7, 100, 1000]) for _ in range(n)]
    payloads = [data(size, seed * 100 + tag) for tag, size in enumerate(sizes)]
    wrong = {tag for tag in range(n) if rng.random() < 0.2}
    bufs = [bytearray(size + 1 if tag in wrong else size) for tag, size in enumerate(sizes)]
    events: list[tuple[str, int, int, int]] = []
    for tag, size in enumerate(sizes):
        cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(3))})
        parts = [(a, b - a) for a, b in itertools.pairwise(cuts)] or [(0, 0)]
        rng.shuffle(parts)
        events += [("part", tag, off, length) for off, length in parts]
        events.append(("post", tag, 0, 0))
    rng.shuffle(events)
    # parts of one message may come in any order, but their bytes land in pieces later
    fail_at = rng.randrange(len(events)) if rng.random() < 0.3 else -1
    handed: list[Msg] = []
    landing: list[tuple[Msg, int]] = []
    for i, (kind, tag, off, length) in enumerate(events):
        if i == fail_at:
            handed += m.fail(ConnectionLost("boom"))
        if kind == "post":
            d = m.post(tag, memoryview(bufs[tag]), f"r{tag}")
            if d is not None:
                handed.append(d)
        else:
            msg, dest = m.place(tag, sizes[tag], off, length, meta(tag))
            if dest is not None:
                dest[:] = payloads[tag][off:off + length]
            landing.append((msg, length))
        if landing and rng.random() < 0.5:
            msg, length = landing.pop(rng.randrange(len(landing)))
            d = m.landed(msg, length)
            if d is not None:
                handed.append(d)
    for msg, length in landing:
        d = m.landed(msg, length)
        if d is not None:
            handed.append(d)
    if fail_at < 0:
        assert m.fail(ConnectionLost("end")) == [], "a token was left behind"
    tokens = [d.token for d in handed if d.token is not None]
    assert sorted(tokens) == sorted(f"r{tag}" for tag in range(n)), "each token once"
    for d in handed:
        if d.token is None:
            continue
        tag = d.tag
        if isinstance(d.error, ConnectionLost):
            assert fail_at >= 0
        elif tag in wrong:
            assert isinstance(d.error, MessageSizeError)
        else:
            assert finish(d) == meta(tag)
            assert bufs[tag] == payloads[tag]
