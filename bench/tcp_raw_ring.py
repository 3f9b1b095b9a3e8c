"""The loopback ceiling of a ring all-reduce's traffic, without any collective library.

``python bench/tcp_raw_ring.py RANKS SIZE ITERS [--reduce]``: RANKS processes in a ring of
loopback TCP connections; per op each sends ``2 (n-1)/n SIZE`` bytes to its right neighbour
(one thread, blocking ``sendall`` of 512 KiB pieces) while another thread receives as much
from its left (``recv_into``), with ``--reduce`` adding a NumPy add of every received piece
into a second array (what a ring's reduce-scatter half does). Prints the busbw this traffic
pattern reaches: what acoll or Gloo could reach over TCP on the machine if nothing but the
copies cost anything.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import threading
import time

import numpy as np

from acoll._config import parse_size

_PIECE = 512 << 10


def _rank(r: int, n: int, port0: int, nbytes: int, iters: int, reduce: bool,
          out: mp.Queue) -> None:  # type: ignore[type-arg]
    lst = socket.create_server(("127.0.0.1", port0 + r))
    right = socket.socket()
    while True:
        try:
            right.connect(("127.0.0.1", port0 + (r + 1) % n))
            break
        except OSError:
            time.sleep(0.01)
    left, _ = lst.accept()
    for s in (left, right):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    per_op = 2 * (n - 1) * (nbytes // n)
    src = np.ones(per_op // 4, np.float32)
    dst = np.empty_like(src)
    acc = np.zeros(_PIECE // 4, np.float32)

    def send() -> None:
        view = memoryview(src).cast("B")
        for _ in range(iters + 1):
            for off in range(0, per_op, _PIECE):
                right.sendall(view[off:off + _PIECE])

    def recv() -> None:
        view = memoryview(dst).cast("B")
        for _ in range(iters + 1):
            off = 0
            while off < per_op:
                got = left.recv_into(view[off:off + _PIECE], min(_PIECE, per_op - off))
                if got == 0:
                    raise ConnectionError("peer closed")
                off += got
                if reduce and off % _PIECE == 0:
                    piece = dst[(off - _PIECE) // 4:off // 4]
                    np.add(acc[:len(piece)], piece, out=acc[:len(piece)])

    t0 = 0.0
    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    per = wall / (iters + 1)
    out.put((r, per))


def main() -> None:
    n, nbytes, iters = int(sys.argv[1]), parse_size(sys.argv[2]), int(sys.argv[3])
    reduce = "--reduce" in sys.argv
    port0 = 29700 + (hash((n, nbytes)) % 200)
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_rank, args=(r, n, port0, nbytes, iters, reduce, q))
             for r in range(n)]
    for p in procs:
        p.start()
    res = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    per = max(t for _, t in res)
    busbw = 2 * (n - 1) / n * nbytes / per / 1e9
    print(f"raw ring{' +reduce' if reduce else ''} {n} ranks {nbytes >> 20} MiB: "
          f"{per * 1e3:.2f} ms/op busbw {busbw:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
