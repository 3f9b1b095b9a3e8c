"""Does a stream of large all_reduces stall a server sharing the rank's event loop?

    python bench/serving.py [--size 64M] [--seconds 10] [--burners 2] [--loop uvloop]

Every rank process runs, in one event loop: an HTTP server (plain asyncio streams)
answering ``GET /health``, a ticker task that sleeps 1 ms and records how late it wakes
(the loop's lag), and - in the ``acoll`` scenario - back-to-back all_reduces of ``--size``
bytes (float32 sum). A client in its own process sends one request at a time (then
sleeps 2 ms) to rank 0's server over a kept-alive connection and records each request's
latency. Scenarios:

- ``idle``: one server process, nothing else running;
- ``acoll``: two rank processes (rank 0 serves the client; both serve, tick and reduce);
- ``burner``: one server process next to ``--burners`` processes that burn CPU in
  NumPy and Python, instead of acoll (``--burners 2``: like the two busy ranks).

Prints a table and writes it to ``--out`` (``bench/results/serving.txt``) with the date,
machine, load average before and after, and the command. Needs only acoll (and uvloop
for ``--loop uvloop``). Internal sub-commands (``rank``, ``client``, ``burn``) are how the
scenarios start their processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TICK = 0.001  # the ticker's sleep
CLIENT_GAP = 0.002  # the client's pause between requests
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----------------------------------------------------------------------------- rank
async def _health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A minimal HTTP/1.1 keep-alive server: every request gets ``200 ok``."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if not head:
                break
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _ticker(lags: list[float], cpus: list[float], stop: asyncio.Event) -> None:
    # perf_counter, not loop.time(): uvloop's clock has millisecond resolution. A timer
    # may fire up to one millisecond early or late by the loop's own rounding, so lags
    # below 1 ms are noise. ``cpus``: CPU time the loop's thread used between two ticks;
    # a lag much larger than it was spent waiting for a CPU (preempted), not running.
    while not stop.is_set():
        t, c = time.perf_counter(), time.thread_time()
        await asyncio.sleep(TICK)
        lags.append(max(time.perf_counter() - t - TICK, 0.0))
        cpus.append(time.thread_time() - c)


async def _rank_main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # any line (or EOF) on stdin: stop
    server = await asyncio.start_server(_health, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lags: list[float] = []
    cpus: list[float] = []
    ops = 0
    comm = None
    if args.collectives:
        import acoll

        comm = await acoll.init_from_env()
        x = np.ones(args.size // 4, np.float32)
        flag = np.zeros(1, np.int32)
        for _ in range(2):  # warm-up: scratch buffers allocated and touched
            await comm.all_reduce(x)
    print(f"READY {port}", flush=True)
    ticker = asyncio.ensure_future(_ticker(lags, cpus, stop))
    t0 = time.perf_counter()
    if comm is not None:
        while True:
            await comm.all_reduce(x)
            ops += 1
            flag[0] = stop.is_set()  # ranks agree on when to stop
            await comm.all_reduce(flag, op="max")
            if flag[0]:
                stop.set()
                break
    await stop.wait()
    wall = time.perf_counter() - t0
    await ticker
    if comm is not None:
        await comm.close()
    server.close()
    print(json.dumps({"lags": lags, "cpus": cpus, "ops": ops, "wall": wall}), flush=True)


# ----------------------------------------------------------------------------- client
def _client_main(args: argparse.Namespace) -> None:
    sock = socket.create_connection(("127.0.0.1", args.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    times: list[float] = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        sock.sendall(request)
        got = b""
        while not got.endswith(b"ok"):
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("server closed the connection")
            got += chunk
        times.append(time.perf_counter() - t)
        time.sleep(CLIENT_GAP)
    sock.close()
    print(json.dumps({"times": times}), flush=True)


def _burn_main(_args: argparse.Namespace) -> None:
    a = np.ones(1 << 16, np.float32)
    while True:  # killed by the orchestrator
        for _ in range(200):
            a += 1.0
        sum(range(20_000))


# ----------------------------------------------------------------------------- driver
def _spawn(role: list[str], args: argparse.Namespace, env: dict[str, str] | None = None,
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *role, "--loop", args.loop,
           "--size", str(args.size)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _ready(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"process failed to start: {line!r}")
    return int(line.split()[1])


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate("stop\n", timeout=300)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ranks: list[subprocess.Popen[str]] = []
    burners: list[subprocess.Popen[str]] = []
    try:
        if name == "acoll":
            env = {"ACOLL_COMM_ID": f"127.0.0.1:{_free_port()}", "ACOLL_WORLD_SIZE": "2",
                   "ACOLL_SOCKET_IFNAME": "=lo"}
            ranks = [_spawn(["rank", "--collectives"], args,
                            {**env, "ACOLL_RANK": str(r), "ACOLL_LOCAL_RANK": str(r),
                             "ACOLL_LOCAL_SIZE": "2"}) for r in range(2)]
        else:
            ranks = [_spawn(["rank"], args)]
        ports = [_ready(p) for p in ranks]
        if name == "burner":
            burners = [_spawn(["burn"], args) for _ in range(args.burners)]
            time.sleep(0.5)
        client = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "client", "--port", str(ports[0]),
             "--seconds", str(args.seconds)], capture_output=True, text=True, check=True)
        times = json.loads(client.stdout.strip().splitlines()[-1])["times"]
        results = [_finish(p) for p in ranks]
    finally:
        for p in burners + ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
    lags, cpus = results[0]["lags"], results[0]["cpus"]
    ops, wall = results[0]["ops"], results[0]["wall"]
    busbw = ops * args.size / wall / 1e9 if ops else float("nan")  # 2 ranks: factor 1
    return {"name": name, "n": len(times),
            "p50": _pct(times, 0.5) * 1e3, "p99": _pct(times, 0.99) * 1e3,
            "max": max(times) * 1e3,
            "lag_p50": _pct(lags, 0.5) * 1e3, "lag_p99": _pct(lags, 0.99) * 1e3,
            "lag_max": max(lags) * 1e3 if lags else float("nan"),
            "lag_mean": statistics.fmean(lags) * 1e3 if lags else float("nan"),
            "cpu_p99": _pct(cpus, 0.99) * 1e3,
            "cpu_max": max(cpus) * 1e3 if cpus else float("nan"),
            "ops_s": ops / wall if ops else 0.0, "busbw": busbw}


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    size = f"{args.size >> 20} MiB" if args.size >= 1 << 20 else f"{args.size} B"
    lines = [
        f"| scenario | requests | server p50 (ms) | p99 (ms) | max (ms) | loop lag p99 (ms) | "
        f"lag max (ms) | tick CPU p99 (ms) | tick CPU max (ms) | all_reduce {size}/s | "
        f"busbw (GB/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['ops_s']:.1f} | {r['busbw']:.2f}" if r["ops_s"] else "- | -")
        lines.append(f"| {r['name']} | {r['n']} | {r['p50']:.2f} | {r['p99']:.2f} | "
                     f"{r['max']:.1f} | {r['lag_p99']:.2f} | {r['lag_max']:.1f} | "
                     f"{r['cpu_p99']:.2f} | {r['cpu_max']:.1f} | {extra} |")
    return "\n".join(lines)


def _drive(args: argparse.Namespace) -> None:
    import acoll

    load0 = os.getloadavg()
    rows = [_scenario(name, args) for name in args.scenarios]
    load1 = os.getloadavg()
    head = (f"# acoll {acoll.__version__} serving benchmark, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}\n"
            f"# machine: {platform.node()}, {os.cpu_count()} cpus (nproc), "
            f"{platform.python_implementation()} {platform.python_version()}, loop {args.loop}\n"
            f"# load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after "
            f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}\n"
            f"# command: {' '.join(['python', *sys.argv])}\n"
            f"# client: one request at a time to rank 0, {CLIENT_GAP * 1e3:g} ms apart, "
            f"{args.seconds} s; ticker (rank 0): sleeps {TICK * 1e3:g} ms, lag = lateness, "
            f"tick CPU = CPU time of the loop's thread between two ticks (lag well above it "
            f"= waiting for a CPU); burner scenario: {args.burners} CPU-burning processes\n")
    text = head + _table(rows, args) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="drive",
                    choices=["drive", "rank", "client", "burn"])
    ap.add_argument("--size", type=_parse_size, default=64 << 20)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--scenarios", nargs="+", default=["idle", "acoll", "burner"],
                    choices=["idle", "acoll", "burner"])
    ap.add_argument("--out", default=str(HERE / "results" / "serving.txt"))
    ap.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "client":
        _client_main(args)
    elif args.role == "burn":
        with contextlib.suppress(KeyboardInterrupt):
            _burn_main(args)
    elif args.role == "rank":
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(_rank_main(args))
        else:
            asyncio.run(_rank_main(args))
    else:
        _drive(args)


if __name__ == "__main__":
    main()
