"""RdmaTransport over the verbs test double: the shared conformance battery (InfiniBand
with work executed later from the event loop; RoCE with work executed at once and small
eager size, queue depth and chunks), then RDMA specifics: credits, chunking, the
registration cache, failures (queue-pair errors, asynchronous events, peer death), the
busy-poll path, and all-reduce at communicator level over the double.

The double is not hardware (see ``verbs_double``); ``tests/test_rdma_hw.py`` runs the
same battery on a real device (``make test-rdma``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import pytest

from acoll._transport.base import ConnectionLost
from acoll._transport.tcp import TcpTransport
from rdma_double import KEY, OTHER_KEY, Config, cleanup, make_transport
from transport_conformance import (
    GarbageCase,
    TransportConformance,
    TransportHarness,
)

IB = Config("ib-deferred")
ROCE = Config("roce-small", roce=True, deferred=False, eager=1024, depth=8, chunk=64 << 10)


@pytest.fixture(autouse=True)
async def _fabric_cleanup() -> AsyncIterator[None]:
    yield
    cleanup()


async def _refused_raw(handle: bytes) -> None:
    """Junk on the control port: the TCP listener under it turns it away."""
    _v, _layer, tcp_handle = msgpack.unpackb(handle)
    host, port, _scope = msgpack.unpackb(tcp_handle)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        while await reader.read(4096):
            pass
    except ConnectionError:
        pass
    finally:
        writer.close()


def _bad_setup(body: bytes) -> GarbageCase:
    """An insider (holding the key) that completes the TCP handshake, then sends a bad
    set-up record: the listener refuses it and keeps working."""

    async def attack(handle: bytes) -> None:
        _v, _layer, tcp_handle = msgpack.unpackb(handle)
        loop = asyncio.get_running_loop()
        tcp = TcpTransport(("127.0.0.1", 0), __import__("socket").AF_INET, key=KEY)
        conn = await tcp.connect(tcp_handle, b"evil", loop.time() + 5)
        from acoll._memory import host_buffer

        try:
            frame = len(body).to_bytes(2, "little") + body
            frame += bytes(256 - len(frame))
            await conn.send(host_buffer(frame), 1)
            # the listener aborts the control connection instead of reporting RTS
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(conn.recv(host_buffer(bytearray(1)), 2), 5)
        finally:
            conn.abort()

    return attack


GARBAGE: dict[str, GarbageCase] = {
    "raw-junk": _refused_raw,
    "setup-not-msgpack": _bad_setup(b"\xc1\xc1"),
    "setup-missing-fields": _bad_setup(msgpack.packb({"qp": b"x"})),
    "setup-bad-qp": _bad_setup(msgpack.packb({"qp": msgpack.packb({"v": 1}), "eager": 1,
                                              "depth": 8})),
    "setup-depth-out-of-range": _bad_setup(msgpack.packb({"qp": b"", "eager": 1,
                                                          "depth": 1})),
}


def _harness(config: Config) -> TransportHarness:
    eager = config.eager if config.eager is not None else 16 << 10
    return TransportHarness(config.name, lambda: make_transport(config), GARBAGE,
                            stranger=lambda: make_transport(config, key=OTHER_KEY),
                            rendezvous=eager)


HARNESSES = [_harness(IB), _harness(ROCE)]


@pytest.fixture(params=HARNESSES, ids=str)
def harness(request: pytest.FixtureRequest) -> TransportHarness:
    return request.param  # type: ignore[no-any-return]


class TestRdmaConformance(TransportConformance):
    """The shared battery, over the verbs test double."""
