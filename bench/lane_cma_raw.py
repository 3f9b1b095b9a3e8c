"""Like bench/lane_relay_raw.py, but each rank reads its peer's buffer with process_vm_readv
(CMA, one copy) instead of a relay through shared slots (two copies).
python bench/lane_cma_raw.py MIB PART_KIB   (session 25)"""
import ctypes, mmap, os, sys, time
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.c_ulong]
libc.process_vm_readv.restype = ctypes.c_ssize_t
N = int(sys.argv[1]) * (1 << 20) // 4
PER = int(sys.argv[2]) * 1024 // 4  # elements per step per rank (part size)
ITERS = 300
shm = mmap.mmap(-1, 4096)
flags = np.frombuffer(shm, np.int64, 512, 0)
addr = np.frombuffer(shm, np.uint64, 8, 2048)
rpid = os.getpid()
pid = os.fork()
r = 0 if pid else 1
os.sched_setaffinity(0, {r})
peer_pid = pid if pid else rpid
mine = np.zeros(N, np.float32); res = mine
scratch = np.empty(PER, np.float32)
addr[r] = mine.ctypes.data
flags[r * 64 + 16] = 1
while flags[(1 - r) * 64 + 16] != 1: pass
paddr = int(addr[1 - r])
li, ri = iovec(), iovec()
def cma(dst, src_addr, nbytes):
    li.base = dst; li.len = nbytes; ri.base = src_addr; ri.len = nbytes
    got = libc.process_vm_readv(peer_pid, ctypes.byref(li), 1, ctypes.byref(ri), 1, 0)
    if got != nbytes: raise OSError(ctypes.get_errno(), "cma")
seq = 0
def run():
    global seq
    steps = []
    for c0 in range(0, N, 2 * PER):
        c1 = min(N, c0 + 2 * PER); h = (c1 - c0) // 2
        parts = [(c0, c0 + h), (c0 + h, c1)]
        steps.append(("rs", parts)); steps.append(("ag", parts))
    for kind, parts in steps:
        seq += 1
        a, b = parts[r]; pa, pb = parts[1 - r]
        flags[r * 64] = seq  # my data for this step is ready
        while flags[(1 - r) * 64] < seq: pass
        if kind == "rs":
            cma(scratch.ctypes.data, paddr + a * 4, (b - a) * 4)
            np.add(mine[a:b], scratch[:b - a], out=res[a:b])
        else:
            cma(res[pa:].ctypes.data, paddr + pa * 4, (pb - pa) * 4)
        flags[r * 64 + 8] = seq  # done reading
    while flags[(1 - r) * 64 + 8] < seq: pass  # peer done reading my buffer
for _ in range(20): run()
t = time.perf_counter()
for _ in range(ITERS): run()
dt = (time.perf_counter() - t) / ITERS
if r == 0:
    os.waitpid(pid, 0)
    print(f"CMA {sys.argv[1]} MiB part {PER*4>>10} KiB: {dt*1e6:.1f} us/op, busbw {N*4/dt/1e9:.2f} GB/s")
