"""GPUDirect RDMA in the RDMA transport, without a GPU or a NIC.

The topology, support and flush rules of ``acoll._transport.rdma.gdr`` are tested on plain
values. The transport runs over the verbs test double (``verbs_double``: ``DmaBufMR``,
RDMA READ, the peer-memory rule) with buffers of a fake device space (``fake_device``:
host memory the transport must treat as device memory: no host view, stream work that
runs only when a fence passes) and a fake CUDA driver installed where the transport
would load ``libcuda`` (``fake_gdr``): the shared conformance battery with device buffers
on both ends, then registration, ordering, the flush, the fallbacks and their log lines,
and an all-reduce of fake-device communicators over ``ib``.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import gc
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import acoll
from acoll import _communicator
from acoll._memory import MemoryKind, host_buffer
from acoll._transport.base import ConnectionLost
from acoll._transport.rdma import RdmaConnection, RdmaTransport, gdr, provided
from acoll._transport.rdma.gdr import Distance, GdrMode
from acoll._transport.rdma.verbs import Device
from acoll.errors import InvalidUsage, TransportError
from acoll.testing import run_ranks
from fake_device import FakeDeviceSpace
from fake_gdr import GPU_BUS, FakeCudaDriver, attach, make_sysfs
from rdma_double import Config, cleanup, fabric_for, make_transport
from transport_conformance import (
    FailureRecorder,
    Pair,
    TransportConformance,
    TransportHarness,
    connect_pair,
    meta_for,
    payload,
    within,
)
from verbs_double import Fabric

# ---------------------------------------------------------------------------- topology
SWITCH = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]  # root port, switch upstream port
GPU_PATH = [*SWITCH, "0000:02:00.0", GPU_BUS]  # behind one downstream port
NIC_PATH = [*SWITCH, "0000:02:01.0", "0000:04:00.0"]  # behind another: PIX
S = "/sys/devices/"


@pytest.mark.parametrize(("gpu", "nic", "numa", "want"), [
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0",
     (0, 0), Distance.LOC),
    ("/".join(GPU_PATH), "/".join(NIC_PATH), (0, 0), Distance.PIX),
    # two switches deep on the GPU side
    ("/".join([*SWITCH, "0000:02:00.0", "0000:05:00.0", "0000:06:00.0", "0000:07:00.0"]),
     "/".join(NIC_PATH), (0, 0), Distance.PXB),
    # different root ports of one host bridge
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:02.0/0000:02:00.0",
     (0, 0), Distance.PHB),
    # different root complexes: same socket, unknown socket, other socket
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0",
     (0, 0), Distance.PHB),
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0",
     (-1, 1), Distance.PHB),
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0",
     (0, 1), Distance.SYS),
])
def test_pci_distance(gpu: str, nic: str, numa: tuple[int, int], want: Distance) -> None:
    assert gdr.pci_distance(S + gpu, S + nic, *numa) is want
    assert gdr.pci_distance(S + nic, S + gpu, *reversed(numa)) is want  # symmetric


@pytest.mark.parametrize("bad", ["/sys/bus/pci/devices/0000:03:00.0", "/sys/devices/pci0000:00",
                                 ""])
def test_pci_distance_refuses_other_paths(bad: str) -> None:
    with pytest.raises(ValueError):
        gdr.pci_distance(bad, S + "/".join(NIC_PATH))


def test_gdr_level_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gdr.GDR_LEVEL.resolve() is Distance.PXB  # NCCL's default
    monkeypatch.setenv("ACOLL_NET_GDR_LEVEL", " pix ")
    assert gdr.GDR_LEVEL.resolve() is Distance.PIX
    monkeypatch.setenv("ACOLL_NET_GDR_LEVEL", "NVL")
    with pytest.raises(InvalidUsage, match="ACOLL_NET_GDR_LEVEL='NVL'"):
        gdr.GDR_LEVEL.resolve()
    monkeypatch.setenv("ACOLL_DMABUF_ENABLE", "0")
    assert gdr.DMABUF_ENABLE.resolve() is False
    monkeypatch.setenv("ACOLL_GDR_FLUSH_DISABLE", "1")
    assert gdr.FLUSH_DISABLE.resolve() is True


@pytest.mark.parametrize(("cc", "disabled", "forced", "want"), [
    (7, False, False, True), (8, False, False, True), (9, False, False, False),
    (10, False, True, True), (8, True, False, False), (9, True, True, False)])
def test_flush_needed(cc: int, disabled: bool, forced: bool, want: bool) -> None:
    assert gdr.flush_needed(cc, disabled=disabled, forced=forced) is want


def test_dmabuf_range_is_whole_pages() -> None:
    assert gdr.dmabuf_range(0x10000, 4096, 4096) == (0x10000, 4096)
    assert gdr.dmabuf_range(0x10010, 10, 4096) == (0x10000, 4096)
    assert gdr.dmabuf_range(0x10ff0, 0x20, 4096) == (0x10000, 0x2000)


_D = {"gpu": "cuda:0", "nic": "mlx5_0", "level": Distance.PXB, "flush": True}


@pytest.mark.parametrize(("facts", "mode", "says"), [
    ({"distance": Distance.PIX, "nic_dmabuf": (True, ""), "gpu_dmabuf": True,
      "dmabuf_enable": True, "peermem": True}, GdrMode.DMABUF,
     "cuda:0 <-> mlx5_0: dma-buf (distance PIX, flush on)"),
    ({"distance": Distance.PXB, "nic_dmabuf": (True, ""), "gpu_dmabuf": True,
      "dmabuf_enable": False, "peermem": True}, GdrMode.PEERMEM,
     "peer memory (nvidia_peermem; distance PXB, flush on; dma-buf disabled by "
     "ACOLL_DMABUF_ENABLE=0)"),
    ({"distance": Distance.LOC, "nic_dmabuf": (False, "old kernel"), "gpu_dmabuf": True,
      "dmabuf_enable": True, "peermem": True}, GdrMode.PEERMEM, "no dma-buf: old kernel"),
    ({"distance": Distance.PIX, "nic_dmabuf": (True, ""), "gpu_dmabuf": False,
      "dmabuf_enable": True, "peermem": False}, None,
     "off (no dma-buf: cuda:0 does not export dma-bufs; no peer memory module "
     "(nvidia_peermem)); staging through host memory"),
    ({"distance": Distance.PHB, "nic_dmabuf": (True, ""), "gpu_dmabuf": True,
      "dmabuf_enable": True, "peermem": True}, None,
     "off (too far: distance PHB > ACOLL_NET_GDR_LEVEL PXB)"),
    ({"distance": None, "nic_dmabuf": (True, ""), "gpu_dmabuf": True,
      "dmabuf_enable": True, "peermem": True}, None, "PCI distance is unknown"),
])
def test_decide(facts: dict[str, Any], mode: GdrMode | None, says: str) -> None:
    choice = gdr.decide(**_D, **facts)
    assert choice.mode is mode
    assert choice.enabled is (mode is not None)
    assert says in choice.why
    assert choice.flush is (mode is not None)


@pytest.mark.parametrize("version", ["module/nvidia_peermem/version",
                                     "kernel/mm/memory_peers/nv_mem/version",
                                     "kernel/mm/memory_peers/nv_mem_nc/version", None])
def test_peermem_and_sysfs_paths(tmp_path: Path, version: str | None) -> None:
    root = make_sysfs(tmp_path, gpu=GPU_PATH, nics={"mlx5_0": NIC_PATH}, gpu_numa=1,
                      nic_numa=1, peermem=version)
    with gdr.provided(None, sysfs=str(root)):
        assert gdr.peermem_loaded() is (version is not None)
        gpath, gnuma = gdr.gpu_pci_path(GPU_BUS.upper())
        npath, nnuma = gdr.nic_pci_path("mlx5_0")
        assert (gnuma, nnuma) == (1, 1)
        assert gdr.pci_distance(gpath, npath, gnuma, nnuma) is Distance.PIX
        missing, numa = gdr.gpu_pci_path("0000:99:00.0")
        assert numa == -1
        with pytest.raises(ValueError):
            gdr.pci_distance(missing, npath)
    assert gdr.sysfs_root() == "/"


def test_libcuda_missing_is_a_clear_error() -> None:
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    with gdr.provided(None), pytest.raises(gdr.GdrError, match=r"libcuda\.so\.1"):
        gdr.get_driver()


@pytest.mark.parametrize(("api", "kernel", "ok", "why"), [
    ("fd", True, True, ""),
    ("fd", False, False, "kernel driver does not register dma-bufs"),
    ("object", True, False, "before v44"),
    (None, True, False, "no DmaBufMR"),
])
def test_probe_dmabuf(api: str | None, kernel: bool, ok: bool, why: str) -> None:
    """NCCL's probe (a registration of descriptor -1) through both pyverbs signatures."""
    fab = Fabric(dmabuf_api=api)
    fab.add_device("ib0")
    fab.devices["ib0"].dmabuf = kernel
    try:
        dev = Device(fab.lib, "ib0")
        got, reason = dev.probe_dmabuf()
        assert got is ok
        assert why in reason
        assert not dev.pd.mrs  # the probe left nothing registered
        dev.close()
    finally:
        fab.close()


