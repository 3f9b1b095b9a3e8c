"""The ceiling of a zero-copy all_reduce between 2 processes on this host: each rank's
buffer lies in shared memory the peer maps; rank r reduces half r reading the peer's buffer
in place, then copies the peer's reduced half from it (spin flags, no asyncio, no checks).
python bench/lane_zero_copy_raw.py MIB [PIECE_KIB]   (session 26; compare lane_relay_raw.py)"""
import mmap, os, sys, time
import numpy as np
N = int(sys.argv[1]) * (1 << 20) // 4
PIECE = int(sys.argv[2]) * 1024 // 4 if len(sys.argv) > 2 else N
ITERS = 300
shm = mmap.mmap(-1, 4096 + 2 * N * 4)
flags = np.frombuffer(shm, np.int64, 512, 0)   # flags[r*64]: rank r's phase stamp
bufs = [np.frombuffer(shm, np.float32, N, 4096 + k * N * 4) for k in (0, 1)]
pid = os.fork()
r = 0 if pid else 1
os.sched_setaffinity(0, {r})
mine, peer = bufs[r], bufs[1 - r]
mine[:] = 0  # (sums stay finite)
seq = 0
H = N // 2
parts = [(0, H), (H, N)]
def run():
    global seq
    seq += 1
    base = seq * 4
    flags[r * 64] = base + 0          # arrived (buffer ready)
    while flags[(1 - r) * 64] < base: pass
    a, b = parts[r]
    for p in range(a, b, PIECE):
        q = min(b, p + PIECE)
        np.add(mine[p:q], peer[p:q], out=mine[p:q])
    flags[r * 64] = base + 1          # my half reduced
    while flags[(1 - r) * 64] < base + 1: pass
    pa, pb = parts[1 - r]
    for p in range(pa, pb, PIECE):
        q = min(pb, p + PIECE)
        mine[p:q] = peer[p:q]
    flags[r * 64] = base + 2          # done reading the peer
    while flags[(1 - r) * 64] < base + 2: pass
for _ in range(20): run()
t = time.perf_counter()
for _ in range(ITERS): run()
dt = (time.perf_counter() - t) / ITERS
if r == 0:
    os.waitpid(pid, 0)
    print(f"{sys.argv[1]} MiB piece {PIECE*4>>10} KiB: {dt*1e6:.1f} us/op, busbw {N*4/dt/1e9:.2f} GB/s")
