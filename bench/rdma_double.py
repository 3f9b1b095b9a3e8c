"""The RDMA transport's own cost, over the verbs TEST DOUBLE (not hardware), vs TCP loopback.

No RDMA device exists here, so this measures what the transport's Python code costs per
message and per byte, with the "hardware" doing its work instantly (``immediate``: work
requests run inside ``post_send``; the copies are ``memmove``) or one loop iteration later
(``deferred``). Round trips a -> b -> a with the receive posted first; time per one-way
message and the bandwidth it implies. On real hardware add the wire time; the double's
figures are an upper bound for what the transport alone allows.

Usage: PYTHONPATH=src python bench/rdma_double.py
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from acoll._memory import host_buffer
from acoll._transport.base import Connection, Transport
from acoll._transport.rdma import RdmaTransport, rdma_ports
from acoll._transport.tcp import TcpTransport
from verbs_double import Fabric

KEY = bytes(range(32))
SIZES = [8, 4096, 64 << 10, 1 << 20, 16 << 20]


async def _pair(t: Transport) -> tuple[Connection, Connection]:
    listener = await t.listen()
    accept = asyncio.ensure_future(listener.accept())
    a = await t.connect(listener.handle, b"", asyncio.get_running_loop().time() + 10)
    _hello, b = await accept
    listener.close()
    return a, b


async def _run(name: str, t: Transport) -> None:
    a, b = await _pair(t)
    for size in SIZES:
        x, y = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        xb, yb = host_buffer(x), host_buffer(y)
        iters = max(5, min(2000, (256 << 20) // max(size, 1) // 8))

        async def one(src: Connection, dst: Connection, sb: object, db: object,
                      tag: int) -> None:
            r = dst.irecv(db, tag)  # type: ignore[arg-type]
            s = src.isend(sb, tag, bytes(16))  # type: ignore[arg-type]
            await r
            await s

        for i in range(3):
            await one(a, b, xb, yb, i)
            await one(b, a, yb, xb, i)
        t0 = time.perf_counter()
        for i in range(iters):
            await one(a, b, xb, yb, i)
            await one(b, a, yb, xb, i)
        dt = (time.perf_counter() - t0) / (2 * iters)
        print(f"{name:14} {size:>9} {dt * 1e6:10.1f} us {size / dt / 1e9:7.2f} GB/s",
              flush=True)
    a.abort()
    b.abort()


async def main() -> None:
    loop = asyncio.get_running_loop()
    for mode in ("immediate", "deferred"):
        fab = Fabric(schedule=(lambda d, fn: loop.call_later(d, fn)) if mode == "deferred"
                     else None)
        fab.add_device("ib0")
        [(port, gid)], _why = rdma_ports("", fab.lib)
        t = RdmaTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, port=port, gid=gid,
                          lib=fab.lib)
        await _run(f"ib/{mode}", t)
        t.close()
        fab.close()
    await _run("tcp", TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=1))


if __name__ == "__main__":
    uvloop.run(main())