# ---------------------------------------------------------------------------- environment
@dataclass
class Env:
    """The fake GPU world of one test (``ENV[0]``)."""

    driver: FakeCudaDriver
    space: FakeDeviceSpace
    root: Path

    def buffer(self, obj: Any) -> Any:
        return self.driver.buffer(obj, self.space)


ENV: list[Env] = []


def _world(tmp: Path, *, peermem: bool = False, **driver: Any) -> Iterator[Env]:
    root = make_sysfs(tmp, gpu=GPU_PATH, nics={"ib0": NIC_PATH, "roce0": NIC_PATH},
                      peermem="module/nvidia_peermem/version" if peermem else None)
    env = Env(FakeCudaDriver(**driver), FakeDeviceSpace(0), root)
    ENV.append(env)
    try:
        with gdr.provided(env.driver, sysfs=str(root)):
            yield env
    finally:
        ENV.remove(env)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    yield from _world(tmp_path)


@pytest.fixture(autouse=True)
async def _fabric_cleanup() -> AsyncIterator[None]:
    yield
    cleanup()


def _make(config: Config, **overrides: Any) -> RdmaTransport:
    t = make_transport(config, **overrides)
    attach(fabric_for(config), ENV[-1].driver)
    return t


GDR_IB = Config("gdr-ib")  # deferred work, 16 KiB eager, 1 MiB chunks
GDR_ROCE = Config("gdr-roce", roce=True, deferred=False, eager=1024, depth=8,
                  chunk=64 << 10)


