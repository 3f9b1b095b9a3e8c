"""Unit tests of interface discovery: spec parsing, matching and selection order."""

from __future__ import annotations

import logging
import socket

import pytest

from acoll._net.interfaces import (
    SOCKET_FAMILY,
    SOCKET_IFNAME,
    Interface,
    bind_address_for,
    find_interfaces,
    list_interfaces,
    match_hca,
    match_spec,
    parse_family,
    parse_hca_spec,
    parse_ifname_spec,
    select_interfaces,
)
from acoll.errors import BootstrapError, InvalidUsage

V4, V6 = socket.AF_INET, socket.AF_INET6


def v4(name: str, addr: str, prefix: int = 24) -> Interface:
    return Interface(name, V4, addr, prefix, 0)


def v6(name: str, addr: str, prefix: int = 64, scope: int = 0) -> Interface:
    return Interface(name, V6, addr, prefix, scope)


LO = v4("lo", "127.0.0.1", 8)
ETH0 = v4("eth0", "192.0.2.2")
ETH1 = v4("eth1", "198.51.100.7")
ETH10 = v4("eth10", "203.0.113.9")
DOCKER0 = v4("docker0", "172.17.0.1", 16)
VIRBR0 = v4("virbr0", "192.168.122.1")
IB0 = v4("ib0", "10.10.0.5", 16)


def names(ifaces: list[Interface]) -> list[str]:
    return [i.name for i in ifaces]


# ---------------------------------------------------------------------------- spec parsing

def test_parse_prefix_list() -> None:
    spec = parse_ifname_spec(" eth , ib0,,eth ")
    assert spec.names == ("eth", "ib0")
    assert not spec.exclude
    assert not spec.exact


@pytest.mark.parametrize(("text", "exclude", "exact", "names_"), [
    ("^docker,lo", True, False, ("docker", "lo")),
    ("=eth0", False, True, ("eth0",)),
    ("^=docker0", True, True, ("docker0",)),
    ("=eth0:1", False, True, ("eth0:1",)),  # alias labels keep their colon
])
def test_parse_flags(text: str, exclude: bool, exact: bool, names_: tuple[str, ...]) -> None:
    spec = parse_ifname_spec(text)
    assert (spec.exclude, spec.exact, spec.names) == (exclude, exact, names_)


@pytest.mark.parametrize("text", ["", "^", "=", "^=", " , ,"])
def test_parse_empty_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="no interface name"):
        parse_ifname_spec(text)


def test_match_prefix_exact_exclude() -> None:
    assert match_spec("eth0", parse_ifname_spec("eth"))
    assert match_spec("eth10", parse_ifname_spec("eth"))
    assert not match_spec("ib0", parse_ifname_spec("eth"))
    assert match_spec("eth0", parse_ifname_spec("=eth0"))
    assert not match_spec("eth00", parse_ifname_spec("=eth0"))
    assert not match_spec("docker0", parse_ifname_spec("^docker,lo"))
    assert not match_spec("lo", parse_ifname_spec("^docker,lo"))
    assert match_spec("eth0", parse_ifname_spec("^docker,lo"))
    assert not match_spec("docker0", parse_ifname_spec("^=docker0"))
    assert match_spec("docker01", parse_ifname_spec("^=docker0"))


# ---------------------------------------------------------------------------- HCA specs

def test_parse_hca_spec() -> None:
    spec = parse_hca_spec("mlx5_0:1, mlx5_1 ,mlx5_0:1")
    assert spec.entries == (("mlx5_0", 1), ("mlx5_1", None))
    assert not spec.exclude
    spec = parse_hca_spec("^=mlx5_2:2")
    assert (spec.exclude, spec.exact, spec.entries) == (True, True, (("mlx5_2", 2),))


@pytest.mark.parametrize("text", ["", "^", "mlx5_0:x", "mlx5_0:0", ":1", "mlx5_0:"])
def test_parse_hca_spec_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hca_spec(text)


