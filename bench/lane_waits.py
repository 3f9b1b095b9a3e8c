"""Time per lane all_reduce and the time its waits take, per rank, under acoll-run:
BIND=core pins rank k to CPU k, BIND=same puts every rank on CPU 0 (ranks sharing a core).
BIND=same python -m acoll.run -n 2 -- python bench/lane_waits.py 4   (MiB; K=ops)   (session 25)
Sizes may also be given with a unit and several at once (``1M 2M 512K``; session 39).
REG=1: the buffer is an ``acoll.empty_shared`` array, registered (the zero-copy path)."""
import asyncio, os, sys, time, collections
import numpy as np
import acoll
from acoll._comm import lane as L
from acoll._config import parse_size

stats = collections.defaultdict(lambda: [0, 0.0])
def wrap(cls, name):
    f = getattr(cls, name)
    async def g(*a, **k):
        t = time.perf_counter()
        try:
            return await f(*a, **k)
        finally:
            s = stats[name]; s[0] += 1; s[1] += time.perf_counter() - t
    setattr(cls, name, g)
for n in ("_wait", "_wait_free", "_wait_board", "_turn"):
    wrap(L._LaneCall, n)
for n in ("_records", "_phase", "_copy", "_combine"):
    wrap(L._ZeroCopy, n)
def wrap_sync(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            s = stats[name]; s[0] += 1; s[1] += time.perf_counter() - t
    setattr(cls, name, g)
for n in ("_folder", "_copier"):  # (they make the take() of a step; timed: the making)
    wrap_sync(L.StepPlan, n)
for n in ("_receive",):
    wrap(L.StepPlan, n)
orig_poll = L._LaneCall._poll
async def poll(self, seq, done, spin, *a):
    t = time.perf_counter()
    try:
        return await orig_poll(self, seq, done, spin, *a)
    finally:
        dt = time.perf_counter() - t
        s = stats["poll_spin%d" % (spin > 0)]; s[0] += 1; s[1] += dt
        if dt > 1e-4: stats["poll>100us"][0] += 1
L._LaneCall._poll = poll

async def main():
    comm = await acoll.init_from_env()
    b=os.environ.get('BIND')
    if b: os.sched_setaffinity(0, {comm.rank % os.cpu_count()} if b=='core' else {0})
    for arg in sys.argv[1:]:
        nbytes = parse_size(arg) if not arg.isdigit() else int(arg) << 20
        n = nbytes // 4
        if os.environ.get('REG') == '1':
            x = acoll.empty_shared(n, np.float32); x[:] = 0
            reg = await comm.register(x)
        else:
            x, reg = np.zeros(n, np.float32), None
        for _ in range(10): await comm.all_reduce(x)
        await comm.barrier()
        stats.clear()
        k = int(os.environ.get('K','50'))
        t = time.perf_counter()
        for _ in range(k): await comm.all_reduce(x)
        dt = (time.perf_counter() - t) / k
        print(arg, comm.rank, "per op %.1f us" % (dt * 1e6), {n: (c, round(s / k * 1e6, 1)) for n, (c, s) in sorted(stats.items())}, flush=True)
        if reg is not None:
            await comm.deregister(reg)
        await comm.barrier()
    await comm.close()
asyncio.run(main())
