"""The 128-byte unique id.

Layout (network byte order), 128 bytes in all::

    0   8s  magic  b"ACOLLUID"
    8   H   version (1)
    10  H   flags   (bit 0: the address came from ACOLL_COMM_ID, rank 0 hosts the root;
                     bit 1: the secret is derived from the address alone, no shared secret)
    12  H   family  (AF_INET or AF_INET6 as numbered on the wire: 4 or 6)
    14  H   port
    16  16s address (IPv4 in the first 4 bytes)
    32  I   IPv6 scope id (link-local addresses)
    36  32s secret  (random per id; every handshake proves knowledge of it)
    68  52x reserved, zero
    120 8s  checksum: blake2b-64 of bytes 0..120

Every connection of the job proves knowledge of the secret (see :mod:`acoll._auth`), so
the root and every rank listener refuse connections that do not belong to the job.

With ``ACOLL_COMM_ID`` the ranks build the id themselves from the address. They then need
the same secret from somewhere else: ``ACOLL_COMM_SECRET`` (a string of at least 16
characters; 64 hex digits are taken as 32 raw bytes) or ``ACOLL_COMM_SECRET_FILE`` (a file
that only its owner may read). ``acoll-run`` sets ``ACOLL_COMM_SECRET`` to fresh random bytes
for every job. Without either, the secret is derived from the address alone: anyone who can
see the address can compute it, so that mode only keeps apart jobs that meet by accident
(a stale rank, a reused port), not strangers.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from ._auth import auth_key
from ._config import Setting, get_logger
from .errors import InvalidUsage

__all__ = ["UID_SIZE", "UniqueId", "parse_host_port"]

UID_SIZE = 128
_MAGIC = b"ACOLLUID"
_VERSION = 1
_FMT = struct.Struct("!8sHHHH16sI32s52x")
_FLAG_FROM_ENV = 1
_FLAG_DERIVED_SECRET = 2
_FLAGS = _FLAG_FROM_ENV | _FLAG_DERIVED_SECRET
assert _FMT.size == 120

log = get_logger("BOOTSTRAP")

class _SecretSetting(Setting[str]):
    """A setting whose value is never logged (only whether it was given)."""

    def resolve(self, value: str | None = None) -> str:
        text = value if value is not None else (self.raw() or "")
        get_logger(self.subsys).info("%s is %s", self.env_name, "set" if text else "not set")
        return text


COMM_SECRET = _SecretSetting(
    "COMM_SECRET", str, "",
    "Secret shared by the ranks of an ACOLL_COMM_ID job (>= 16 characters; 64 hex digits "
    "are raw bytes). acoll-run sets it.", "INIT")
COMM_SECRET_FILE = Setting(
    "COMM_SECRET_FILE", str, "",
    "File holding the ACOLL_COMM_ID job's secret (readable by its owner only).", "INIT")
_MIN_SECRET = 16


def _secret_bytes(text: str, what: str) -> bytes:
    text = text.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    if len(text) < _MIN_SECRET:
        raise InvalidUsage(f"{what} is too short: give at least {_MIN_SECRET} characters "
                           "(e.g. 64 hex digits from os.urandom(32).hex())")
    return text.encode()


def shared_secret(secret: bytes | str | None = None) -> bytes | None:
    """The secret of an ``ACOLL_COMM_ID`` job: the argument, else ``ACOLL_COMM_SECRET``,
    else the contents of ``ACOLL_COMM_SECRET_FILE``, else ``None``.

    Raises:
        InvalidUsage: the secret is too short, or the file is missing, unreadable, or
            readable or writable by other users.
    """
    if isinstance(secret, bytes):
        if len(secret) < _MIN_SECRET:
            raise InvalidUsage(f"secret must be at least {_MIN_SECRET} bytes")
        return secret
    if isinstance(secret, str):
        return _secret_bytes(secret, "secret")
    text = COMM_SECRET.resolve()
    if text:
        return _secret_bytes(text, "ACOLL_COMM_SECRET")
    path = COMM_SECRET_FILE.resolve()
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise InvalidUsage(f"ACOLL_COMM_SECRET_FILE={path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            raise InvalidUsage(f"ACOLL_COMM_SECRET_FILE={path!r} is accessible by other "
                               f"users (mode {st.st_mode & 0o777:o}); chmod 600 it")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return _secret_bytes(data.decode(errors="replace"), f"ACOLL_COMM_SECRET_FILE={path!r}")


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
    derived_secret: bool = False

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
        """The key every connection of this job authenticates with (never sent)."""
        return auth_key(self.secret)

    @classmethod
    def new(cls, host: str, port: int, scope_id: int = 0) -> UniqueId:
        """A fresh id for a root listening at ``host:port``, with a random secret."""
        return cls(host, port, os.urandom(32), scope_id)

    @classmethod
    def from_address(cls, text: str, secret: bytes | str | None = None) -> UniqueId:
        """The id every rank derives from ``ACOLL_COMM_ID``-style ``host:port`` text.

        ``secret`` (else ``ACOLL_COMM_SECRET`` / ``ACOLL_COMM_SECRET_FILE``, see the module
        docstring) is what strangers cannot know; without one the id's secret is derived
        from the address alone. The host may be a name; it is resolved here (a blocking
        lookup for names only).
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
        shared = shared_secret(secret)
        derived = hashlib.blake2b(f"{ip}:{port}".encode(), digest_size=32,
                                  person=b"acoll-commid").digest()
        if shared is None:
            log.info("ACOLL_COMM_ID %s:%d without ACOLL_COMM_SECRET: connections are checked "
                     "against a key derived from the address, which does not keep out "
                     "strangers who can see it", ip, port)
            return cls(str(ip), port, derived, scope, from_env=True, derived_secret=True)
        keyed = hashlib.blake2b(shared, key=derived, digest_size=32,
                                person=b"acoll-secret").digest()
        return cls(str(ip), port, keyed, scope, from_env=True)

    def __bytes__(self) -> bytes:
        ip = ipaddress.ip_address(self.host)
        packed = ip.packed.ljust(16, b"\0")
        fam = 6 if ip.version == 6 else 4
        flags = ((_FLAG_FROM_ENV if self.from_env else 0)
                 | (_FLAG_DERIVED_SECRET if self.derived_secret else 0))
        body = _FMT.pack(_MAGIC, _VERSION, flags, fam,
                         self.port, packed, self.scope_id, self.secret)
        return body + _checksum(body)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> UniqueId:
        """Parse 128 bytes made by ``bytes(uid)``.

        Raises:
            InvalidUsage: wrong length, magic, version, checksum or address fields.
        """
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InvalidUsage(f"a UniqueId is parsed from {UID_SIZE} bytes, not from "
                               f"{type(raw).__name__}")
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
        if flags & ~_FLAGS:
            raise InvalidUsage(f"UniqueId flags {flags:#x} unknown")
        return cls(host, port, secret, scope, bool(flags & _FLAG_FROM_ENV),
                   bool(flags & _FLAG_DERIVED_SECRET))

    def __repr__(self) -> str:
        where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        note = ", from ACOLL_COMM_ID" if self.from_env else ""
        if self.derived_secret:
            note += ", no shared secret"
        return f"UniqueId({where}{note})"