def test_match_hca() -> None:
    spec = parse_hca_spec("mlx5_0:1,mlx5_1")
    assert match_hca("mlx5_0", 1, spec)
    assert not match_hca("mlx5_0", 2, spec)
    assert match_hca("mlx5_1", 2, spec)
    assert match_hca("mlx5_10", 1, spec)  # prefix match, as NCCL
    assert not match_hca("mlx5_10", 1, parse_hca_spec("=mlx5_1"))
    excl = parse_hca_spec("^mlx5_0:1")
    assert not match_hca("mlx5_0", 1, excl)
    assert match_hca("mlx5_0", 2, excl)
    assert match_hca("mlx4_0", 1, excl)


# ---------------------------------------------------------------------------- selection

def test_ib_wins() -> None:
    assert names(select_interfaces([LO, DOCKER0, ETH0, IB0])) == ["ib0"]


def test_other_interfaces_before_docker_and_lo() -> None:
    got = select_interfaces([LO, DOCKER0, ETH0, VIRBR0, ETH1])
    assert names(got) == ["eth0", "eth1"]


def test_docker_only_when_nothing_else() -> None:
    assert names(select_interfaces([LO, DOCKER0])) == ["docker0"]
    assert names(select_interfaces([LO, VIRBR0])) == ["virbr0"]


def test_lo_last() -> None:
    assert names(select_interfaces([LO])) == ["lo"]
    assert select_interfaces([]) == []


def test_spec_exclude_docker_lo() -> None:
    got = select_interfaces([LO, DOCKER0, ETH0, IB0], ifname="^docker,lo")
    assert names(got) == ["ib0", "eth0"]


def test_spec_exact_vs_prefix() -> None:
    pool = [LO, ETH0, ETH1, ETH10]
    assert names(select_interfaces(pool, ifname="=eth1")) == ["eth1"]
    assert names(select_interfaces(pool, ifname="eth1")) == ["eth1", "eth10"]
    assert names(select_interfaces(pool, ifname="eth")) == ["eth0", "eth1", "eth10"]


def test_spec_exclude_exact_docker0() -> None:
    pool = [LO, DOCKER0, v4("docker01", "172.18.0.1", 16)]
    assert names(select_interfaces(pool, ifname="^=docker0")) == ["docker01", "lo"]


def test_spec_matches_ordered_lo_last() -> None:
    # NCCL would keep getifaddrs order (lo first); acoll puts loopback last.
    assert names(select_interfaces([LO, DOCKER0, ETH0], ifname="^eth")) == ["docker0", "lo"]
    assert names(select_interfaces([LO, ETH0], ifname="=lo")) == ["lo"]


def test_spec_no_match_gives_empty() -> None:
    assert select_interfaces([LO, ETH0], ifname="=eth9") == []


def test_spec_invalid() -> None:
    with pytest.raises(InvalidUsage):
        select_interfaces([LO], ifname="^")


def test_subnet_rule() -> None:
    pool = [LO, DOCKER0, ETH0, ETH1]
    assert names(select_interfaces(pool, comm_addr="198.51.100.1")) == ["eth1"]
    # an address in no subnet falls through to the generic class
    assert names(select_interfaces(pool, comm_addr="10.1.2.3")) == ["eth0", "eth1"]
    # an address in docker0's subnet selects docker0
    assert names(select_interfaces(pool, comm_addr="172.17.3.3")) == ["docker0"]
    # ib still comes first, as in NCCL
    assert names(select_interfaces([*pool, IB0], comm_addr="198.51.100.1")) == ["ib0"]
    # names are never resolved
    assert names(select_interfaces(pool, comm_addr="example.invalid")) == ["eth0", "eth1"]


def test_subnet_rule_ipv6() -> None:
    pool = [LO, ETH0, v6("eth1", "2001:db8:1::7"), v6("eth2", "2001:db8:2::7")]
    assert names(select_interfaces(pool, comm_addr="2001:db8:2::1")) == ["eth2"]


def test_family_filter() -> None:
    pool = [LO, ETH0, v6("eth0", "2001:db8::2"), v6("eth1", "2001:db8:1::2")]
    got = select_interfaces(pool, family=V6)
    assert [(i.name, i.address) for i in got] == [("eth0", "2001:db8::2"),
                                                  ("eth1", "2001:db8:1::2")]
    got = select_interfaces(pool, family=V4)
    assert [(i.name, i.address) for i in got] == [("eth0", "192.0.2.2")]


