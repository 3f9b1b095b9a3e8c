"""What the loop's thread pays to enqueue a via-host call's piecewise copies (issue 9).

    python bench/enqueue_pieces_probe.py [--reps 200] [--pieces 8]

One GPU, no peers. For calls of 1, 4 and 16 MiB: the median microseconds of enqueueing
the download in ``--pieces`` pieces, each bumping a copy counter
(``CudaStaging.download_pieces_on``, what ``NativeCopies`` does at a direct call), of the
same pieces without the counters (``memcpyAsync`` alone), of one whole download
(``download_on`` with its event), and of one ``cuStreamWriteValue32`` alone; each after a
``synchronize`` (the GPU idle) and again right behind a whole download still running
(``busy``). Run two at once to see what a second process on the GPU does to them.
"""

from __future__ import annotations

import argparse
import os

import cupy as cp
import numpy as np
from staging_enqueue_probe import clock, med_us

from acoll._memory.cuda import _D2H, CudaSpace, _stream_mem_ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--pieces", type=int, default=8)
    args = p.parse_args()
    space = CudaSpace(0)
    staging = space.staging()
    ops = _stream_mem_ops()
    assert ops is not None
    stream = cp.cuda.get_current_stream()
    runtime = cp.cuda.runtime
    print(f"# pid {os.getpid()}: enqueue costs on cuda:0 (legacy stream), median us over "
          f"{args.reps}, {args.pieces} pieces")
    print(f"{'MiB':>4} {'gpu':<5} {'pieces+ctr':>10} {'pieces':>8} {'whole':>7} "
          f"{'write':>7} {'copy gpu':>9}")
    for mib in (1, 4, 16):
        nbytes = mib << 20
        x = cp.ones(nbytes // 4, cp.float32)
        buf = space.adopt(x, "x", writable=True)
        view, block = staging.lease(nbytes)
        host = staging._host.wrap(view.array.view(np.float32))
        signals = staging.signals(block)
        assert signals is not None
        step = nbytes // args.pieces
        pieces = [(i * step, (i + 1) * step) for i in range(args.pieces)]
        for busy in (False, True):
            ctr, plain, whole, write, gpu = [], [], [], [], []
            for _ in range(args.reps):
                for what, out in (("ctr", ctr), ("plain", plain), ("whole", whole),
                                  ("write", write)):
                    stream.synchronize()
                    if busy:
                        staging.download_on(stream, host, buf)
                    f = None
                    t = clock()
                    if what == "ctr":
                        signals.begin(0)
                        f = staging.download_pieces_on(stream, host, buf, pieces, signals)
                    elif what == "plain":
                        for a, b in pieces:
                            runtime.memcpyAsync(host.ptr + a, buf.ptr + a, b - a, _D2H,
                                                stream.ptr)
                    elif what == "whole":
                        f = staging.download_on(stream, host, buf, own=True)
                    else:
                        ops.write(stream.ptr, signals.device_ptr + 32, 1)  # (an unused word)
                    out.append(clock() - t)
                    if what == "whole":
                        stream.synchronize()
                        gpu.append(clock() - t)
                    del f
            print(f"{mib:>4} {'busy' if busy else 'idle':<5} {med_us(ctr):10.1f} "
                  f"{med_us(plain):8.1f} {med_us(whole):7.1f} {med_us(write):7.1f} "
                  f"{med_us(gpu):9.1f}", flush=True)
        stream.synchronize()
        staging.release(block)


if __name__ == "__main__":
    main()
