"""In-process transport vs TCP loopback, both ends in one event loop (uvloop).

For each size: round trips (a -> b -> a) with the receive posted first, and with the
receive posted after the send (early: eager copy or rendezvous); time per one-way message,
bandwidth, and the longest loop iteration seen meanwhile (a ticker task measures the
thread CPU time between its resumptions). Each message ends with ``sleep(0)``: in process,
a posted receive may complete inside ``isend``, so a sender that never yields would keep
the loop to itself (as any code awaiting only finished futures does).

Usage: PYTHONPATH=src python bench/inproc.py
"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import uvloop

from acoll._memory import host_buffer
from acoll._transport.base import Connection, Transport
from acoll._transport.inproc import InprocTransport
from acoll._transport.tcp import TcpTransport

KEY = bytes(range(32))
SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


async def _pair(t: Transport) -> tuple[Connection, Connection]:
    listener = await t.listen()
    accept = asyncio.ensure_future(listener.accept())
    a = await t.connect(listener.handle, b"", asyncio.get_running_loop().time() + 10)
    _hello, b = await accept
    listener.close()
    return a, b


async def _ticker(stop: asyncio.Event, worst: list[int]) -> None:
    last = time.thread_time_ns()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.thread_time_ns()
        worst[0] = max(worst[0], now - last)
        last = now


async def _run(name: str, t: Transport) -> None:
    a, b = await _pair(t)
    for size in SIZES:
        x = np.ones(size, np.uint8)
        y = np.zeros(size, np.uint8)
        xb, yb = host_buffer(x), host_buffer(y)
        iters = max(3, min(2000, (256 << 20) // max(size, 1) // 4))
        for early in (False, True):
            async def one(src: Connection, dst: Connection, sb: object, db: object,
                          tag: int) -> None:
                if early:
                    s = src.isend(sb, tag, bytes(16))  # type: ignore[arg-type]
                    await asyncio.sleep(0)
                    r = dst.irecv(db, tag)  # type: ignore[arg-type]
                else:
                    r = dst.irecv(db, tag)  # type: ignore[arg-type]
                    s = src.isend(sb, tag, bytes(16))  # type: ignore[arg-type]
                await r
                await s
                await asyncio.sleep(0)  # completions may all be synchronous: let others run

            for i in range(2):  # warm-up (pages faulted in)
                await one(a, b, xb, yb, i)
                await one(b, a, yb, xb, i)
            stop, worst = asyncio.Event(), [0]
            tick = asyncio.ensure_future(_ticker(stop, worst))
            await asyncio.sleep(0)
            worst[0] = 0
            t0 = time.perf_counter()
            for i in range(iters):
                await one(a, b, xb, yb, i)
                await one(b, a, yb, xb, i)
            dt = (time.perf_counter() - t0) / (2 * iters)
            stop.set()
            await tick
            print(f"{name:7} {size:>9} {'early ' if early else 'posted'} {dt * 1e6:10.1f} us"
                  f" {size / dt / 1e9:7.2f} GB/s   longest loop iteration "
                  f"{worst[0] / 1e3:8.1f} us", flush=True)
    a.abort()
    b.abort()


async def main() -> None:
    await _run("inproc", InprocTransport(key=KEY))
    await _run("tcp", TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY, nsocks=1))


if __name__ == "__main__":
    uvloop.run(main())
