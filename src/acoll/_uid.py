"""The 128-byte unique id.

Layout (network byte order), 128 bytes in all::

    0   8s  magic  b"ACOLLUID"
    8   H   version (1)
    10  H   flags   (bit 0: the address came from ACOLL_COMM_ID, rank 0 hosts the root)
    12  H   family  (AF_INET or AF_INET6 as numbered on the wire: 4 or 6)
    14  H   port
    16  16s address (IPv4 in the first 4 bytes)
    32  I   IPv6 scope id (link-local addresses)
    36  32s secret  (random per id; every handshake proves knowledge of it)
    68  52x reserved, zero
    120 8s  checksum: blake2b-64 of bytes 0..120

The secret lets the root and every rank listener turn away connections that do not belong to
the job. With ``ACOLL_COMM_ID`` the secret is derived from the address (all ranks must agree
on it without talking), so it only guards against accidents, not strangers.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from .errors import InvalidUsage

__all__ = ["UID_SIZE", "UniqueId", "parse_host_port"]

UID_SIZE = 128
_MAGIC = b"ACOLLUID"
_VERSION = 1
_FMT = struct.Struct("!8sHHHH16sI32s52x")
_FLAG_FROM_ENV = 1
assert _FMT.size == 120


def _checksum(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8).digest()


def parse_host_port(text: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6addr]:port`` (``%scope`` allowed in the v6 form).

    Raises:
        InvalidUsage: the text is not of that form or the port is out of range.
    """
    text = text.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
        if ":" in host:
            raise InvalidUsage(f"{text!r}: write IPv6 addresses as [addr]:port")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise InvalidUsage(f"{text!r} is not host:port or [v6addr]:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidUsage(f"{text!r}: port {port} out of range 1..65535")
    return host, port


@dataclass(frozen=True)
class UniqueId:
    """Opaque id of one communicator: the root's listening address plus a secret.

    ``bytes(uid)`` gives exactly 128 bytes, safe to send anywhere;
    :meth:`from_bytes` turns them back into an id or raises :class:`InvalidUsage`.
    """

    host: str
    port: int
    secret: bytes
    scope_id: int = 0
    from_env: bool = False

    def __post_init__(self) -> None:
        if len(self.secret) != 32:
            raise InvalidUsage("UniqueId secret must be 32 bytes")
        if not 0 < self.port < 65536:
            raise InvalidUsage(f"UniqueId port {self.port} out of range")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise InvalidUsage(f"UniqueId host must be an IP address, not {self.host!r} "
                               "(use UniqueId.from_address to resolve names)") from None

    @property
    def family(self) -> socket.AddressFamily:
        """``AF_INET`` or ``AF_INET6``."""
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    @property
    def sockaddr(self) -> tuple[str, int] | tuple[str, int, int, int]:
        """The address in the form ``socket.connect`` takes."""
        if self.family == socket.AF_INET6:
            return (self.host, self.port, 0, self.scope_id)
        return (self.host, self.port)

    @property
    def job_key(self) -> bytes:
        """16 bytes every handshake of this job carries (derived from the secret)."""
        return hashlib.blake2b(self.secret, digest_size=16, person=b"acoll-job").digest()

    @classmethod
    def new(cls, host: str, port: int, scope_id: int = 0) -> UniqueId:
        """A fresh id for a root listening at ``host:port``, with a random secret."""
        return cls(host, port, os.urandom(32), scope_id)

    @classmethod
    def from_address(cls, text: str) -> UniqueId:
        """The id every rank derives from ``ACOLL_COMM_ID``-style ``host:port`` text.

        The host may be a name; it is resolved here (a blocking lookup for names only).
        """
        host, port = parse_host_port(text)
        scope = 0
        if "%" in host:
            host, _, scope_name = host.partition("%")
            try:
                scope = (int(scope_name) if scope_name.isascii() and scope_name.isdigit()
                         else socket.if_nametoindex(scope_name))
            except OSError as exc:
                raise InvalidUsage(f"{text!r}: unknown interface {scope_name!r}") from exc
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise InvalidUsage(f"cannot resolve {host!r}: {exc}") from exc
            ip = ipaddress.ip_address(str(info[0][4][0]).partition("%")[0])
        secret = hashlib.blake2b(f"{ip}:{port}".encode(), digest_size=32,
                                 person=b"acoll-commid").digest()
        return cls(str(ip), port, secret, scope, from_env=True)

    def __bytes__(self) -> bytes:
        ip = ipaddress.ip_address(self.host)
        packed = ip.packed.ljust(16, b"\0")
        fam = 6 if ip.version == 6 else 4
        body = _FMT.pack(_MAGIC, _VERSION, _FLAG_FROM_ENV if self.from_env else 0, fam,
                         self.port, packed, self.scope_id, self.secret)
        return body + _checksum(body)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> UniqueId:
        """Parse 128 bytes made by ``bytes(uid)``.

        Raises:
            InvalidUsage: wrong length, magic, version, checksum or address fields.
        """
        data = bytes(raw)
        if len(data) != UID_SIZE:
            raise InvalidUsage(f"a UniqueId is {UID_SIZE} bytes, got {len(data)}")
        body, check = data[:120], data[120:]
        magic, version, flags, fam, port, addr, scope, secret = _FMT.unpack(body)
        if magic != _MAGIC:
            raise InvalidUsage("not an acoll UniqueId (bad magic)")
        if version != _VERSION:
            raise InvalidUsage(f"UniqueId version {version} not supported (this is {_VERSION})")
        if check != _checksum(body):
            raise InvalidUsage("UniqueId checksum mismatch (corrupted id)")
        if body[68:120].strip(b"\0"):
            raise InvalidUsage("UniqueId reserved bytes are not zero")
        if fam == 4:
            if addr[4:].strip(b"\0"):
                raise InvalidUsage("UniqueId IPv4 address has trailing bytes")
            host = str(ipaddress.IPv4Address(addr[:4]))
        elif fam == 6:
            host = str(ipaddress.IPv6Address(addr))
        else:
            raise InvalidUsage(f"UniqueId address family {fam} unknown")
        if flags & ~_FLAG_FROM_ENV:
            raise InvalidUsage(f"UniqueId flags {flags:#x} unknown")
        return cls(host, port, secret, scope, bool(flags & _FLAG_FROM_ENV))

    def __repr__(self) -> str:
        where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return f"UniqueId({where}{', from ACOLL_COMM_ID' if self.from_env else ''})"
