"""Interface discovery: which local address acoll listens on and advertises.

This follows NCCL's ``findInterfaces`` rules.

Enumeration (:func:`list_interfaces`): every address ``getifaddrs`` reports on an interface
that is up (``IFF_UP``), IPv4 and IPv6 only, IPv6 loopback (``::1``) skipped, in the order
the kernel reports them.

Selection (:func:`select_interfaces`, pure) after an optional family filter
(``ACOLL_SOCKET_FAMILY``), keeping one address per interface name (the first one, except that
an IPv6 link-local address gives way to a later non-link-local one of the same name):

* ``ACOLL_SOCKET_IFNAME`` given: only the interfaces it matches. The text is a comma list of
  name prefixes; a leading ``^`` excludes the listed names instead, a leading ``=`` compares
  whole names (``^=docker0`` excludes exactly ``docker0``). The matches are ordered like the
  automatic classes below (stable otherwise), so loopback comes last. NCCL keeps the raw
  ``getifaddrs`` order here, where ``lo`` usually comes first.
* Otherwise the first non-empty class of: ``ib*``; interfaces whose subnet contains the
  ``ACOLL_COMM_ID`` root address; every interface but ``docker*``, ``virbr*`` and ``lo*``;
  ``docker*`` and ``virbr*``; ``lo*``.

The same name matcher (:func:`match_spec`) serves ``ACOLL_IB_HCA``, whose entries may carry
a port: ``[^][=]dev[:port],...`` (:func:`parse_hca_spec`, :func:`match_hca`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._config import Setting, get_logger
from ..errors import BootstrapError, InvalidUsage

__all__ = [
    "Interface",
    "NameSpec",
    "SOCKET_FAMILY",
    "SOCKET_IFNAME",
    "bind_address_for",
    "find_interfaces",
    "list_interfaces",
    "match_hca",
    "match_spec",
    "parse_family",
    "parse_hca_spec",
    "parse_ifname_spec",
    "select_interfaces",
]

_IFF_UP = 0x1
_LOG = get_logger("INIT")


# --------------------------------------------------------------------------------------------
# Interface records


@dataclass(frozen=True)
class Interface:
    """One address of one local network interface.

    Attributes:
        name: the interface name (``eth0``, ``ib0``...).
        family: ``AF_INET`` or ``AF_INET6``.
        address: the address text without prefix or ``%scope``.
        prefixlen: the netmask as a prefix length (32/128 when the kernel gives none).
        scope_id: the IPv6 scope (interface index for link-local addresses), else 0.
    """

    name: str
    family: socket.AddressFamily
    address: str
    prefixlen: int
    scope_id: int = 0

    @property
    def is_link_local(self) -> bool:
        """True for IPv6 link-local (``fe80::/10``) and IPv4 ``169.254/16`` addresses."""
        return ipaddress.ip_address(self.address).is_link_local

    def sockaddr(self, port: int) -> tuple[str, int] | tuple[str, int, int, int]:
        """The address with ``port`` in the form ``socket.bind``/``connect`` take.

        IPv4 gives ``(address, port)``; IPv6 gives ``(address, port, 0, scope_id)``.
        """
        if self.family == socket.AF_INET6:
            return (self.address, port, 0, self.scope_id)
        return (self.address, port)

    def contains(self, ip: str) -> bool:
        """Whether ``ip`` lies in this interface's subnet.

        ``ip`` may carry an IPv6 ``%scope`` suffix (ignored). Text that is not an IP literal,
        and addresses of the other family, give ``False``; this never resolves names.
        """
        try:
            addr = ipaddress.ip_address(ip.partition("%")[0].strip().strip("[]"))
        except ValueError:
            return False
        net = ipaddress.ip_network(f"{self.address}/{self.prefixlen}", strict=False)
        return addr.version == net.version and addr in net

    def __str__(self) -> str:
        scope = f"%{self.scope_id}" if self.scope_id else ""
        return f"{self.name} {self.address}{scope}/{self.prefixlen}"


def bind_address_for(iface: Interface) -> str:
    """The host text to bind or advertise for ``iface`` (``fe80::1%3`` form when scoped)."""
    if iface.family == socket.AF_INET6 and iface.scope_id:
        return f"{iface.address}%{iface.scope_id}"
    return iface.address


# --------------------------------------------------------------------------------------------
# Enumeration through getifaddrs


class _IfAddrs(ctypes.Structure):
    pass


# struct ifaddrs, identical in field order on Linux and the BSDs (the union ifa_ifu is one
# pointer wide).
_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]

# Linux sockaddr starts with a 16-bit family; the BSDs with an 8-bit length then 8-bit family.
_BSD_SOCKADDR = sys.platform == "darwin" or "bsd" in sys.platform
_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)  # the process's own libc; no ldconfig lookup
        try:
            lib.getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
            lib.getifaddrs.restype = ctypes.c_int
            lib.freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
            lib.freeifaddrs.restype = None
        except AttributeError as exc:
            raise OSError(38, "getifaddrs is not available on this platform") from exc
        _libc = lib
    return _libc


def _sa_family(ptr: int) -> int:
    if _BSD_SOCKADDR:
        return ctypes.c_uint8.from_address(ptr + 1).value
    return ctypes.c_uint16.from_address(ptr).value


def _prefixlen(mask: bytes) -> int:
    return bin(int.from_bytes(mask, "big")).count("1")


def _parse_entry(name: str, addr_ptr: int, mask_ptr: int | None) -> Interface | None:
    fam = _sa_family(addr_ptr)
    if fam == socket.AF_INET:
        raw = ctypes.string_at(addr_ptr, 8)  # family, port, in_addr
        address = socket.inet_ntop(socket.AF_INET, raw[4:8])
        prefix = 32 if not mask_ptr else _prefixlen(ctypes.string_at(mask_ptr + 4, 4))
        return Interface(name, socket.AF_INET, address, prefix, 0)
    if fam == socket.AF_INET6:
        raw = ctypes.string_at(addr_ptr, 28)  # family, port, flowinfo, in6_addr, scope_id
        packed = raw[8:24]
        if packed == b"\0" * 15 + b"\1":  # ::1 is skipped, as NCCL does
            return None
        address = socket.inet_ntop(socket.AF_INET6, packed)
        (scope,) = struct.unpack_from("=I", raw, 24)
        prefix = 128 if not mask_ptr else _prefixlen(ctypes.string_at(mask_ptr + 8, 16))
        return Interface(name, socket.AF_INET6, address, prefix, scope)
    return None


def list_interfaces() -> list[Interface]:
    """Every IPv4/IPv6 address of every interface that is up, in ``getifaddrs`` order.

    One entry per address (an interface may appear several times); ``::1`` is left out.
    This is a single netlink query: fast, no name resolution, never blocks on the network.

    Raises:
        OSError: ``getifaddrs`` failed or does not exist on this platform.
    """
    libc = _load_libc()
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs: {os.strerror(err)}")
    found: list[Interface] = []
    try:
        node = head
        while bool(node):
            ifa = node.contents
            if ifa.ifa_addr and ifa.ifa_name and ifa.ifa_flags & _IFF_UP:
                name = ifa.ifa_name.decode(errors="replace")
                entry = _parse_entry(name, ifa.ifa_addr, ifa.ifa_netmask)
                if entry is not None:
                    found.append(entry)
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


# --------------------------------------------------------------------------------------------
# Name specs: ACOLL_SOCKET_IFNAME and ACOLL_IB_HCA


@dataclass(frozen=True)
class NameSpec:
    """A parsed ``[^][=]name[:port],...`` list.

    Attributes:
        entries: ``(name, port)`` pairs; ``port`` is ``None`` when not given (any port).
        exclude: a leading ``^``: names that match are rejected, all others accepted.
        exact: a leading ``=``: names are compared whole instead of as prefixes.
    """

    entries: tuple[tuple[str, int | None], ...]
    exclude: bool = False
    exact: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the entries, in order."""
        return tuple(name for name, _ in self.entries)


