"""A rank that dies (``os._exit``), stops itself with SIGSTOP, or stops calling (its
event loop still running) while the others run all_reduces; the others report how their
collectives failed, naming the blamed rank.

Usage: mp_kill.py RANK NRANKS [VICTIM] [kill|stop|skip]
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

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


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(asyncio.run(main(int(args[0]), int(args[1]),
                              int(args[2]) if len(args) > 2 else 2,
                              args[3] if len(args) > 3 else "kill")))
