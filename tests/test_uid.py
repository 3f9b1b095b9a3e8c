"""UniqueId: the 128-byte layout, round trips, every kind of corruption, and host:port
parsing."""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import acoll
from acoll import InvalidUsage, UniqueId
from acoll._uid import UID_SIZE, parse_host_port

SECRET = bytes(range(32))
FMT = struct.Struct("!8sHHHH16sI32s52x")  # the documented layout, less the checksum


def sign(body: bytes) -> bytes:
    """``body`` (120 bytes) followed by its checksum, as a well-formed id would have."""
    assert len(body) == 120
    return body + hashlib.blake2b(body, digest_size=8).digest()


def raw_id(*, magic: bytes = b"ACOLLUID", version: int = 1, flags: int = 0, family: int = 4,
           port: int = 29500, addr: bytes = bytes([10, 0, 0, 1]) + bytes(12), scope: int = 0,
           secret: bytes = SECRET, reserved: bytes = bytes(52)) -> bytes:
    """An id assembled field by field, correctly signed."""
    body = FMT.pack(magic, version, flags, family, port, addr, scope, secret)
    return sign(body[:68] + reserved)


# ------------------------------------------------------------------ layout and round trips
def test_size_and_layout() -> None:
    uid = UniqueId("10.0.0.1", 29500, SECRET)
    raw = bytes(uid)
    assert len(raw) == UID_SIZE == 128
    assert raw == raw_id()
    assert raw[:8] == b"ACOLLUID"
    assert raw[68:120] == bytes(52)


@pytest.mark.parametrize(("host", "scope"), [
    ("10.0.0.1", 0), ("127.0.0.1", 0), ("255.255.255.255", 0), ("0.0.0.0", 0),
    ("::1", 0), ("fe80::1", 3), ("fd77:1::2", 0), ("2001:db8::ff00:42:8329", 2**32 - 1),
])
@pytest.mark.parametrize("from_env", [False, True])
def test_round_trip(host: str, scope: int, from_env: bool) -> None:
    uid = UniqueId(host, 29500, SECRET, scope, from_env)
    back = UniqueId.from_bytes(bytes(uid))
    assert back == uid
    assert back.from_env is from_env
    assert back.scope_id == scope
    assert UniqueId.from_bytes(bytearray(bytes(uid))) == uid
    assert UniqueId.from_bytes(memoryview(bytes(uid))) == uid


def test_family_and_sockaddr() -> None:
    v4 = UniqueId("10.0.0.1", 1, SECRET)
    assert v4.family == socket.AF_INET
    assert v4.sockaddr == ("10.0.0.1", 1)
    v6 = UniqueId("fe80::1", 2, SECRET, scope_id=5)
    assert v6.family == socket.AF_INET6
    assert v6.sockaddr == ("fe80::1", 2, 0, 5)


def test_new_ids_have_fresh_secrets() -> None:
    a, b = UniqueId.new("10.0.0.1", 5), UniqueId.new("10.0.0.1", 5)
    assert a.secret != b.secret
    assert a.job_key != b.job_key
    assert len(a.job_key) == 32
    assert not a.from_env


def test_repr() -> None:
    assert "10.0.0.1:29500" in repr(UniqueId("10.0.0.1", 29500, SECRET))
    assert "[::1]:29500" in repr(UniqueId("::1", 29500, SECRET))
    assert "ACOLL_COMM_ID" in repr(UniqueId("::1", 29500, SECRET, from_env=True))
    assert SECRET.hex() not in repr(UniqueId("::1", 29500, SECRET))


_HOSTS = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))


@settings(max_examples=300, deadline=None)
@given(host=_HOSTS, port=st.integers(1, 65535), secret=st.binary(min_size=32, max_size=32),
       scope=st.integers(0, 2**32 - 1), from_env=st.booleans())
def test_round_trip_property(host: str, port: int, secret: bytes, scope: int,
                             from_env: bool) -> None:
    uid = UniqueId(host, port, secret, scope, from_env)
    raw = bytes(uid)
    assert len(raw) == 128
    assert UniqueId.from_bytes(raw) == uid


# ------------------------------------------------------------------ from_address
def test_from_address_is_deterministic() -> None:
    a = UniqueId.from_address("10.1.2.3:29500")
    b = UniqueId.from_address("10.1.2.3:29500")
    assert a == b
    assert bytes(a) == bytes(b)
    assert a.from_env
    assert (a.host, a.port) == ("10.1.2.3", 29500)
    assert UniqueId.from_bytes(bytes(a)) == a
    # another address (or port) gives another secret
    assert UniqueId.from_address("10.1.2.3:29501").secret != a.secret
    assert UniqueId.from_address("10.1.2.4:29500").secret != a.secret