def test_one_entry_per_name() -> None:
    pool = [ETH0, v4("eth0", "192.0.2.99"), v6("eth0", "2001:db8::2")]
    got = select_interfaces(pool)
    assert got == [ETH0]


def test_ipv6_link_local_scope_id() -> None:
    ll = v6("eth0", "fe80::1", scope=7)
    glob = v6("eth0", "2001:db8::1")
    # only link-local: kept, with its scope id
    got = select_interfaces([ll], family=V6)
    assert got == [ll]
    assert got[0].sockaddr(1234) == ("fe80::1", 1234, 0, 7)
    assert bind_address_for(got[0]) == "fe80::1%7"
    # link-local gives way to a global address of the same interface
    assert select_interfaces([ll, glob], family=V6) == [glob]
    assert select_interfaces([glob, ll], family=V6) == [glob]


def test_max_ifs() -> None:
    pool = [v4(f"eth{n}", f"192.0.2.{n + 1}") for n in range(20)]
    assert len(select_interfaces(pool)) == 16
    assert names(select_interfaces(pool, max_ifs=2)) == ["eth0", "eth1"]


# ---------------------------------------------------------------------------- Interface

def test_interface_helpers() -> None:
    assert ETH0.sockaddr(80) == ("192.0.2.2", 80)
    assert ETH0.contains("192.0.2.200")
    assert not ETH0.contains("192.0.3.1")
    assert not ETH0.contains("2001:db8::1")
    assert not ETH0.contains("not-an-ip")
    assert v6("eth0", "fe80::1", scope=3).contains("fe80::99%3")
    assert str(ETH0) == "eth0 192.0.2.2/24"
    assert bind_address_for(ETH0) == "192.0.2.2"


# ---------------------------------------------------------------------------- settings

@pytest.mark.parametrize(("text", "fam"), [
    ("AF_INET", V4), ("af_inet6", V6), ("4", V4), ("6", V6), ("inet", V4), ("inet6", V6),
    ("ipv6", V6),
])
def test_parse_family(text: str, fam: socket.AddressFamily) -> None:
    assert parse_family(text) == fam


def test_family_setting_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_FAMILY", "AF_UNIX")
    with pytest.raises(InvalidUsage, match="ACOLL_SOCKET_FAMILY"):
        SOCKET_FAMILY.resolve()
    with pytest.raises(InvalidUsage):
        find_interfaces()


def test_ifname_setting_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_IFNAME", "^=")
    with pytest.raises(InvalidUsage, match="ACOLL_SOCKET_IFNAME"):
        SOCKET_IFNAME.resolve()


# ---------------------------------------------------------------------------- real host

def test_list_interfaces_has_loopback() -> None:
    found = list_interfaces()
    assert any(i.name.startswith("lo") and i.address == "127.0.0.1" and i.prefixlen == 8
               for i in found)
    assert all(i.family in (V4, V6) for i in found)
    assert not any(i.address == "::1" for i in found)
    for i in found:
        if i.family == V6 and i.address.startswith("fe80"):
            assert i.scope_id == socket.if_nametoindex(i.name)


def test_find_interfaces_loopback(monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("ACOLL_COMM_ID", raising=False)
    monkeypatch.delenv("ACOLL_SOCKET_FAMILY", raising=False)
    with caplog.at_level(logging.INFO, logger="acoll"):
        got = find_interfaces(ifname="=lo", family=V4)
    assert got[0].address == "127.0.0.1"
    assert "using interface lo 127.0.0.1/8" in caplog.text
    with socket.socket(V4, socket.SOCK_STREAM) as sock:
        sock.bind(got[0].sockaddr(0))


def test_find_interfaces_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOLL_SOCKET_FAMILY", raising=False)
    monkeypatch.setenv("ACOLL_SOCKET_IFNAME", "=nosuchif0")
    with pytest.raises(BootstrapError, match=r"nosuchif0.*interfaces up: .*127\.0\.0\.1"):
        find_interfaces()
