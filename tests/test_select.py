"""Choosing the data network in ``initNet`` order (plugin -> ib -> socket): when RDMA is
used, when it is not (one INFO line saying why), and ``ACOLL_NET=ib`` failing clearly.
The RDMA stack is the verbs test double, installed through the provider hook."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from acoll._transport import select
from acoll._transport.inproc import InprocTransport
from acoll._transport.rdma import RdmaTransport, set_provider
from acoll._transport.shm import ShmTransport
from acoll._transport.tcp import TcpTransport
from acoll.errors import InvalidUsage, TransportError
from verbs_double import E, Fabric, PortSpec

KEY = bytes(range(32))
ADDR = ("127.0.0.1", 0)


def _choose(net: str | None = None) -> Any:
    return select.select_transport(ADDR, socket.AF_INET, timeout=5.0, key=KEY, net=net)


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    fab = Fabric()
    previous = set_provider(lambda: fab.lib)
    try:
        yield fab
    finally:
        set_provider(previous)
        fab.close()


@pytest.fixture
def no_pyverbs() -> Iterator[None]:
    def missing() -> Any:
        raise ImportError("No module named 'pyverbs'")

    previous = set_provider(missing)
    try:
        yield
    finally:
        set_provider(previous)


@pytest.fixture
def net_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="acoll.NET")
    return caplog


def _ib_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("NET/IB")]


def test_pyverbs_missing_means_sockets(no_pyverbs: None, net_log: Any) -> None:
    transport = _choose()
    assert isinstance(transport, TcpTransport)
    assert _ib_lines(net_log) == ["NET/IB: not used (pyverbs cannot be imported (No module named "
                                  "'pyverbs')); using sockets"]


def test_no_device_means_sockets(fabric: Fabric, net_log: Any) -> None:
    assert isinstance(_choose(), TcpTransport)
    assert _ib_lines(net_log) == ["NET/IB: not used (no RDMA device); using sockets"]


def test_no_active_port_means_sockets(fabric: Fabric, net_log: Any) -> None:
    fabric.add_device("mlx5_0", [PortSpec(state=E.IBV_PORT_DOWN)])
    assert isinstance(_choose(), TcpTransport)
    assert _ib_lines(net_log) == ["NET/IB: not used (no usable RDMA port: 1 port(s) found, "
                                  "1 not active); using sockets"]


def test_disabled_means_sockets(fabric: Fabric, net_log: Any,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    fabric.add_device("mlx5_0")
    monkeypatch.setenv("ACOLL_IB_DISABLE", "1")
    assert isinstance(_choose(), TcpTransport)
    assert _ib_lines(net_log) == ["NET/IB: not used (disabled by ACOLL_IB_DISABLE); using "
                                  "sockets"]


def test_hca_filter_can_exclude_every_port(fabric: Fabric, net_log: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fabric.add_device("mlx5_0")
    monkeypatch.setenv("ACOLL_IB_HCA", "^mlx5")
    assert isinstance(_choose(), TcpTransport)
    assert "1 excluded by ACOLL_IB_HCA" in _ib_lines(net_log)[0]


def test_active_port_means_ib(fabric: Fabric, net_log: Any,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    fabric.add_device("mlx5_0", [PortSpec(state=E.IBV_PORT_DOWN), PortSpec()])
    fabric.add_device("mlx5_1")
    monkeypatch.setenv("ACOLL_IB_HCA", "mlx5_0")
    transport = _choose()
    try:
        assert isinstance(transport, RdmaTransport)
        assert transport.port.name == "mlx5_0:2"
        lines = _ib_lines(net_log)
        # every usable port with its speed, MTU and limits, then the one in use
        assert lines[0].startswith("NET/IB: mlx5_0:2 IB 212.5 Gb/s, MTU 4096, LID 0x2")
        assert "max_qp_wr 32768" in lines[0]
        assert lines[1].startswith("NET/IB: using mlx5_0:2 (eager 16384 bytes")
        assert len(lines) == 2
    finally:
        transport.close()


def test_forced_ib_when_impossible_is_a_transport_error(fabric: Fabric,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    with pytest.raises(TransportError, match="ACOLL_NET=ib: RDMA is not possible here: no "
                                             "RDMA device"):
        _choose("ib")
    monkeypatch.setenv("ACOLL_NET", "IB")
    with pytest.raises(TransportError, match="no RDMA device"):
        _choose()
    fabric.add_device("mlx5_0")
    monkeypatch.setenv("ACOLL_IB_DISABLE", "1")
    with pytest.raises(TransportError, match="disabled by ACOLL_IB_DISABLE"):
        _choose()


def test_forced_ib_without_pyverbs(no_pyverbs: None) -> None:
    with pytest.raises(TransportError, match="pyverbs cannot be imported"):
        _choose("ib")


def test_forced_socket_skips_ib(fabric: Fabric, net_log: Any) -> None:
    fabric.add_device("mlx5_0")
    assert isinstance(_choose("socket"), TcpTransport)
    assert _ib_lines(net_log) == []


def test_unknown_network(fabric: Fabric) -> None:
    with pytest.raises(InvalidUsage, match="no such network"):
        _choose("carrier-pigeon")


def test_transport_list_order(fabric: Fabric) -> None:
    fabric.add_device("mlx5_0")
    transports = select.select_transports(ADDR, socket.AF_INET, timeout=5.0, key=KEY)
    try:
        assert [type(t) for t in transports] == [InprocTransport, ShmTransport,
                                                 RdmaTransport]
    finally:
        for t in transports:
            t.close()


def test_ib_devices(fabric: Fabric) -> None:
    assert select.ib_devices() == ([], "no RDMA device")
    fabric.add_device("mlx5_0", [PortSpec(), PortSpec(state=E.IBV_PORT_INIT)])
    fabric.add_device("mlx5_1")
    assert select.ib_devices() == ([("mlx5_0", 1), ("mlx5_1", 1)], "")
    assert select.ib_devices("mlx5_1") == ([("mlx5_1", 1)], "")