def test_from_address_ipv6_and_scope() -> None:
    a = UniqueId.from_address("[::1]:29500")
    assert (a.host, a.port, a.scope_id, a.family) == ("::1", 29500, 0, socket.AF_INET6)
    assert UniqueId.from_address("[::1]:29500") == a
    scoped = UniqueId.from_address("[fe80::1%7]:29500")
    assert (scoped.host, scoped.scope_id) == ("fe80::1", 7)
    by_name = UniqueId.from_address("[fe80::1%lo]:29500")
    assert by_name.scope_id == socket.if_nametoindex("lo")
    # the scope does not enter the secret: every rank derives the same one
    assert scoped.secret == by_name.secret


def test_from_address_normalises_the_host() -> None:
    assert UniqueId.from_address("[0:0::1]:5") == UniqueId.from_address("[::1]:5")


def test_from_address_resolves_names() -> None:
    uid = UniqueId.from_address("localhost:29500")
    assert uid.host in ("127.0.0.1", "::1")
    assert UniqueId.from_address("localhost:29500") == uid


def test_from_address_unresolvable() -> None:
    with pytest.raises(InvalidUsage, match=r"cannot resolve 'no-such-host\.invalid'"):
        UniqueId.from_address("no-such-host.invalid:29500")


# ------------------------------------------------------------------ corruption
def test_public_name_rejects_junk() -> None:
    with pytest.raises(acoll.InvalidUsage, match="bad magic") as info:
        acoll.UniqueId.from_bytes(b"x" * 128)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, acoll.AcollError)


@pytest.mark.parametrize("size", [0, 1, 127, 129, 256])
def test_wrong_length(size: int) -> None:
    raw = (bytes(UniqueId("10.0.0.1", 1, SECRET)) * 3)[:size]
    with pytest.raises(InvalidUsage, match=f"a UniqueId is 128 bytes, got {size}"):
        UniqueId.from_bytes(raw)


@pytest.mark.parametrize(("raw", "match"), [
    (raw_id(magic=b"ACOLLUIX"), r"not an acoll UniqueId \(bad magic\)"),
    (raw_id(magic=bytes(8)), "bad magic"),
    (raw_id(version=2), "UniqueId version 2 not supported"),
    (raw_id(version=0), "UniqueId version 0 not supported"),
    (raw_id(reserved=b"\1" + bytes(51)), "reserved bytes are not zero"),
    (raw_id(reserved=bytes(51) + b"\x80"), "reserved bytes are not zero"),
    (raw_id(family=5), "address family 5 unknown"),
    (raw_id(family=2), "address family 2 unknown"),  # AF_INET's value on Linux: not the wire's
    (raw_id(addr=bytes([10, 0, 0, 1, 9]) + bytes(11)), "IPv4 address has trailing bytes"),
    (raw_id(flags=4), "flags 0x4 unknown"),
    (raw_id(port=0), "port 0 out of range"),
], ids=["magic", "zero-magic", "version2", "version0", "reserved-first", "reserved-last",
        "family5", "family2", "v4-trailing", "flags", "port0"])
def test_corrupt_fields(raw: bytes, match: str) -> None:
    with pytest.raises(InvalidUsage, match=match):
        UniqueId.from_bytes(raw)


def test_checksum_mismatch() -> None:
    raw = bytearray(bytes(UniqueId("10.0.0.1", 29500, SECRET)))
    raw[40] ^= 1  # inside the secret
    with pytest.raises(InvalidUsage, match=r"checksum mismatch \(corrupted id\)"):
        UniqueId.from_bytes(bytes(raw))
    raw[40] ^= 1
    raw[127] ^= 0xFF  # inside the checksum
    with pytest.raises(InvalidUsage, match="checksum mismatch"):
        UniqueId.from_bytes(bytes(raw))


def test_every_single_byte_corruption_is_caught() -> None:
    good = bytes(UniqueId("fe80::1", 29500, SECRET, 3, True))
    for pos in range(128):
        for xor in (0x01, 0x80, 0xFF):
            raw = bytearray(good)
            raw[pos] ^= xor
            with pytest.raises(InvalidUsage):
                UniqueId.from_bytes(bytes(raw))


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=128, max_size=128))
def test_random_bytes_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidUsage):
        UniqueId.from_bytes(raw)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"secret": b"short"}, "secret must be 32 bytes"),
    ({"port": 0}, "port 0 out of range"),
    ({"port": 65536}, "port 65536 out of range"),
])
def test_constructor_checks(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"host": "10.0.0.1", "port": 1, "secret": SECRET, **kwargs}
    with pytest.raises(InvalidUsage, match=match):
        UniqueId(**args)  # type: ignore[arg-type]


