"""The ceiling of the lane's two-shot all_reduce between 2 processes on this host: the same
copies and adds in NumPy, slot by slot, with spin flags in shared memory and nothing else
(no asyncio, no checks).  python bench/lane_relay_raw.py MIB [SLOT_KIB]   (session 25)"""
# raw ceiling of the lane's two-shot all_reduce, 2 processes, spin flags in shared memory
import mmap, os, sys, time
import numpy as np
N = int(sys.argv[1]) * (1 << 20) // 4
PER = int(sys.argv[2]) * 1024 // 4 if len(sys.argv) > 2 else 1 << 18  # elements per slot
ITERS = 300
H = N // 2
shm = mmap.mmap(-1, 4096 + 2 * 2 * 2 * PER * 4)
flags = np.frombuffer(shm, np.int64, 512, 0)   # flags[r*64 + slot]
def box(r, slot):  # rank r's outbox slot
    off = 4096 + ((r * 2 + slot) * PER * 4)
    return np.frombuffer(shm, np.float32, PER, off)
pid = os.fork()
r = 0 if pid else 1
os.sched_setaffinity(0, {r})
mine = np.zeros(N, np.float32); res = mine
seq = 0
def run():
    global seq
    steps = []
    for c0 in range(0, N, 2 * PER):
        c1 = min(N, c0 + 2 * PER); h = (c1 - c0) // 2
        parts = [(c0, c0 + h), (c0 + h, c1)]
        steps.append(("rs", parts)); steps.append(("ag", parts))
    for kind, parts in steps:
        seq += 1; slot = seq & 1
        a, b = parts[r]; pa, pb = parts[1 - r]
        # wait for peer to have read my slot (its ack = seq-2)
        while flags[(1 - r) * 64 + 8 + slot] < seq - 2: pass
        out = box(r, slot)
        if kind == "rs": out[:pb - pa] = mine[pa:pb]
        else: out[:b - a] = res[a:b]
        flags[r * 64 + slot] = seq
        while flags[(1 - r) * 64 + slot] < seq: pass
        inn = box(1 - r, slot)
        if kind == "rs": np.add(mine[a:b], inn[:b - a], out=res[a:b])
        else: res[pa:pb] = inn[:pb - pa]
        flags[r * 64 + 8 + slot] = seq
for _ in range(20): run()
t = time.perf_counter()
for _ in range(ITERS): run()
dt = (time.perf_counter() - t) / ITERS
if r == 0:
    os.waitpid(pid, 0)
    print(f"{sys.argv[1]} MiB slot {PER*4>>10} KiB: {dt*1e6:.1f} us/op, busbw {N*4/dt/1e9:.2f} GB/s")
