"""One rank of the cross-process P2P tests (started by acoll-run, device="auto").

``matrix``: the collective matrix in copy mode (CUDA IPC); ``probe``: print whether a
domain formed; ``kill``: rank 1 exits hard while rank 0 waits in an all_reduce, which must
end in RemoteError well before the 60 s timeout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cupy as cp

import acoll
from collective_cases import ALL_DTYPES, ALL_OPS, check_all
from gpu_cases import to_device, to_host


async def main(what: str) -> None:
    comm = await acoll.init_from_env(device="auto", timeout=60)
    dom = comm._p2p
    if what == "probe":
        print(f"rank {comm.rank}: {'no domain' if dom is None else 'domain'}", flush=True)
        await comm.close()
        return
    if what == "matrix":
        print(f"rank {comm.rank}: {'copy mode' if dom and not dom.direct else dom}",
              flush=True)
        dtypes = [d for d in ALL_DTYPES if d.name in ("int8", "uint64", "float16", "bfloat16",
                                                      "float32", "float64")]
        async with comm:
            n = await check_all(comm, [0, 1, 7, 1000, 100003], dtypes, ALL_OPS,
                                dev=to_device(comm.device or 0), host=to_host)
        print(f"rank {comm.rank}: {n} checks passed", flush=True)
        return
    if what == "registered":
        await registered(comm)
        return
    if what == "prepared":
        await prepared(comm)
        return
    # kill
    with cp.cuda.Device(comm.device):
        x = cp.ones(1 << 20, cp.float32)
    await comm.all_reduce(x)
    if comm.rank == 1:
        await asyncio.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    try:
        await comm.all_reduce(x)
    except acoll.RemoteError as exc:
        print(f"survivor: RemoteError after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
        comm.abort()
        return
    except acoll.AcollError as exc:
        print(f"survivor: {type(exc).__name__}: {exc}", flush=True)
        comm.abort()
        raise SystemExit(1) from None
    print("survivor: no error", flush=True)
    raise SystemExit(1)


async def registered(comm: acoll.Communicator) -> None:
    """Registered buffers (pool sub-allocations at odd offsets) are read in place: the
    results are exact and nothing is copied into the workspace."""
    import numpy as np
    n, r = comm.size, comm.rank
    with cp.cuda.Device(comm.device):
        pad = cp.zeros(1 << 20, cp.uint8)  # the arrays below start inside a pool block
        a = cp.full(3 * (1 << 20) + 5, r + 1, cp.float32)
        b = cp.empty_like(a)
        g = cp.empty(n * a.size, cp.float32)
    regs = [await comm.register(x) for x in (a, b, g)]
    dom = comm._p2p
    assert dom is not None
    before = dom.copied
    await comm.all_reduce(a, b)  # two-shot, out of place
    await comm.all_gather(a, g)
    await comm.all_reduce(a[7:], b[7:])  # an offset inside the registration
    await comm.all_reduce(a[:1000], b[:1000])  # one-shot
    with cp.cuda.Device(comm.device):
        want = n * (n + 1) / 2
        assert bool((b == want).all()), cp.asnumpy(b)[:8]
        got = cp.asnumpy(g).reshape(n, -1)
        assert np.array_equal(got[:, 0], np.arange(1, n + 1, dtype=np.float32))
        assert bool((g.reshape(n, -1)[:, -1] == cp.arange(1, n + 1)).all())
    copied = dom.copied - before
    assert copied == 0, copied
    await comm.all_reduce(a)  # in place one-shot? no: 12 MiB is two-shot, read in place
    with cp.cuda.Device(comm.device):
        assert bool((a == want).all())
    for reg in regs:
        await comm.deregister(reg)
    del pad
    print(f"rank {r}: registered calls exact, {copied} bytes copied", flush=True)
    await comm.close()


async def prepared(comm: acoll.Communicator) -> None:
    """Prepared calls across processes: through the workspace while the buffers are not
    registered, read in place once they are, through the workspace again after
    deregistering; exact every time, on alternating streams too."""
    n, r = comm.size, comm.rank
    fast, dom = comm._prepared, comm._p2p
    assert fast is not None
    assert dom is not None
    with cp.cuda.Device(comm.device):
        a = cp.empty(3 * (1 << 20) + 5, cp.float32)  # two-shot, several workspace steps
        b = cp.empty_like(a)
        small = cp.empty(1000, cp.float32)  # one-shot
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]

    async def rounds(k0: int, copies: bool) -> None:
        for k in range(k0, k0 + 3):
            with cp.cuda.Device(comm.device):
                a[...] = r + k
                small[...] = r * k
            before, hits = dom.copied, fast.hits
            await comm.all_reduce(a, b)
            await comm.all_reduce(small)
            with cp.cuda.Device(comm.device):
                assert bool((b == sum(q + k for q in range(n))).all()), (k, float(b[0]))
                assert bool((small == k * n * (n - 1) // 2).all()), (k, float(small[0]))
            if k > k0:
                assert fast.hits == hits + 2, (k, fast.hits, hits)
                # (the in-place one-shot call always takes the workspace)
                assert (dom.copied - before > small.nbytes) == copies, (k, copies)

    await rounds(0, copies=True)
    regs = [await comm.register(x) for x in (a, b)]
    await rounds(10, copies=False)
    # A prepared call on a stream, behind 200 ms of other work, then deregistering: the
    # peers' mappings go only once its kernel is done (else: an illegal address).
    from acoll._cuda.spin import spin
    with cp.cuda.Device(comm.device):
        a[...] = r + 1
        cp.cuda.get_current_stream().synchronize()
        spin(0.2, streams[0])
    hits = fast.hits
    await comm.all_reduce(a, b, stream=streams[0])
    assert fast.hits == hits + 1
    for reg in regs:
        await comm.deregister(reg)
    with cp.cuda.Device(comm.device):
        streams[0].synchronize()
        assert bool((b == n * (n + 1) // 2).all()), float(b[0])
    await rounds(20, copies=True)
    with cp.cuda.Device(comm.device):
        a[...] = 1
        cp.cuda.get_current_stream().synchronize()
    for k in range(8):
        await comm.all_reduce(a, stream=streams[k % 2])
    with cp.cuda.Device(comm.device):
        for st in streams:
            st.synchronize()
        assert bool((a == n ** 8).all()), float(a[0])
    print(f"rank {r}: prepared calls exact, {fast.hits} prepared", flush=True)
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