def _harness(config: Config) -> TransportHarness:
    return TransportHarness(config.name, lambda: _make(config), rendezvous=0,
                            buffer=lambda obj: ENV[-1].buffer(obj))


@pytest.fixture(params=[_harness(GDR_IB), _harness(GDR_ROCE)], ids=str)
def harness(request: pytest.FixtureRequest, env: Env) -> TransportHarness:
    return request.param  # type: ignore[no-any-return]


class TestGdrConformance(TransportConformance):
    """The shared battery with device buffers on both ends (dma-buf regions, flushes on:
    the fake GPU has compute capability 8)."""


# ---------------------------------------------------------------------------- helpers
async def _pair(config: Config = GDR_IB, **overrides: Any) -> Pair:
    return await connect_pair(TransportHarness(config.name, lambda: _make(config,
                                                                          **overrides)))


def _conns(p: Pair) -> tuple[RdmaConnection, RdmaConnection]:
    assert isinstance(p.a, RdmaConnection)
    assert isinstance(p.b, RdmaConnection)
    return p.a, p.b


@pytest.fixture
async def pair(env: Env) -> AsyncIterator[Pair]:
    p = await _pair()
    try:
        yield p
    finally:
        await p.aclose()


async def _send_recv(env: Env, p: Pair, n: int, tag: int = 1) -> tuple[bytearray, bytearray]:
    a, b = _conns(p)
    data, out = payload(n, tag), bytearray(n)
    rfut = b.irecv(env.buffer(out), tag)
    await within(a.isend(env.buffer(data), tag, meta_for(tag)))
    assert await within(rfut) == meta_for(tag)
    return data, out


