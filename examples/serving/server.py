"""A service that answers HTTP while its rank all-reduces 64 MiB buffers on the same loop.

Run two ranks, then ask either one for its health::

    acoll-run -n 2 -- python examples/serving/server.py
    curl http://127.0.0.1:8000/health      # rank 0 (rank r listens on 8000 + r)

Each rank runs one event loop with three things in it:

- an HTTP server (plain ``asyncio.start_server``) answering ``GET /health`` with how many
  all_reduces this rank has done and how late its loop has been lately;
- a background task doing back-to-back all_reduces of a 64 MiB float32 buffer, as a
  training or model-sync job would;
- a ticker that wakes every millisecond and records how late it woke (the loop's lag).

acoll never holds the loop for long (about a millisecond per step, whatever the message
size), so requests are answered in a few milliseconds even while 64 MiB all_reduces run.
Stop with Ctrl-C (``acoll-run`` passes it on); ``--seconds N`` stops on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

import numpy as np

import acoll


class Stats:
    """What the health endpoint reports."""

    def __init__(self) -> None:
        self.all_reduces = 0
        self.lags: list[float] = []  # the ticker's recent lags, in seconds

    def snapshot(self, rank: int) -> dict[str, object]:
        recent = sorted(self.lags[-1000:]) or [0.0]
        return {"rank": rank, "all_reduces": self.all_reduces,
                "loop_lag_ms": {"p50": round(recent[len(recent) // 2] * 1e3, 2),
                                "p99": round(recent[int(len(recent) * 0.99)] * 1e3, 2),
                                "max": round(recent[-1] * 1e3, 2)}}


async def serve_health(stats: Stats, rank: int, port: int) -> asyncio.Server:
    """Answer every HTTP/1.1 request with the rank's stats (keep-alive)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")  # request line and headers
                body = json.dumps(stats.snapshot(rank)).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def tick(stats: Stats) -> None:
    """Sleep 1 ms at a time; record how late each wake-up was."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        stats.lags.append(max(time.perf_counter() - t - 0.001, 0.0))
        del stats.lags[:-10_000]


async def reduce_forever(comm: acoll.Communicator, stats: Stats, nbytes: int,
                         until: float) -> None:
    """All-reduce ``nbytes`` back to back until ``until`` (every rank agrees when to stop)."""
    x = np.ones(nbytes // 4, np.float32)
    done = np.zeros(1, np.int32)
    while True:
        await comm.all_reduce(x)
        stats.all_reduces += 1
        done[0] = time.monotonic() >= until
        await comm.all_reduce(done, op="max")  # stop together: same op count everywhere
        if done[0]:
            return


async def main() -> None:
    ap = argparse.ArgumentParser(description="HTTP health server next to all_reduces")
    ap.add_argument("--port", type=int, default=8000, help="rank r listens on port + r")
    ap.add_argument("--mib", type=int, default=64, help="all_reduce size in MiB")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="then stop")
    args = ap.parse_args()

    stats = Stats()
    async with await acoll.init_from_env() as comm:
        server = await serve_health(stats, comm.rank, args.port + comm.rank)
        ticker = asyncio.ensure_future(tick(stats))
        print(f"rank {comm.rank}: http://127.0.0.1:{args.port + comm.rank}/health", flush=True)
        try:
            await reduce_forever(comm, stats, args.mib << 20,
                                 time.monotonic() + args.seconds)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            server.close()
        print(json.dumps(stats.snapshot(comm.rank)), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
