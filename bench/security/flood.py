"""A local stranger floods a rank's listeners with connections that never authenticate.

Four ranks run in this process; a second process (the stranger, no secret) keeps up to HOLD
connections open against rank 2's bootstrap and/or data listener and keeps opening new ones
for SECONDS. Meanwhile the ranks run an all_to_all (new data connections) and a split (new
bootstrap connections). Prints the victim's RSS (MiB) and open descriptors before, during
and after, and how long the work took. Loopback only.

Usage: python bench/security/flood.py [boot|data|both] [HOLD] [SECONDS]
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import time

import msgpack
import numpy as np

os.environ.setdefault("ACOLL_SOCKET_IFNAME", "=lo")
import acoll  # after the interface setting

_STRANGER = """
import collections, socket, sys, time
ports = [int(p) for p in sys.argv[1].split(",")]
end, hold = time.time() + float(sys.argv[2]), int(sys.argv[3])
held, opened = collections.deque(), 0
while time.time() < end:
    for port in ports:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        held.append(s)
        opened += 1
        while len(held) > hold:
            held.popleft().close()
for s in held:
    s.close()
print(f"stranger: {opened} connections opened", flush=True)
"""


def _usage() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return rss // 1024, len(os.listdir("/proc/self/fd"))


async def main(which: str, hold: int, seconds: float) -> None:
    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(4, uid, r, timeout=30) for r in range(4)))
    victim = comms[2]
    data_port = msgpack.unpackb(victim._listener.handle)[1]
    boot_port = victim._boot.addr[1]
    ports = {"data": [data_port], "boot": [boot_port], "both": [data_port, boot_port]}[which]
    print(f"victim rank 2, RSS MiB / fds before: {_usage()}", flush=True)

    def lift() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))

    stranger = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        [sys.executable, "-c", _STRANGER, ",".join(map(str, ports)), str(seconds), str(hold)],
        preexec_fn=lift)
    await asyncio.sleep(1.0)
    print(f"during the flood: {_usage()}", flush=True)
    start = time.monotonic()

    async def work(comm: acoll.Communicator) -> str:
        try:
            n = comm.size
            await comm.all_to_all(np.ones(4 * n, np.float32), np.empty(4 * n, np.float32))
            sub = await comm.split(0)
            assert sub is not None
            await sub.all_reduce(np.ones(4, np.float32))
            await sub.close()
            return "ok"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    results = await asyncio.gather(*(work(c) for c in comms))
    print(f"all_to_all + split under the flood: {time.monotonic() - start:.2f} s, {results}",
          flush=True)
    stranger.wait(timeout=seconds + 10)
    await asyncio.sleep(0.5)
    print(f"after the flood: {_usage()}", flush=True)
    for comm in comms:
        comm.abort()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0] if args else "boot", int(args[1]) if len(args) > 1 else 3000,
                     float(args[2]) if len(args) > 2 else 8.0))