def _split_flags(text: str) -> tuple[str, bool, bool]:
    body = text.strip()
    exclude = body.startswith("^")
    if exclude:
        body = body[1:]
    exact = body.startswith("=")
    if exact:
        body = body[1:]
    return body, exclude, exact


def parse_ifname_spec(text: str) -> NameSpec:
    """Parse ``ACOLL_SOCKET_IFNAME`` text: ``[^][=]name,...`` (names kept whole, no ports).

    Blank items are ignored and duplicates dropped.

    Raises:
        ValueError: no name is listed (``""``, ``"^"``, ``"=,"``...).
    """
    body, exclude, exact = _split_flags(text)
    names = _unique(item.strip() for item in body.split(","))
    if not names:
        raise ValueError(f"no interface name in {text!r}")
    return NameSpec(tuple((n, None) for n in names), exclude, exact)


def parse_hca_spec(text: str) -> NameSpec:
    """Parse ``ACOLL_IB_HCA`` text: ``[^][=]device[:port],...``.

    Raises:
        ValueError: no device is listed, or a port is not a positive integer.
    """
    body, exclude, exact = _split_flags(text)
    entries: list[tuple[str, int | None]] = []
    for item in body.split(","):
        dev, sep, port_text = item.strip().partition(":")
        dev = dev.strip()
        if not dev:
            if sep:
                raise ValueError(f"entry {item.strip()!r} in {text!r} has no device name")
            continue
        port: int | None = None
        if sep:
            port_text = port_text.strip()
            if not port_text.isdigit() or int(port_text) < 1:
                raise ValueError(f"port {port_text!r} of {dev!r} is not a positive integer")
            port = int(port_text)
        if (dev, port) not in entries:
            entries.append((dev, port))
    if not entries:
        raise ValueError(f"no device name in {text!r}")
    return NameSpec(tuple(entries), exclude, exact)