# ------------------------------------------------------------------ parse_host_port
@pytest.mark.parametrize(("text", "expected"), [
    ("localhost:29500", ("localhost", 29500)),
    ("10.0.0.1:1", ("10.0.0.1", 1)),
    ("node-7.cluster:65535", ("node-7.cluster", 65535)),
    ("[::1]:29500", ("::1", 29500)),
    ("[fe80::1%eth0]:29500", ("fe80::1%eth0", 29500)),
    ("[2001:db8::1]:80", ("2001:db8::1", 80)),
    ("  host:5 \n", ("host", 5)),
])
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(("text", "match"), [
    ("::1:29500", r"write IPv6 addresses as \[addr\]:port"),
    ("fe80::1:80", r"write IPv6 addresses as \[addr\]:port"),
    ("host", "is not host:port"),
    ("host:", "is not host:port"),
    (":29500", "is not host:port"),
    ("host:http", "is not host:port"),
    ("host:-1", "is not host:port"),
    ("host:1.5", "is not host:port"),
    ("", "is not host:port"),
    ("[::1]", "is not host:port"),
    ("[::1]29500", "is not host:port"),
    ("[]:29500", "is not host:port"),
    ("[::1]:", "is not host:port"),
    ("host:0", "port 0 out of range 1..65535"),
    ("host:65536", "port 65536 out of range 1..65535"),
    ("[::1]:99999", "port 99999 out of range"),
])
def test_parse_host_port_errors(text: str, match: str) -> None:
    with pytest.raises(InvalidUsage, match=match) as info:
        parse_host_port(text)
    assert isinstance(info.value, ValueError)


def test_from_address_reports_parse_errors() -> None:
    with pytest.raises(InvalidUsage, match="is not host:port"):
        UniqueId.from_address("just-a-host")


@pytest.mark.parametrize("text", ["host:\u00b2", "host:\uff11\uff12"])
def test_parse_host_port_non_ascii_digits(text: str) -> None:
    with pytest.raises(InvalidUsage, match="is not host:port"):
        parse_host_port(text)


def test_from_address_unknown_scope_interface() -> None:
    with pytest.raises(InvalidUsage):
        UniqueId.from_address("[fe80::1%no-such-if0]:29500")


# ------------------------------------------------------------------ shared secrets
def test_comm_id_without_secret_is_marked_and_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOLL_COMM_SECRET", raising=False)
    monkeypatch.delenv("ACOLL_COMM_SECRET_FILE", raising=False)
    a = UniqueId.from_address("10.1.2.3:29500")
    assert a.derived_secret
    assert "no shared secret" in repr(a)
    assert UniqueId.from_bytes(bytes(a)).derived_secret


def test_comm_secret_changes_the_key_and_is_not_derivable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOLL_COMM_SECRET_FILE", raising=False)
    monkeypatch.delenv("ACOLL_COMM_SECRET", raising=False)
    plain = UniqueId.from_address("10.1.2.3:29500")
    monkeypatch.setenv("ACOLL_COMM_SECRET", "ab" * 32)
    one = UniqueId.from_address("10.1.2.3:29500")
    monkeypatch.setenv("ACOLL_COMM_SECRET", "cd" * 32)
    two = UniqueId.from_address("10.1.2.3:29500")
    assert not one.derived_secret
    assert len({plain.job_key, one.job_key, two.job_key}) == 3
    # the same secret on every rank gives the same id; an argument wins over the variable
    assert UniqueId.from_address("10.1.2.3:29500", "cd" * 32) == two
    assert UniqueId.from_address("10.1.2.3:29500", "ab" * 32) == one
    # the secret is bound to the address: the same secret at another port is another key
    assert UniqueId.from_address("10.1.2.3:29501").job_key != two.job_key


def test_comm_secret_too_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_COMM_SECRET", "short")
    with pytest.raises(InvalidUsage, match="ACOLL_COMM_SECRET is too short"):
        UniqueId.from_address("10.1.2.3:29500")


def test_comm_secret_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ACOLL_COMM_SECRET", raising=False)
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef-a-long-passphrase\n")
    path.chmod(0o600)
    monkeypatch.setenv("ACOLL_COMM_SECRET_FILE", str(path))
    a = UniqueId.from_address("10.1.2.3:29500")
    assert not a.derived_secret
    assert a == UniqueId.from_address("10.1.2.3:29500", "0123456789abcdef-a-long-passphrase")
    path.chmod(0o644)
    with pytest.raises(InvalidUsage, match="accessible by other users"):
        UniqueId.from_address("10.1.2.3:29500")
    monkeypatch.setenv("ACOLL_COMM_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidUsage, match="ACOLL_COMM_SECRET_FILE"):
        UniqueId.from_address("10.1.2.3:29500")


def test_secret_never_logged(monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ACOLL_COMM_SECRET", "topsecret-" * 4)
    with caplog.at_level(logging.DEBUG, logger="acoll"):
        UniqueId.from_address("10.1.2.3:29500")
    assert "topsecret" not in caplog.text


@pytest.mark.parametrize("raw", ["abc", None, 7, [0] * 128])
def test_from_bytes_of_something_else_is_invalid_usage(raw: object) -> None:
    """Found by review: a str or None raised a bare TypeError."""
    with pytest.raises(InvalidUsage, match="parsed from 128 bytes"):
        UniqueId.from_bytes(raw)  # type: ignore[arg-type]
