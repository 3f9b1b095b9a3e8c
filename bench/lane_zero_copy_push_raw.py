"""Session 28 probe: the zero-copy all_reduce between 2 pinned processes with nothing
else (spin flags, no asyncio), phase 2 by reading the peer's part (3 waits, as acoll) or by the owner pushing its part into
the peer's buffer (2 waits). python bench/lane_zero_copy_push_raw.py MIB read|push [touch]
(touch: each rank writes its whole buffer before every op and reads all of it after, as a
program would; without it the pushed lines sit in the pusher's cache and the numbers flatter
pushing)."""
import mmap, os, sys, time
import numpy as np
N = int(float(sys.argv[1]) * (1 << 20)) // 4
MODE = sys.argv[2]
TOUCH = len(sys.argv) > 3
ITERS = 400
shm = mmap.mmap(-1, 4096 + 2 * N * 4)
flags = np.frombuffer(shm, np.int64, 512, 0)
bufs = [np.frombuffer(shm, np.float32, N, 4096 + k * N * 4) for k in (0, 1)]
pid = os.fork()
r = 0 if pid else 1
os.sched_setaffinity(0, {r})
mine, peer = bufs[r], bufs[1 - r]
mine[:] = 0
seq = 0
H = N // 2
parts = [(0, H), (H, N)]
def wait(v):
    while flags[(1 - r) * 64] < v: pass
def run_op():
    global seq
    seq += 1
    base = seq * 4
    flags[r * 64] = base
    wait(base)
    a, b = parts[r]
    np.add(mine[a:b], peer[a:b], out=mine[a:b])
    if MODE == "read":
        flags[r * 64] = base + 1; wait(base + 1)
        pa, pb = parts[1 - r]
        mine[pa:pb] = peer[pa:pb]
        flags[r * 64] = base + 2; wait(base + 2)
    else:
        peer[a:b] = mine[a:b]
        flags[r * 64] = base + 2; wait(base + 2)
def run():
    if TOUCH:
        mine[:] = 1.0
    run_op()
    if TOUCH:
        float(mine.sum())
for _ in range(30): run()
t = time.perf_counter()
for _ in range(ITERS): run()
dt = (time.perf_counter() - t) / ITERS
if r == 0:
    os.waitpid(pid, 0)
    print(f"{sys.argv[1]} MiB {MODE}: {dt*1e6:.1f} us/op")
