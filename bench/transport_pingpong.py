"""One-way latency of a transport between two processes, below the collectives.

    python bench/transport_pingpong.py shm|socket [N] [SIZE]

A forked child connects to the parent's listener; they exchange N messages of SIZE bytes
back and forth, each waiting the way the communicator does for a small op (``poll()``,
then busy-poll up to 25 us, then sleep in the loop). Prints half the round-trip time and
the CPU time per round trip of the parent.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time

from acoll._memory import host_buffer
from acoll._transport.base import Connection, Transport
from acoll._transport.shm import ShmTransport
from acoll._transport.tcp import TcpTransport

KEY = bytes(range(32))


def make(kind: str) -> Transport:
    if kind == "shm":
        return ShmTransport(key=KEY)
    return TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=KEY)


async def wait(conn: Connection, fut: asyncio.Future[bytes], spin_ns: int = 25_000) -> bytes:
    if not fut.done():
        conn.poll()
        end = time.perf_counter_ns() + spin_ns
        while not fut.done() and time.perf_counter_ns() < end:
            conn.poll()
    return await fut


async def pingpong(conn: Connection, first: bool, n: int, size: int) -> tuple[float, float]:
    out, into = host_buffer(bytearray(size)), host_buffer(bytearray(size))
    meta = bytes(16)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        tag = i & 0xFFFF
        if first:
            conn.isend(out, tag, meta)
            await wait(conn, conn.irecv(into, tag))
        else:
            await wait(conn, conn.irecv(into, tag))
            conn.isend(out, tag, meta)
    return time.perf_counter() - t0, time.process_time() - c0


def _publish(path: str, handle: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(handle)
    os.rename(path + ".tmp", path)


def _published(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


async def parent(kind: str, n: int, size: int, path: str) -> None:
    lis = await make(kind).listen()
    _publish(path, lis.handle)
    _, conn = await lis.accept()
    wall, cpu = await pingpong(conn, True, n, size)
    print(f"{kind} {size} B: {wall / n / 2 * 1e6:.1f} us one way, "
          f"{cpu / n * 1e6:.1f} us of CPU per round trip")
    await asyncio.sleep(0.1)
    conn.abort()
    lis.close()


async def child(kind: str, n: int, size: int, path: str) -> None:
    while (handle := _published(path)) is None:
        await asyncio.sleep(0.01)
    conn = await make(kind).connect(handle, b"", asyncio.get_running_loop().time() + 10)
    await pingpong(conn, False, n, size)
    await asyncio.sleep(0.05)
    conn.abort()


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "shm"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "handle")
        pid = os.fork()
        if pid:
            run(parent(kind, n, size, path))
            os.waitpid(pid, 0)
        else:
            run(child(kind, n, size, path))
            os._exit(0)


if __name__ == "__main__":
    main()