# ---------------------------------------------------------------------------- choice
async def test_memory_for_adds_the_device_and_logs_once(env: Env, caplog: Any) -> None:
    t = _make(GDR_IB)
    staging = env.space.staging()
    with caplog.at_level(logging.INFO, logger="acoll.NET"):
        assert t.memory_for(staging) == {MemoryKind.HOST, MemoryKind.CUDA}
        assert t.memory_for(staging) == {MemoryKind.HOST, MemoryKind.CUDA}
        assert t.memory_for(None) == {MemoryKind.HOST}
    lines = [r.getMessage() for r in caplog.records if "GPUDirect" in r.getMessage()]
    assert lines == [f"NET/IB: GPUDirect RDMA cuda:0 ({GPU_BUS}) <-> ib0: dma-buf "
                     "(distance PIX, flush on)"]


@pytest.mark.parametrize(("case", "says"), [
    ("no-gpu-dmabuf", "does not export dma-bufs; no peer memory module"),
    ("no-nic-dmabuf", "ib0's kernel driver does not register dma-bufs"),
    ("old-pyverbs", "rdma-core before v44"),
    ("dmabuf-disabled", "dma-buf disabled by ACOLL_DMABUF_ENABLE=0"),
    ("too-far", "too far: distance PIX > ACOLL_NET_GDR_LEVEL LOC"),
    ("no-driver", "cuDeviceGetPCIBusId failed: CUresult 100"),
])
async def test_fallback_to_staging_says_why(case: str, says: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            caplog: Any) -> None:
    kw: dict[str, Any] = {}
    if case == "no-gpu-dmabuf":
        kw["dmabuf"] = False
    if case == "no-driver":
        kw["fail"] = {"cuDeviceGetPCIBusId": 100}
    if case == "dmabuf-disabled":
        monkeypatch.setenv("ACOLL_DMABUF_ENABLE", "0")
    if case == "too-far":
        monkeypatch.setenv("ACOLL_NET_GDR_LEVEL", "LOC")
    for env in _world(tmp_path, **kw):
        cfg = Config(f"fallback-{case}")
        fab = fabric_for(cfg)
        if case == "no-nic-dmabuf":
            fab.devices["ib0"].dmabuf = False
        if case == "old-pyverbs":
            fab.dmabuf_api = "object"
            fab.lib = fab._make_lib()
        t = _make(cfg)
        with caplog.at_level(logging.INFO, logger="acoll.NET"):
            assert t.memory_for(env.space.staging()) == {MemoryKind.HOST}
        [line] = [r.getMessage() for r in caplog.records if "GPUDirect" in r.getMessage()]
        assert says in line
        assert "staging through host memory" in line
        # a device buffer that reaches it anyway fails that operation, clearly
        p = await connect_pair(TransportHarness(cfg.name, lambda: _make(cfg)))  # noqa: B023
        try:
            a, _b = _conns(p)
            with pytest.raises(gdr.GdrError, match="reached the RDMA transport, but"):
                await within(a.isend(env.buffer(payload(100_000, 1)), 1, meta_for(1)))
            assert a.failed is None
        finally:
            await p.aclose()


