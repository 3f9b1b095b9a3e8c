"""What one copy on the caller's stream costs the loop's thread (issue 9), one GPU, no peers.

    python bench/staging_enqueue_probe.py [--reps 300]

For sizes from 8 B to 8 MiB, on CuPy's current (legacy default) stream and on a
non-blocking stream: the median microseconds of enqueueing a download into a pooled
page-locked block (``CudaStaging.download_on``, with and without an event of its own),
of an upload (``upload_on``), of ``take_event`` + ``record`` alone, and the copy's own time
on the GPU (enqueue to fence passed, waited with a blocking synchronize).
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy as cp
import numpy as np

from acoll._memory.cuda import CudaSpace

clock = time.perf_counter_ns


def med_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args()
    space = CudaSpace(0)
    staging = space.staging()
    print(f"# one copy on the caller's stream, cuda:0, median us over {args.reps}")
    print(f"{'bytes':>9} {'stream':<12} {'down':>7} {'down+ev':>8} {'up':>7} "
          f"{'ev only':>8} {'copy gpu':>9}")
    for name, stream in (("legacy", cp.cuda.get_current_stream()),
                         ("nonblocking", cp.cuda.Stream(non_blocking=True))):
        for nbytes in (8, 512 << 10, 2 << 20, 8 << 20):
            x = cp.ones(max(1, nbytes // 4), cp.float32)
            buf = space.adopt(x, "x", writable=True)
            view, block = staging.lease(buf.nbytes)
            host = staging._host.wrap(view.array.view(np.float32))
            down, down_ev, up, ev, gpu = [], [], [], [], []
            for _ in range(args.reps):
                t = clock()
                f = staging.download_on(stream, host, buf)
                down.append(clock() - t)
                stream.synchronize()
                t = clock()
                f = staging.download_on(stream, host, buf, own=True)
                down_ev.append(clock() - t)
                stream.synchronize()
                gpu.append(clock() - t)
                t = clock()
                f = staging.upload_on(stream, buf, host)
                up.append(clock() - t)
                stream.synchronize()
                t = clock()
                e = space.take_event()
                e.record(stream)
                ev.append(clock() - t)
                space.give_event(e)
                del f
            staging.release(block)
            print(f"{nbytes:>9} {name:<12} {med_us(down):7.1f} {med_us(down_ev):8.1f} "
                  f"{med_us(up):7.1f} {med_us(ev):8.1f} {med_us(gpu):9.1f}")


if __name__ == "__main__":
    main()
