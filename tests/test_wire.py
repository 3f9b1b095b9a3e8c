"""The bootstrap wire codec, on bytes only (no sockets): round trips, incremental decoding,
every malformed-frame error, and property/fuzz tests with hypothesis."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acoll._bootstrap import wire
from acoll._bootstrap.wire import (
    HEADER,
    Challenge,
    Error,
    FrameDecoder,
    Hello,
    Message,
    MsgType,
    PeerHello,
    Proof,
    RingInfo,
    Tagged,
    encode,
)
from acoll.errors import ProtocolError

SAMPLES: list[Message] = [
    Hello(nonce=b"n" * 32, proof=b"p" * 32, rank=3, nranks=8, addr=("10.0.0.1", 29500, 0),
          host_hash=2**63 - 1,
          pid=4242),
    Hello(nonce=b"", proof=b"", rank=0, nranks=1, addr=("fe80::1", 1, 7), host_hash=0, pid=1),
    RingInfo(nranks=8, next_addr=("::1", 65535, 0)),
    RingInfo(nranks=8, next_addr=("h", 1, 0), peers=((7, ("h", 2, 0)), (6, ("::1", 3, 4)))),
    Error(kind="timeout", message="rank 3 did not arrive in time", rank=3),
    Error(kind="remote", message="ünïcødé ✓", rank=-1),
    PeerHello(nonce=bytes(range(32)), proof=b"x", rank=5, to=2, nranks=6),
    Challenge(nonce=b"c" * 32),
    Proof(proof=b"q" * 32),
    Tagged(tag=2**64 - 1, payload=b"\0" * 1000),
    Tagged(tag=0, payload=b""),
]

VALID_BODIES: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"nonce": b"n", "proof": b"p", "rank": 1, "nranks": 2, "addr": ["h", 1, 0],
                    "host_hash": 0,
                    "pid": 1, "info": b""},
    MsgType.RING_INFO: {"nranks": 2, "next_addr": ["h", 1, 0], "peers": [[1, ["h", 2, 0]]],
                        "infos": [b"i0", b"i1"]},
    MsgType.ERROR: {"kind": "usage", "message": "m", "rank": 0},
    MsgType.PEER_HELLO: {"nonce": b"n", "proof": b"p", "rank": 1, "to": 0, "nranks": 2},
    MsgType.CHALLENGE: {"nonce": b"n"},
    MsgType.PROOF: {"proof": b"p"},
    MsgType.TAGGED: {"tag": 1, "payload": b"p"},
}


def frame(mtype: int, body: object = None, *, raw_body: bytes | None = None,
          magic: bytes = wire.MAGIC, version: int = wire.VERSION, pad: bytes = b"\0\0",
          length: int | None = None) -> bytes:
    """A frame built by hand, so that any field can be wrong."""
    data = msgpack.packb(body, use_bin_type=True) if raw_body is None else raw_body
    size = len(data) if length is None else length
    return magic + struct.pack("!BB", version, mtype) + pad + struct.pack("!I", size) + data


def decode_all(data: bytes, max_frame: int = wire.DEFAULT_MAX_FRAME) -> list[Message]:
    dec = FrameDecoder(max_frame)
    dec.feed(data)
    return drain(dec)


def drain(dec: FrameDecoder) -> list[Message]:
    """Every message ``dec`` can give now."""
    out: list[Message] = []
    while (msg := dec.next_message()) is not None:
        out.append(msg)
    return out


def expect_error(data: bytes, match: str, max_frame: int = wire.DEFAULT_MAX_FRAME) -> None:
    """Decoding ``data`` fails with ``match``, and the decoder stays failed."""
    dec = FrameDecoder(max_frame)
    dec.feed(data)
    with pytest.raises(ProtocolError, match=match) as first:
        drain(dec)
    with pytest.raises(ProtocolError):  # feeding a failed decoder raises too
        dec.feed(encode(SAMPLES[0]))
    with pytest.raises(ProtocolError) as again:  # and good bytes do not revive it
        dec.next_message()
    assert again.value is first.value


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    magic, version, mtype, length = HEADER.unpack_from(data)
    assert (magic, version, mtype) == (wire.MAGIC, wire.VERSION, int(msg.TYPE))
    assert length == len(data) - HEADER.size
    assert decode_all(data) == [msg]


def test_every_type_is_covered() -> None:
    assert {m.TYPE for m in SAMPLES} == set(MsgType)
    assert set(VALID_BODIES) == set(MsgType)


def test_address_decodes_to_tuple() -> None:
    body = {"nranks": 2, "next_addr": ["h", 9, 1], "peers": [], "infos": []}
    [msg] = decode_all(frame(MsgType.RING_INFO, body))
    assert isinstance(msg, RingInfo)
    assert msg.next_addr == ("h", 9, 1)
    assert isinstance(msg.next_addr, tuple)


def test_byte_at_a_time() -> None:
    data = b"".join(encode(m) for m in SAMPLES)
    dec = FrameDecoder()
    got: list[Message] = []
    for i in range(len(data)):
        dec.feed(data[i:i + 1])
        while (msg := dec.next_message()) is not None:
            got.append(msg)
    assert got == SAMPLES
    assert dec.buffered == 0
    assert dec.next_message() is None


def test_several_frames_in_one_feed() -> None:
    data = b"".join(encode(m) for m in SAMPLES)
    dec = FrameDecoder()
    dec.feed(memoryview(bytearray(data + encode(SAMPLES[0])[:5])))
    got = []
    while (msg := dec.next_message()) is not None:
        got.append(msg)
    assert got == SAMPLES
    assert dec.buffered == 5  # the start of the next frame waits for the rest
    dec.feed(encode(SAMPLES[0])[5:])
    assert dec.next_message() == SAMPLES[0]
    assert dec.next_message() is None


def test_incomplete_frame_returns_none() -> None:
    data = encode(SAMPLES[0])
    for cut in (0, 1, HEADER.size - 1, HEADER.size, len(data) - 1):
        dec = FrameDecoder()
        dec.feed(data[:cut])
        assert dec.next_message() is None
        assert dec.buffered == cut


def test_frame_at_the_size_limit() -> None:
    msg = Tagged(tag=1, payload=b"x" * 100)
    size = len(encode(msg)) - HEADER.size
    assert decode_all(encode(msg), max_frame=size) == [msg]
    expect_error(encode(msg), "exceeds the limit", max_frame=size - 1)


# ------------------------------------------------------------------ header errors
def test_bad_magic() -> None:
    expect_error(frame(MsgType.TAGGED, VALID_BODIES[MsgType.TAGGED], magic=b"ACBX"),
                 "bad frame magic")


@pytest.mark.parametrize("prefix", [b"X", b"AX", b"ACBX", b"GET / HTTP/1.1"])
def test_bad_magic_seen_before_a_whole_header(prefix: bytes) -> None:
    dec = FrameDecoder()
    dec.feed(prefix)
    with pytest.raises(ProtocolError, match="bad frame magic"):
        dec.next_message()


def test_good_magic_prefix_waits() -> None:
    dec = FrameDecoder()
    for prefix in (b"A", b"C", b"B", b"S"):
        dec.feed(prefix)
        assert dec.next_message() is None


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version: int) -> None:
    expect_error(frame(MsgType.TAGGED, VALID_BODIES[MsgType.TAGGED], version=version),
                 f"version {version} not supported")


@pytest.mark.parametrize("pad", [b"\0\1", b"\1\0", b"\xff\xff"])
def test_nonzero_padding(pad: bytes) -> None:
    expect_error(frame(MsgType.TAGGED, VALID_BODIES[MsgType.TAGGED], pad=pad),
                 "padding is not zero")


@pytest.mark.parametrize("mtype", [0, 8, 99, 255])
def test_unknown_type(mtype: int) -> None:
    expect_error(frame(mtype, {}), f"unknown frame type {mtype}")


def test_oversize_length_rejected_before_the_body_arrives() -> None:
    header = frame(MsgType.TAGGED, raw_body=b"", length=wire.DEFAULT_MAX_FRAME + 1)
    expect_error(header, "exceeds the limit")
    expect_error(frame(MsgType.TAGGED, raw_body=b"", length=2**32 - 1), "exceeds the limit")


# ------------------------------------------------------------------ body errors
@pytest.mark.parametrize("raw", [
    msgpack.packb(VALID_BODIES[MsgType.TAGGED])[:-1],  # truncated
    b"\xc1",  # never used
    b"\xdf\xff\xff\xff\xff",  # a map of 2**32-1 entries, none present
    msgpack.packb(VALID_BODIES[MsgType.TAGGED]) + b"\x00",  # trailing data
    b"",  # empty body
    msgpack.packb({1: 2}),  # int keys (strict_map_key)
], ids=["truncated", "reserved-byte", "huge-map", "trailing", "empty", "int-keys"])
def test_invalid_msgpack(raw: bytes) -> None:
    expect_error(frame(MsgType.TAGGED, raw_body=raw), "TAGGED frame body is not valid msgpack")


@pytest.mark.parametrize("body", [[1, 2], "text", 5, None, b"bin"])
def test_body_not_a_map(body: object) -> None:
    expect_error(frame(MsgType.PEER_HELLO, body), "PeerHello body is not a map")


def test_ext_types_are_not_values() -> None:
    ext = msgpack.ExtType(1, b"\0")
    expect_error(frame(MsgType.TAGGED, ext), "Tagged body is not a map")
    expect_error(frame(MsgType.TAGGED, {"tag": ext, "payload": b""}),
                 "field 'tag' has type ExtType")


@pytest.mark.parametrize("mtype", list(MsgType), ids=lambda t: t.name)
def test_missing_field(mtype: MsgType) -> None:
    for name in VALID_BODIES[mtype]:
        body = {k: v for k, v in VALID_BODIES[mtype].items() if k != name}
        expect_error(frame(mtype, body), f"lacks field '{name}'")


@pytest.mark.parametrize(("mtype", "name", "value", "tname"), [
    (MsgType.HELLO, "nonce", "text", "str"),
    (MsgType.HELLO, "proof", 3, "int"),
    (MsgType.CHALLENGE, "nonce", 3, "int"),
    (MsgType.PROOF, "proof", "p", "str"),
    (MsgType.HELLO, "rank", "1", "str"),
    (MsgType.HELLO, "nranks", 2.0, "float"),
    (MsgType.HELLO, "host_hash", None, "NoneType"),
    (MsgType.HELLO, "pid", [1], "list"),
    (MsgType.ERROR, "kind", b"usage", "bytes"),
    (MsgType.ERROR, "message", 5, "int"),
    (MsgType.PEER_HELLO, "nonce", 5, "int"),
    (MsgType.PEER_HELLO, "to", "0", "str"),
    (MsgType.TAGGED, "tag", b"1", "bytes"),
    (MsgType.TAGGED, "payload", "p", "str"),
])
def test_wrong_field_type(mtype: MsgType, name: str, value: object, tname: str) -> None:
    body = {**VALID_BODIES[mtype], name: value}
    expect_error(frame(mtype, body), f"field '{name}' has type {tname}")


@pytest.mark.parametrize(("mtype", "name"), [
    (MsgType.HELLO, "rank"), (MsgType.HELLO, "pid"), (MsgType.RING_INFO, "nranks"),
    (MsgType.ERROR, "rank"), (MsgType.TAGGED, "tag")])
def test_bool_is_not_an_int(mtype: MsgType, name: str) -> None:
    for value in (True, False):
        body = {**VALID_BODIES[mtype], name: value}
        expect_error(frame(mtype, body), f"field '{name}' has type bool")


@pytest.mark.parametrize("mtype", list(MsgType), ids=lambda t: t.name)
def test_unknown_extra_field(mtype: MsgType) -> None:
    body = {**VALID_BODIES[mtype], "zzz": 1, "extra": b""}
    expect_error(frame(mtype, body), r"unknown fields \['extra', 'zzz'\]")


@pytest.mark.parametrize("addr", [
    "h:1", ["h", 1], ["h", 1, 0, 0], [1, 1, 0], [b"h", 1, 0], ["h", "1", 0], ["h", 1, "0"],
    ["h", 0, 0], ["h", 65536, 0], ["h", -1, 0], ["h", 1.0, 0], {"h": 1}, None,
], ids=repr)
def test_bad_address(addr: object) -> None:
    expect_error(frame(MsgType.HELLO, {**VALID_BODIES[MsgType.HELLO], "addr": addr}),
                 "field 'addr' is not an address")
    expect_error(frame(MsgType.RING_INFO, {"nranks": 2, "next_addr": addr}),
                 "field 'next_addr' is not an address")


@pytest.mark.parametrize("addr", [["h", True, 0], ["h", 1, False]])
def test_bool_in_address(addr: object) -> None:
    expect_error(frame(MsgType.RING_INFO, {"nranks": 2, "next_addr": addr}),
                 "field 'next_addr' is not an address")


def test_valid_address_edges() -> None:
    for port in (1, 65535):
        body = {"nranks": 2, "next_addr": ["h", port, 0], "peers": [], "infos": []}
        [msg] = decode_all(frame(MsgType.RING_INFO, body))
        assert isinstance(msg, RingInfo)
        assert msg.next_addr[1] == port


def test_error_after_good_frames_keeps_them() -> None:
    dec = FrameDecoder()
    dec.feed(encode(SAMPLES[0]) + encode(SAMPLES[2]) + b"JUNKJUNKJUNKJUNK")
    assert dec.next_message() == SAMPLES[0]
    assert dec.next_message() == SAMPLES[2]
    with pytest.raises(ProtocolError, match="bad frame magic"):
        dec.next_message()
    with pytest.raises(ProtocolError, match="bad frame magic"):
        dec.next_message()


# ------------------------------------------------------------------ properties
_INT64 = st.integers(-(2**63), 2**64 - 1)
_TEXT = st.text(st.characters(codec="utf-8"), max_size=50)
_ADDR = st.tuples(_TEXT, st.integers(1, 65535), st.integers(0, 2**32 - 1))
MESSAGES: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, nonce=st.binary(max_size=32), proof=st.binary(max_size=32), rank=_INT64,
              nranks=_INT64, addr=_ADDR,
              host_hash=_INT64, pid=_INT64),
    st.builds(RingInfo, nranks=_INT64, next_addr=_ADDR),
    st.builds(Error, kind=_TEXT, message=_TEXT, rank=_INT64),
    st.builds(PeerHello, nonce=st.binary(max_size=32), proof=st.binary(max_size=32),
              rank=_INT64, to=_INT64, nranks=_INT64),
    st.builds(Challenge, nonce=st.binary(max_size=32)),
    st.builds(Proof, proof=st.binary(max_size=32)),
    st.builds(Tagged, tag=_INT64, payload=st.binary(max_size=300)),
)


@settings(max_examples=300, deadline=None)
@given(msgs=st.lists(MESSAGES, max_size=8), data=st.data())
def test_any_split_decodes_the_same(msgs: list[Message], data: st.DataObject) -> None:
    stream = b"".join(encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    dec = FrameDecoder()
    got: list[Message] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        dec.feed(stream[start:cut])
        start = cut
        while (msg := dec.next_message()) is not None:
            got.append(msg)
    assert got == msgs
    assert dec.buffered == 0


def _decode_fuzz(chunks: list[bytes], max_frame: int = wire.DEFAULT_MAX_FRAME) -> None:
    """Feed ``chunks``; anything but ``ProtocolError`` escapes and fails the test."""
    dec = FrameDecoder(max_frame)
    error: ProtocolError | None = None
    try:
        for chunk in chunks:
            dec.feed(chunk)
            drain(dec)
    except ProtocolError as exc:
        error = exc
    if error is not None:
        with pytest.raises(ProtocolError) as again:
            dec.next_message()
        assert again.value is error


_FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_fuzz_random_bytes(chunks: list[bytes]) -> None:
    _decode_fuzz(chunks)


@_FUZZ
@given(mtype=st.integers(0, 7), body=st.binary(max_size=200), split=st.integers(0, 220))
def test_fuzz_random_bodies(mtype: int, body: bytes, split: int) -> None:
    data = frame(mtype, raw_body=body)
    _decode_fuzz([data[:split], data[split:]], max_frame=1 << 16)


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | _INT64 | st.floats() | _TEXT | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=10)


@_FUZZ
@given(mtype=st.sampled_from(list(MsgType)),
       body=st.dictionaries(st.sampled_from(["nonce", "proof", "to", "rank", "nranks", "addr",
                                             "host_hash",
                                             "pid", "next_addr", "kind", "message", "tag",
                                             "payload", "x"]), _MSGPACK_VALUES))
def test_fuzz_structured_bodies(mtype: MsgType, body: dict[str, Any]) -> None:
    _decode_fuzz([frame(mtype, body)])


@_FUZZ
@given(msg=MESSAGES, flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)),
                                    min_size=1, max_size=4))
def test_fuzz_mutated_frames(msg: Message, flips: list[tuple[int, int]]) -> None:
    data = bytearray(encode(msg))
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    _decode_fuzz([bytes(data)])