async def test_peer_memory_when_dmabuf_is_off(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With dma-buf disabled and nvidia_peermem loaded, device memory is registered as an
    ordinary region of the device pointer (the double accepts that only with a peer
    memory module)."""
    monkeypatch.setenv("ACOLL_DMABUF_ENABLE", "0")
    for env in _world(tmp_path, peermem=True):
        cfg = Config("peermem")
        fabric_for(cfg).peermem = True
        p = await connect_pair(TransportHarness(cfg.name, lambda: _make(cfg)))  # noqa: B023
        try:
            a, _b = _conns(p)
            assert a._t.gdr_choice(0).mode is GdrMode.PEERMEM
            data, out = await _send_recv(env, p, 300_000)
            assert out == data
            assert env.driver.exported == []  # no dma-buf
            [cache] = a._t.device_caches.values()
            [entry] = cache._lru.values()
            assert entry.region.iova == entry.region.addr  # addressed by pointer
        finally:
            await p.aclose()


# ---------------------------------------------------------------------------- registration
async def test_dmabuf_registration_covers_the_allocation(env: Env, pair: Pair) -> None:
    a, b = _conns(pair)
    src = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    dst = np.zeros_like(src)
    sbuf, dbuf = env.buffer(src), env.buffer(dst)
    for i in range(3):
        rfut = b.irecv(dbuf, i)
        await within(a.isend(sbuf, i, meta_for(i)))
        await within(rfut)
    # slices of the same allocations hit the same regions
    rfut = b.irecv(dbuf[1000:50_000], 9)
    await within(a.isend(sbuf[2000:51_000], 9, meta_for(9)))
    await within(rfut)
    db, sb = dst.view(np.uint8), src.view(np.uint8)  # the buffers are bytes
    np.testing.assert_array_equal(db[:1000], sb[:1000])
    np.testing.assert_array_equal(db[1000:50_000], sb[2000:51_000])
    for t in (a._t, b._t):
        [cache] = t.device_caches.values()
        assert (cache.misses, cache.hits) == (1, 3)
        [entry] = cache._lru.values()
        region = entry.region
        base = int(src.__array_interface__["data"][0]) if t is a._t else int(
            dst.__array_interface__["data"][0])
        assert region.addr <= base
        assert base + src.nbytes <= region.addr + region.length
        assert region.addr % 4096 == 0
        assert region.length % 4096 == 0
        assert region.iova == 0  # pyverbs' DmaBufMR: iova = offset in the dma-buf
        assert type(region.mr).__name__ == "DmaBufMR"
        assert len(t.cache) == 0  # no host region for device memory
    # every exported descriptor was closed once registered
    assert len(env.driver.exported) == 2
    assert all(_closed(fd) for fd in env.driver.exported)


def _closed(fd: int) -> bool:
    """No dma-buf is open under descriptor ``fd`` (closed, or the number reused)."""
    try:
        return not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fake-dmabuf")
    except OSError:
        return True


async def test_device_entries_die_with_their_memory(env: Env, pair: Pair) -> None:
    a, b = _conns(pair)
    mrs = a._t.device.pd.mrs
    before = len(mrs)
    arr = np.ones(70_000, np.uint8)
    rfut = b.irecv(env.buffer(bytearray(70_000)), 1)
    await within(a.isend(env.buffer(arr), 1, meta_for(1)))
    await within(rfut)
    [cache] = a._t.device_caches.values()
    assert len(cache) == 1
    assert len(mrs) == before + 1
    del arr
    gc.collect()
    cache.collect()
    assert len(cache) == 0
    assert len(mrs) == before


async def test_register_deregister_device_buffer(env: Env, pair: Pair) -> None:
    a, _b = _conns(pair)
    t = a._t
    handle = t.register(env.buffer(np.zeros(5000, np.uint8)))
    [cache] = t.device_caches.values()
    [entry] = cache._lru.values()
    assert entry.users == 1
    t.deregister(handle)
    assert entry.users == 0


async def test_cuda_errors_fail_the_operation_not_the_connection(env: Env,
                                                                 pair: Pair) -> None:
    a, b = _conns(pair)
    env.driver.fail["cuMemGetHandleForAddressRange"] = 999
    with pytest.raises(gdr.GdrError, match="cuMemGetHandleForAddressRange failed"):
        await within(a.isend(env.buffer(payload(100_000, 1)), 1, meta_for(1)))
    foreign = np.zeros(100_000, np.uint8)  # not an allocation of the fake GPU
    from acoll._memory import Buffer

    with pytest.raises(gdr.GdrError, match="cuMemGetAddressRange failed: CUDA_ERROR_NOT_FOUND"):
        await within(a.isend(Buffer(foreign, env.space), 2, meta_for(2)))
    del env.driver.fail["cuMemGetHandleForAddressRange"]
    assert a.failed is None
    assert b.failed is None
    data, out = await _send_recv(env, pair, 100_000, 3)
    assert out == data


# ---------------------------------------------------------------------------- ordering
async def test_send_waits_for_the_producer(env: Env, pair: Pair) -> None:
    """The bytes a kernel queued before the send writes are what the NIC reads: the
    writes wait for the fence of the space's stream."""
    a, b = _conns(pair)
    n = 200_000
    src = np.zeros(n, np.uint8)
    final = np.frombuffer(payload(n, 5), np.uint8)
    env.space.enqueue(lambda: src.__setitem__(slice(None), final))  # the "kernel"
    out = bytearray(n)
    rfut = b.irecv(env.buffer(out), 1)
    sfut = a.isend(env.buffer(src), 1, meta_for(1))
    await within(asyncio.gather(rfut, sfut))
    assert out == final.tobytes()


async def test_receive_advertised_after_queued_work(env: Env, pair: Pair) -> None:
    """A kernel still reading the receive buffer when the receive is posted sees its old
    bytes: the CTS waits for the fence of the space's stream."""
    a, b = _conns(pair)
    n = 200_000
    dst = np.full(n, 7, np.uint8)
    seen: list[bool] = []
    env.space.enqueue(lambda: seen.append(bool((dst == 7).all())))
    rfut = b.irecv(env.buffer(dst), 1)
    sfut = a.isend(env.buffer(payload(n, 6)), 1, meta_for(1))
    await within(asyncio.gather(rfut, sfut))
    assert seen == [True]
    assert dst.tobytes() == bytes(payload(n, 6))


# ---------------------------------------------------------------------------- the flush
@pytest.mark.parametrize(("cc", "env_vars", "flushes"), [
    (8, {}, True), (9, {}, False), (8, {"ACOLL_GDR_FLUSH_DISABLE": "1"}, False),
    (9, {"ACOLL_NET_FORCE_FLUSH": "1"}, True)])
async def test_flush_read_before_completion(cc: int, env_vars: dict[str, str],
                                            flushes: bool, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    for env in _world(tmp_path, cc_major=cc):
        cfg = Config(f"flush-{cc}-{len(env_vars)}")
        p = await connect_pair(TransportHarness(cfg.name, lambda: _make(cfg)))  # noqa: B023
        try:
            a, b = _conns(p)
            fab = fabric_for(cfg)
            for i in range(3):
                data, out = await _send_recv(env, p, 50_000 + i, i)
                assert out == data
            assert b.stats["flushes"] == (3 if flushes else 0)
            assert fab.stats["read"] == (3 if flushes else 0)
            assert a.stats["flushes"] == 0  # only receives into device memory flush
        finally:
            await p.aclose()


async def test_failed_flush_fails_the_receive_and_the_connection(env: Env,
                                                                 pair: Pair) -> None:
    a, b = _conns(pair)
    rec = FailureRecorder()
    b.set_failure_callback(rec)
    await _send_recv(env, pair, 50_000, 1)  # makes the flusher
    flusher = b._t._flusher
    assert flusher is not None
    fabric_for(GDR_IB).fail_qp(flusher._ep.qpn)
    out = bytearray(50_000)
    rfut = b.irecv(env.buffer(out), 2)
    a.isend(env.buffer(payload(50_000, 2)), 2, meta_for(2))
    with pytest.raises(ConnectionLost, match="flushing a receive"):
        await within(rfut)
    await within(rec.event.wait())


# ---------------------------------------------------------------------------- mixed paths
async def test_host_eager_message_into_a_device_receive(env: Env, pair: Pair) -> None:
    """A small host message travels as one eager frame: it lands in a host bounce block
    and is uploaded to the device (posted first, or kept early and uploaded later)."""
    a, b = _conns(pair)
    for i, post_first in enumerate((True, False)):
        out = bytearray(100)
        if post_first:
            rfut = b.irecv(env.buffer(out), i)
            await within(a.isend(host_buffer(payload(100, i)), i, meta_for(i)))
        else:
            await within(a.isend(host_buffer(payload(100, i)), i, meta_for(i)))
            await asyncio.sleep(0.02)
            rfut = b.irecv(env.buffer(out), i)
        assert await within(rfut) == meta_for(i)
        assert out == payload(100, i)
    assert b.stats["uploads"] == 2
    assert env.space.staging().uploads == 2


async def test_device_send_into_host_receive_and_back(env: Env, pair: Pair) -> None:
    a, b = _conns(pair)
    out = bytearray(40_000)
    rfut = b.irecv(host_buffer(out), 1)
    await within(a.isend(env.buffer(payload(40_000, 1)), 1, meta_for(1)))
    await within(rfut)
    assert out == payload(40_000, 1)
    back = bytearray(40_000)
    rfut = a.irecv(env.buffer(back), 2)
    await within(b.isend(host_buffer(payload(40_000, 2)), 2, meta_for(2)))
    await within(rfut)
    assert back == payload(40_000, 2)
    assert a.stats["device_sends"] == 1
    assert a.stats["device_recvs"] == 1


async def test_device_send_pushed_at_close_is_downloaded(env: Env, pair: Pair) -> None:
    a, b = _conns(pair)
    rec = FailureRecorder()
    b.set_failure_callback(rec)
    data = payload(300_000, 4)
    sfut = a.isend(env.buffer(data), 3, meta_for(3))
    await asyncio.sleep(0.02)
    a.close(b"done")
    await within(sfut)
    await within(rec.event.wait())
    out = bytearray(len(data))
    assert await within(b.irecv(env.buffer(out), 3)) == meta_for(3)
    assert out == data
    assert a.stats["pushed"] == 1
    assert env.space.staging().downloads == 1


# ---------------------------------------------------------------------------- communicators
@pytest.mark.parametrize("nranks", [2, 3])
async def test_all_reduce_of_device_buffers_over_gdr(nranks: int, env: Env,
                                                     monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """Fake-device communicators over ``ib``: the transport moves their buffers itself
    (no staged connection), with flushes, and the results are exact."""
    from acoll._transport.staged import StagedConnection
    from fake_device import FakeDevArray

    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_SHM_DISABLE", "1")
    spaces: list[FakeDeviceSpace] = []

    def make_space(device: int) -> FakeDeviceSpace:
        spaces.append(_TrackedSpace(device, env.driver))
        return spaces[-1]

    monkeypatch.setattr(_communicator, "device_space", make_space)
    loop = asyncio.get_running_loop()
    fab = attach(Fabric(schedule=lambda delay, fn: loop.call_later(delay, fn)), env.driver)
    fab.add_device("ib0")
    count = 100_003

    async def fn(comm: acoll.Communicator) -> np.ndarray[Any, Any]:
        x = np.arange(count, dtype=np.float32) * (comm.rank + 1)
        dev = FakeDevArray(x)
        await comm.all_reduce(dev)
        for p in range(comm.size):
            if p != comm.rank:
                conn = await comm.connection(p)
                assert not isinstance(conn, StagedConnection)
        return x

    try:
        with provided(fab.lib):
            results = await asyncio.wait_for(run_ranks(nranks, fn, net="ib", device=0), 60)
    finally:
        fab.close()
    scale = nranks * (nranks + 1) // 2
    for x in results:
        np.testing.assert_array_equal(x, np.arange(count, dtype=np.float32) * scale)
    assert fab.stats["write"] > 0  # GPUDirect writes
    assert fab.stats["read"] > 0  # and flushes
    assert all(s.staging().downloads == 0 for s in spaces)  # nothing staged


class _TrackedSpace(FakeDeviceSpace):
    """A fake device whose every allocation (users', scratch, fresh) the fake driver
    knows, as every CUDA allocation is the real driver's."""

    def __init__(self, device: int, driver: FakeCudaDriver) -> None:
        super().__init__(device)
        self._driver = driver

    def _tracked(self, buf: Any) -> Any:
        root = buf.array
        while isinstance(root.base, np.ndarray):
            root = root.base
        self._driver.track(root)
        return buf

    def adopt(self, obj: Any, what: str, *, writable: bool = False) -> Any:
        return self._tracked(super().adopt(obj, what, writable=writable))

    def empty(self, count: int, dtype: Any) -> Any:
        return self._tracked(super().empty(count, dtype))

    def scratch(self, count: int, dtype: Any, slot: int = 0) -> Any:
        return self._tracked(super().scratch(count, dtype, slot))


def test_transport_error_tree() -> None:
    assert issubclass(gdr.GdrError, TransportError)