def _unique(items: Iterable[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        if item and item not in out:
            out.append(item)
    return out


def match_spec(name: str, spec: NameSpec, port: int | None = None) -> bool:
    """Whether ``name`` (on ``port``, for devices) is accepted by ``spec``.

    An entry matches when its name equals ``name`` (``exact``) or is a prefix of it, and its
    port is absent, equal to ``port``, or ``port`` is ``None``. ``exclude`` inverts the result.
    """
    hit = any(
        (name == entry if spec.exact else name.startswith(entry))
        and (entry_port is None or port is None or entry_port == port)
        for entry, entry_port in spec.entries
    )
    return hit != spec.exclude


def match_hca(dev: str, port: int, spec: NameSpec) -> bool:
    """Whether RDMA device ``dev`` port ``port`` is accepted by an ``ACOLL_IB_HCA`` spec."""
    return match_spec(dev, spec, port)


# --------------------------------------------------------------------------------------------
# Settings


def parse_family(text: str) -> socket.AddressFamily:
    """Parse ``AF_INET``/``AF_INET6`` (also ``4``/``6``, ``inet``/``inet6``, ``ipv4``/``ipv6``).

    Raises:
        ValueError: any other text.
    """
    key = text.strip().lower().removeprefix("af_")
    if key in ("inet", "4", "ipv4", "inet4"):
        return socket.AF_INET
    if key in ("inet6", "6", "ipv6"):
        return socket.AF_INET6
    raise ValueError("expected AF_INET or AF_INET6")


def _parse_ifname_text(text: str) -> str | None:
    parse_ifname_spec(text)  # validate only
    return text.strip()


SOCKET_IFNAME: Setting[str | None] = Setting(
    "SOCKET_IFNAME", _parse_ifname_text, None,
    "Interfaces to use for sockets: name prefixes, '^' to exclude, '=' for exact names.",
    "INIT")
SOCKET_FAMILY: Setting[socket.AddressFamily | None] = Setting(
    "SOCKET_FAMILY", parse_family, None,
    "Restrict socket interfaces to one address family: AF_INET or AF_INET6.",
    "INIT")


# --------------------------------------------------------------------------------------------
# Selection

_RANK_IB, _RANK_SUBNET, _RANK_OTHER, _RANK_VIRTUAL, _RANK_LO = range(5)
_CLASS_TEXT = {
    _RANK_IB: "ib* interfaces first",
    _RANK_SUBNET: "subnet of ACOLL_COMM_ID {comm}",
    _RANK_OTHER: "any interface but docker*, virbr*, lo",
    _RANK_VIRTUAL: "only docker*/virbr* interfaces are up",
    _RANK_LO: "only loopback is up",
}


def _rank(iface: Interface, comm_addr: str | None) -> int:
    name = iface.name
    if name.startswith("ib"):
        return _RANK_IB
    if comm_addr is not None and iface.contains(comm_addr):
        return _RANK_SUBNET
    if name.startswith("lo"):
        return _RANK_LO
    if name.startswith(("docker", "virbr")):
        return _RANK_VIRTUAL
    return _RANK_OTHER


def _one_per_name(ifaces: Iterable[Interface]) -> list[Interface]:
    chosen: dict[str, Interface] = {}
    for iface in ifaces:
        prev = chosen.get(iface.name)
        if prev is None or (
                prev.family == iface.family == socket.AF_INET6
                and prev.is_link_local and not iface.is_link_local):
            chosen[iface.name] = iface
    return list(chosen.values())  # dicts keep first-insertion order


def _select(ifaces: Sequence[Interface], ifname: str | None,
            family: socket.AddressFamily | None, comm_addr: str | None,
            max_ifs: int) -> tuple[list[Interface], str]:
    pool = _one_per_name(i for i in ifaces if family is None or i.family == family)
    if ifname is not None:
        spec = parse_ifname_spec(ifname)
        hits = [i for i in pool if match_spec(i.name, spec)]
        hits.sort(key=lambda i: _rank(i, None))
        return hits[:max_ifs], f"ACOLL_SOCKET_IFNAME={ifname}"
    for rank in range(5):
        hits = [i for i in pool if _rank(i, comm_addr) == rank]
        if hits:
            return hits[:max_ifs], "automatic: " + _CLASS_TEXT[rank].format(comm=comm_addr)
    return [], "automatic"


def select_interfaces(ifaces: Sequence[Interface], *, ifname: str | None = None,
                      family: socket.AddressFamily | None = None,
                      comm_addr: str | None = None, max_ifs: int = 16) -> list[Interface]:
    """Choose the interfaces to use from ``ifaces`` (pure: no I/O, no settings read).

    Args:
        ifaces: candidate addresses, typically :func:`list_interfaces`.
        ifname: ``ACOLL_SOCKET_IFNAME``-style spec, or ``None`` for automatic selection.
        family: keep only this family when given.
        comm_addr: the ``ACOLL_COMM_ID`` root address (IP literal), enabling the subnet rule.
        max_ifs: the most interfaces returned.

    Returns:
        At most ``max_ifs`` interfaces, one per name, best first (see the module doc);
        empty when nothing qualifies.

    Raises:
        InvalidUsage: ``ifname`` lists no name.
    """
    try:
        return _select(ifaces, ifname, family, comm_addr, max_ifs)[0]
    except ValueError as exc:
        raise InvalidUsage(f"ACOLL_SOCKET_IFNAME={ifname!r}: {exc}") from exc


def _comm_id_host() -> str | None:
    text = os.environ.get("ACOLL_COMM_ID", "").strip()
    if not text:
        return None
    host = text[1:].partition("]")[0] if text.startswith("[") else text.rpartition(":")[0]
    return host or None


def find_interfaces(ifname: str | None = None, family: socket.AddressFamily | None = None,
                    comm_addr: str | None = None, max_ifs: int = 16) -> list[Interface]:
    """Resolve the settings, enumerate interfaces and select the ones to use.

    Args:
        ifname: overrides ``ACOLL_SOCKET_IFNAME``.
        family: overrides ``ACOLL_SOCKET_FAMILY``.
        comm_addr: the root address for the subnet rule; when ``None``, the host part of
            ``ACOLL_COMM_ID`` is used if that is set (IP literals only; names never resolve).
        max_ifs: the most interfaces returned.

    Returns:
        A non-empty list, best first; ``[0]`` is the address to listen on and advertise.

    Raises:
        InvalidUsage: a setting holds invalid text.
        BootstrapError: no interface qualifies (the message lists the interfaces that are up),
            or they cannot be listed.
    """
    spec = SOCKET_IFNAME.resolve(ifname)
    # ``family`` is not always the user's: init_rank passes the unique id's root family.
    # Resolve (and log) the setting itself from the environment; the caller's family wins.
    setting = SOCKET_FAMILY.resolve()
    fam = setting if family is None else family
    if family is not None and setting is not None and family != setting:
        _LOG.info("ACOLL_SOCKET_FAMILY=%s not used: the caller needs %s (the "
                  "family argument or the unique id's root address)",
                  setting.name, family.name)
    if comm_addr is None:
        comm_addr = _comm_id_host()
    try:
        every = list_interfaces()
    except OSError as exc:
        raise BootstrapError(f"cannot list network interfaces: {exc}") from exc
    try:
        chosen, why = _select(every, spec, fam, comm_addr, max_ifs)
    except ValueError as exc:
        raise InvalidUsage(f"ACOLL_SOCKET_IFNAME={spec!r}: {exc}") from exc
    fam_text = ("" if fam is None else f" with ACOLL_SOCKET_FAMILY={fam.name}"
                if family is None else f" in address family {fam.name}")
    if not chosen:
        up = ", ".join(str(i) for i in every) or "none"
        what = f"ACOLL_SOCKET_IFNAME={spec!r}" if spec is not None else "automatic selection"
        raise BootstrapError(
            f"no network interface matches {what}{fam_text}; interfaces up: {up}")
    _LOG.info("using interface%s %s (%s%s)", "s" if len(chosen) > 1 else "",
              ", ".join(str(i) for i in chosen), why, fam_text)
    return chosen
