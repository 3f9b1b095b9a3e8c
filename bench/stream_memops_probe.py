"""Which step of the copy counters' set-up breaks CuPy's CUDA context (session 45 saw
"invalid device context" after it on an H100). Each step runs in a fresh process:

    python bench/stream_memops_probe.py            # all steps, a process each
    python bench/stream_memops_probe.py STEP       # one step (pointer, write, wait, sync, v1)
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

STEPS = ["none", "load", "pointer", "write", "wait", "sync", "v1"]


def run(step: str) -> None:
    import cupy as cp
    import numpy as np

    cp.cuda.Device(0).use()
    a = cp.ones(16, cp.float32)
    ev = cp.cuda.Event()
    ev.record()
    mem = cp.cuda.alloc_pinned_memory(4096)
    words = np.frombuffer(mem, np.uint32, 1024)
    words[...] = 0
    if step != "none":
        lib = ctypes.CDLL("libcuda.so.1")
        suffix = "" if step == "v1" else "_v2"
        dp = lib["cuMemHostGetDevicePointer" + ("" if step == "v1" else "_v2")]
        dp.restype = ctypes.c_int
        dp.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        wr = lib["cuStreamWriteValue32" + suffix]
        wt = lib["cuStreamWaitValue32" + suffix]
        for fn in (wr, wt):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        out = ctypes.c_uint64(0)
        if step != "load":
            print("pointer", dp(ctypes.byref(out), int(words.ctypes.data), 0),
                  hex(out.value), hex(int(words.ctypes.data)), flush=True)
        s = cp.cuda.Stream(non_blocking=True)
        if step in ("write", "wait", "sync", "v1"):
            print("write", wr(s.ptr, out.value, 7, 0), flush=True)
        if step in ("wait", "sync", "v1"):
            print("wait", wt(s.ptr, out.value, 7, 0), flush=True)
        if step in ("sync", "v1"):
            s.synchronize()
            print("synced, word", int(words[0]), flush=True)
    b = a + 1
    ev2 = cp.cuda.Event()
    ev2.record()
    ev2.synchronize()
    print("after: cupy works", float(b.sum()), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for step in STEPS:
            r = subprocess.run([sys.executable, __file__, step], capture_output=True,
                               text=True, timeout=60)
            tail = (r.stdout + r.stderr).strip().splitlines()[-4:]
            print(f"## {step}: exit {r.returncode}", *tail, sep="\n  ", flush=True)
