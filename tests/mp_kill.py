"""A rank that dies (``os._exit``), dies by SIGKILL after forking a child that outlives
it (``forkkill``: the child holds copies of every descriptor for MP_CHILD_LIFE seconds),
stops itself with SIGSTOP, or stops calling (its event loop still running) while the
others run all_reduces; the others report how their collectives failed, naming the
blamed rank.

Usage: mp_kill.py RANK NRANKS [VICTIM] [kill|forkkill|stop|skip]
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time

import numpy as np

import acoll


async def main(rank: int, n: int, victim: int, how: str) -> int:
    uid = acoll.get_unique_id()  # ACOLL_COMM_ID is set: rank 0 hosts the root
    # (formed with a long deadline: 4 to 6 interpreters starting on a slow machine; the
    # collectives then run with MP_KILL_TIMEOUT, and a grace of 2 s for the probes' answers
    # and the blocked ranks' reports, which on one shared CPU need more than 0.5 s)
    comm = await acoll.init_rank(n, uid, rank, timeout=60)
    comm.timeout = float(os.environ["MP_KILL_TIMEOUT"])
    if comm.timeout < 10:
        from acoll._comm.executor import Executor
        Executor._grace = lambda self: 2.0  # type: ignore[method-assign]
    x = np.ones(1 << 18, np.float32)
    for i in range(1000):
        if rank == victim and i == 3:
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif how == "forkkill":
                _print_unheld_sockets()
                _fork_a_lingering_child()
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "skip":
                await asyncio.sleep(60)  # (the test kills it once the others reported)
            else:
                os._exit(9)
        try:
            await comm.all_reduce(x)
        except (acoll.RemoteError, acoll.TimeoutError) as exc:
            print(f"{type(exc).__name__} on rank {rank} at iteration {i}: {exc} "
                  f"(rank={exc.rank})")
            comm.abort()  # as error handlers do: must not make peers blame this rank
            return 0
    print("never failed")
    return 1


def _print_unheld_sockets() -> None:
    """Print the sockets of this process (but the loop's wake-up pair) that a forked
    child would keep: none, if every socket acoll opens is held."""
    from acoll import _forkguard

    loop = asyncio.get_running_loop()
    wakeup = {s.fileno() for s in (getattr(loop, "_ssock", None),
                                   getattr(loop, "_csock", None)) if s is not None}
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.append(int(name))
        except OSError:
            continue
    held = set(_forkguard.held_in_child())
    print(f"unheld sockets: {sorted(set(fds) - held - wakeup)}", flush=True)


def _fork_a_lingering_child() -> None:
    """Fork a child that sleeps, holding what it inherited, and print its pid (the test
    kills it once the survivors reported)."""
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)  # (not the test's pipe: its reader waits for every writer)
        os.dup2(null, 2)
        time.sleep(float(os.environ.get("MP_CHILD_LIFE", "30")))
        os._exit(0)
    print(f"child pid {pid}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(asyncio.run(main(int(args[0]), int(args[1]),
                              int(args[2]) if len(args) > 2 else 2,
                              args[3] if len(args) > 3 else "kill")))
