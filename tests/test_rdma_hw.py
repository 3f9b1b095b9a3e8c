"""The RDMA transport on a real device (InfiniBand, RoCE, or rxe/siw): the shared
conformance battery and a 2-rank all-reduce, over real pyverbs. ``make test-rdma`` runs
this file; anywhere else (no pyverbs, no device) every test is skipped with the reason.

Also, wherever pyverbs is installed: device listing runs for real (and, on a machine
without RDMA hardware, finds nothing), and pyverbs' enum values are those of
``acoll._transport.rdma.spec``."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from acoll import Communicator
from acoll._transport.rdma import RdmaTransport, rdma_ports, spec
from acoll._transport.rdma.verbs import list_ports, load_pyverbs
from acoll.testing import run_ranks
from transport_conformance import TransportConformance, TransportHarness

pytestmark = pytest.mark.rdma

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _probe() -> tuple[Any, str, str]:
    """pyverbs (or None), why it is missing, why no device can be used (looked up once, at
    import, so that every skip says the same thing in one line)."""
    try:
        lib = load_pyverbs()
    except ImportError as exc:
        why = (f"pyverbs cannot be imported ({exc}); it needs the rdma-core it was built "
               "against (Debian: python3-pyverbs)")
        return None, why, why
    found, why = rdma_ports("", lib)
    if not found:
        return lib, "", (f"no usable RDMA device here: {why} (ACOLL_IB_HCA picks devices; "
                         "rxe or siw work too)")
    return lib, "", ""


LIB, NO_PYVERBS, NO_DEVICE = _probe()
if NO_PYVERBS:
    pytest.skip(NO_PYVERBS, allow_module_level=True)
needs_device = pytest.mark.skipif(bool(NO_DEVICE), reason=NO_DEVICE)


def _pyverbs() -> Any:
    assert LIB is not None
    return LIB


def _port() -> tuple[Any, Any, Any]:
    lib = _pyverbs()
    [(port, gid), *_] = rdma_ports("", lib)[0]
    return lib, port, gid


def test_real_listing_agrees_with_the_machine() -> None:
    """Device listing runs through real pyverbs; on a machine without RDMA devices
    (``/sys/class/infiniband`` absent or empty) it finds none, and says why."""
    lib = _pyverbs()
    ports, why = list_ports(lib)
    sysfs = Path("/sys/class/infiniband")
    present = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
    if not present:
        assert ports == []
        # libibverbs answers an empty list, or fails when no RDMA driver is loaded at all
        assert why == "no RDMA device" or why.startswith("listing RDMA devices failed")
    else:
        assert {p.device for p in ports} <= set(present)


def test_loading_pyverbs_leaves_the_root_logger_alone() -> None:
    """pyverbs calls logging.basicConfig(level=INFO) on import; acoll undoes it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    load_pyverbs()
    assert (root.handlers, root.level) == (handlers, level)


def test_pyverbs_enums_match_the_spec_values() -> None:
    e = _pyverbs().e
    assert int(e.IBV_QPS_RTS) == spec.QPS_RTS
    assert int(e.IBV_QPS_ERR) == spec.QPS_ERR
    assert int(e.IBV_ACCESS_REMOTE_WRITE) == spec.ACCESS_REMOTE_WRITE
    assert int(e.IBV_WC_RECV_RDMA_WITH_IMM) == spec.WC_RECV_RDMA_WITH_IMM
    assert int(e.IBV_WC_RETRY_EXC_ERR) == 12
    assert int(e.IBV_LINK_LAYER_ETHERNET) == spec.LINK_LAYER_ETHERNET
    assert int(e.IBV_QP_DEST_QPN) == 1 << 20


def _make(key: bytes) -> RdmaTransport:
    lib, port, gid = _port()
    return RdmaTransport(("127.0.0.1", 0), socket.AF_INET, key=key, port=port, gid=gid,
                         lib=lib, timeout=10.0)


@pytest.fixture
def harness() -> TransportHarness:
    return TransportHarness("hw", lambda: _make(KEY), stranger=lambda: _make(OTHER_KEY),
                            rendezvous=16 << 10)


if NO_DEVICE:  # one visible skip instead of one per test of the battery

    def test_conformance_battery_on_hardware() -> None:
        pytest.skip(NO_DEVICE)

else:

    class TestRdmaHardware(TransportConformance):
        """The shared battery on a real RDMA device."""


@needs_device
async def test_all_reduce_two_ranks_on_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")

    async def fn(comm: Communicator) -> np.ndarray:
        x = np.arange(1 << 20, dtype=np.float32) + comm.rank
        await comm.all_reduce(x)
        return x

    results = await asyncio.wait_for(run_ranks(2, fn, net="ib"), 120)
    expected = np.arange(1 << 20, dtype=np.float32) * 2 + 1
    for x in results:
        np.testing.assert_array_equal(x, expected)
