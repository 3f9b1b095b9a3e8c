"""Where acoll's copy counters break the CUDA context (sessions 45, 46). Each case runs in
a fresh process with faulthandler on (a crash hides nothing else); a suffix isolates one
suspect:

- ``staging``: CudaStaging's piecewise copies driven by hand (no ring), one step at a
  time, the context checked after each (a CuPy op and an event sync), on CuPy's current
  (legacy default) stream;
- ``ring-down``, ``ring-up``, ``ring-both``: two ranks of one process over TCP, float32
  all_reduces of 1 MiB and 12 MiB with ``ACOLL_GPU_VIA_HOST_COUNTERS`` at that value,
  checked after each call;
- suffix ``-nb``: the caller's stream is a non-blocking stream (not the legacy default);
  ``-poll``: ``ACOLL_GPU_WAIT=poll`` (no host-function callbacks on any stream);
  ``-noreuse``: pooled events are never handed out twice;
- ``mp-down``, ``mp-up``, ``mp-both`` (under ``acoll.run -n 2``): one rank per process,
  ``device="auto"``, float32 all_reduces of 4 and 16 MiB, ten of each; suffixes as above
  and ``-uv`` (uvloop), ``-out`` (out of place), ``-whole`` (counters off), ``-ringonly``
  (with ``up``: ring.c gets the counters, but both copies go whole, the upload after the
  ring: no stream memory operation per call), ``-many`` (60 calls of 4 MiB), ``-big``
  (30 calls of 16 MiB), ``-nocheck`` (the counters' first-use check skipped: no stream
  memory operation at all with ``-ringonly``), ``-plainpage`` (with ``-nocheck``: the
  counters in ordinary host memory, not page-locked), ``-keepcheck`` (the check on a
  stream kept alive afterwards, not a temporary one), ``-nostage`` (with ``-ringonly``:
  ring.c is not given the counters either), ``-gcnow`` (gc.collect() after each call),
  ``-nogc`` (the cyclic collector off), ``-saveall`` (after the second call, what the
  cyclic collector finds, kept alive, printed by type; then the rank ends). Each call
  prints the threads fences were dropped on so far. ``-keepcycle``: each direct call
  refers to itself (a reference cycle: it goes only when the cyclic collector runs);
  ``-trackev``: every pooled event is a subclass that says when it is destroyed, and
  takes, gives and fence drops are printed with the event's id.

Run on a GPU host:

    python bench/counters_probe.py [CASE] [--log FILE]
"""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from typing import Any

import numpy as np

CASES = ["staging", "staging-nb", "staging-poll", "staging-noreuse",
         "ring-down", "ring-up", "ring-both", "ring-both-nb", "ring-both-poll",
         "ring-both-noreuse", "ring-down-nb", "ring-up-nb"]


def ok(what: str) -> None:
    import cupy

    a = cupy.ones(8, cupy.float32) + 1
    e = cupy.cuda.Event()
    e.record()
    e.synchronize()
    print(f"ok after {what}: {float(a.sum())}", flush=True)


def no_reuse(space: Any) -> None:
    space.give_event = lambda event: None


def caller_stream(cp: Any, nb: bool) -> Any:
    return cp.cuda.Stream(non_blocking=True) if nb else None


async def staging_case(flags: set[str]) -> None:
    import cupy as cp

    from acoll._memory.cuda import CudaSpace

    space = CudaSpace(0)
    if "noreuse" in flags:
        no_reuse(space)
    staging = space.staging()
    n = 1 << 20
    x = cp.arange(n // 4, dtype=cp.float32)
    y = cp.zeros(n // 4, cp.float32)
    src = space.adopt(x, "x")
    dst = space.adopt(y, "y", writable=True)
    stream = space.resolve_stream(caller_stream(cp, "nb" in flags))
    print("caller stream", stream.ptr, flush=True)
    view, block = staging.lease(n)
    sig = staging.signals(block)
    print("signals", sig is not None, staging._signals_work, flush=True)
    ok("signals (probe)")
    pieces = [(a, min(a + n // 4, n)) for a in range(0, n, n // 4)]
    sig.begin(len(pieces))
    f = staging.download_pieces_on(stream, view, src, pieces, sig)
    await f.wait()
    print("ready", int(sig.words[0]) - sig.ready_base, "landed",
          bool((view.array.view(np.float32) == np.arange(n // 4)).all()), flush=True)
    ok("downloads")
    sig.words[sig.FINAL] = sig.final_value(len(pieces) - 1)  # (all final already)
    up = staging.upload_pieces_on(stream, dst, view, pieces, sig)
    await up.wait()
    ok("uploads, counter met before")
    sig.begin(len(pieces))
    up = staging.upload_pieces_on(stream, dst, view, pieces, sig)
    await asyncio.sleep(0.01)
    print("upload done before the counter moved?", up.done(), flush=True)
    for i in range(len(pieces)):
        sig.words[sig.FINAL] = sig.final_value(i)
        await asyncio.sleep(0.002)
    await up.wait()
    ok("uploads, counter moved after")
    staging.join_on(stream, up)
    stream.synchronize()
    ok("join_on")
    print("result", bool((y == x).all()), flush=True)
    staging.release(block, up)
    ok("release")


async def ring_case(mode: str, flags: set[str]) -> None:
    import cupy as cp

    import acoll
    from acoll.testing import run_ranks

    for name in ("ACOLL_P2P_DISABLE", "ACOLL_SHM_DISABLE", "ACOLL_INPROC_DISABLE"):
        os.environ[name] = "1"
    os.environ["ACOLL_GPU_VIA_HOST_COUNTERS"] = mode

    async def fn(comm: acoll.Communicator) -> None:
        if "noreuse" in flags:
            no_reuse(comm.mem)
        with cp.cuda.Device(0):
            stream = caller_stream(cp, "nb" in flags)
        for n in ((1 << 18) + 7, 3_000_001, 3_000_001, 3_000_001):
            with cp.cuda.Device(0):
                x = cp.ones(n, cp.float32)
                if stream is not None:
                    cp.cuda.get_current_stream().synchronize()
            await comm.all_reduce(x, stream=stream)
            if stream is not None:
                stream.synchronize()
            got = x.get()
            ok(f"rank {comm.rank}, {n} floats: all 2.0 {bool((got == 2).all())}, counters "
               f"{len(comm.mem.staging()._signals)}")

    await run_ranks(2, fn, device=0)


async def mp_case(mode: str, flags: set[str]) -> None:
    import cupy as cp

    import acoll

    for name in ("ACOLL_P2P_DISABLE", "ACOLL_SHM_DISABLE"):
        os.environ[name] = "1"
    if "whole" not in flags:
        os.environ["ACOLL_GPU_VIA_HOST_COUNTERS"] = mode
    if flags & {"nocheck", "plainpage", "keepcheck"}:
        patch_new_signals(flags)
    if "ringonly" in flags:
        from acoll._comm import via_host

        def no_uploads(self: Any) -> None:
            pass

        def whole_after(self: Any, failed: bool) -> None:
            if not failed:
                self.upload = self.staging.upload_on(self.stream, self.recv, self.view,
                                                     own=True)

        if "nostage" in flags:
            real_init = via_host.NativeCopies.__init__

            def init(self: Any, *args: Any) -> None:
                real_init(self, *args)
                self.stage = None

            via_host.NativeCopies.__init__ = init  # type: ignore[method-assign]
        via_host.NativeCopies.start_uploads = no_uploads  # type: ignore[method-assign]
        via_host.NativeCopies.finish = whole_after  # type: ignore[method-assign]
    import collections
    import gc
    import threading

    from acoll._memory import cuda as cuda_mod

    dropped_on: collections.Counter[str] = collections.Counter()
    real_del = cuda_mod._EventFence.__del__

    def counted_del(self: Any) -> None:
        dropped_on[threading.current_thread().name] += 1
        real_del(self)

    cuda_mod._EventFence.__del__ = counted_del  # type: ignore[method-assign]
    if "nogc" in flags:
        gc.disable()
    if "keepcycle" in flags:
        from acoll._comm import via_host as vh

        real_bind = vh.DirectLarge.bind

        def cyclic_bind(self: Any, ctx: Any) -> Any:
            self._cycle = self
            return real_bind(self, ctx)

        vh.DirectLarge.bind = cyclic_bind  # type: ignore[method-assign]
    if "trackev" in flags:
        track_events(cp, cuda_mod)
    comm = await acoll.init_from_env(device="auto")
    if "noreuse" in flags:
        no_reuse(comm.mem)
    with cp.cuda.Device(comm.device):
        stream = caller_stream(cp, "nb" in flags)
    plan = [(4, 60)] if "many" in flags else [(16, 30)] if "big" in flags else [(4, 10),
                                                                             (16, 10)]
    for mib, calls in plan:
        n = mib << 18
        with cp.cuda.Device(comm.device):
            x = cp.ones(n, cp.float32)
            out = cp.zeros(n, cp.float32) if "out" in flags else None
            cp.cuda.get_current_stream().synchronize()
        for i in range(calls):
            if out is None:
                x.fill(1)
            st = comm.mem.staging()
            print(f"rank {comm.rank} {mib} MiB op {i}", flush=True)
            print(f"  state: events {len(comm.mem._events)}, signals {len(st._signals)}, "
                  f"leased {st.leased}, free {sum(len(q) for q in st._free.values())}, "
                  f"fds {len(os.listdir('/proc/self/fd'))}, "
                  f"threads {len(os.listdir('/proc/self/task'))}, fences dropped on "
                  f"{dict(dropped_on)}", flush=True)
            await comm.all_reduce(x, out, stream=stream)
            if stream is not None:
                stream.synchronize()
            if "gcnow" in flags:
                if "trackev" in flags:
                    print("    gc.collect ...", flush=True)
                found = gc.collect()
                if "trackev" in flags:
                    print(f"    gc.collect found {found}", flush=True)
            if "saveall" in flags and i == 1:
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                                            for o in gc.garbage)
                print(f"rank {comm.rank} garbage: {sorted(kinds.items())}", flush=True)
                for o in gc.garbage:
                    mod = type(o).__module__ or ""
                    if mod.startswith(("cupy", "acoll", "ctypes", "socket", "_socket")):
                        print(f"rank {comm.rank}   {type(o).__qualname__}: "
                              f"{repr(o)[:160]}", flush=True)
                sys.stdout.flush()
                os._exit(0)
            got = (x if out is None else out).get()
            if i in (0, calls - 1):
                ok(f"rank {comm.rank}, {mib} MiB op {i}: all 2.0 {bool((got == 2).all())}")
    await comm.close()


def track_events(cp: Any, cuda_mod: Any) -> None:
    """Pooled events that say when they are destroyed; takes, gives, fence drops logged."""

    class Tracked(cp.cuda.Event):  # type: ignore[misc]
        def __del__(self) -> None:
            print(f"    event {id(self):x} destroyed", flush=True)

    space_cls = cuda_mod.CudaSpace

    def take(self: Any) -> Any:
        if self._events:
            e = self._events.pop()
            print(f"    take {id(e):x} (pool {len(self._events)})", flush=True)
            return e
        e = Tracked(block=False, disable_timing=True)
        print(f"    new {id(e):x}", flush=True)
        return e

    real_give = space_cls.give_event

    def give(self: Any, event: Any) -> None:
        print(f"    give {id(event):x} (pool {len(self._events)}, dup "
              f"{any(e is event for e in self._events)})", flush=True)
        real_give(self, event)

    space_cls.take_event = take
    space_cls.give_event = give


def patch_new_signals(flags: set[str]) -> None:
    """Replace CudaStaging._new_signals with a variant (see the module docstring)."""
    from acoll._memory import cuda as cuda_mod
    from acoll._memory.base import CopySignals

    kept: list[Any] = []

    def new_signals(self: Any, ops: Any) -> list[CopySignals]:
        cp = self.space.cp
        with cp.cuda.Device(self.space.device):
            if "plainpage" in flags:
                words = np.zeros(1024, np.uint32)
                dev = 0
            else:
                mem = cp.cuda.alloc_pinned_memory(4096)
                words = np.frombuffer(mem, np.uint32, 1024)
                words[...] = 0
                dev = ops.device_pointer(int(words.ctypes.data))
            if self._signals_work is None and "nocheck" not in flags:
                stream = cp.cuda.Stream(non_blocking=True)
                kept.append(stream)
                ops.write(stream.ptr, dev, 0x9E3779B9)
                ops.wait(stream.ptr, dev, 0x9E3779B9)
                stream.synchronize()
                assert int(words[0]) == 0x9E3779B9
                words[0] = 0
        print(f"new signals page ({sorted(flags)})", flush=True)
        return [CopySignals(words[i * 32:(i + 1) * 32], dev + i * 128) for i in range(32)]

    cuda_mod.CudaStaging._new_signals = new_signals  # type: ignore[method-assign]


def run_one(case: str) -> None:
    parts = case.split("-")
    flags = set(parts[1:])
    if "poll" in flags:
        os.environ["ACOLL_GPU_WAIT"] = "poll"
    if parts[0] == "mp":
        job = mp_case(parts[1], flags - {parts[1]})
        if "uv" in flags:
            import uvloop

            uvloop.run(job)
        else:
            asyncio.run(job)
    elif parts[0] == "staging":
        asyncio.run(staging_case(flags))
    else:
        asyncio.run(ring_case(parts[1], flags - {parts[1]}))


if __name__ == "__main__":
    import subprocess

    args = sys.argv[1:]
    log = None
    if "--log" in args:
        i = args.index("--log")
        log = open(args[i + 1], "w")  # noqa: SIM115
        del args[i:i + 2]
    if not args:
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        for case in CASES:
            try:
                r = subprocess.run([sys.executable, __file__, case], capture_output=True,
                                   text=True, timeout=90, env=env)
                code, out = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired as exc:
                code = "timeout"
                out = "".join(o.decode() if isinstance(o, bytes) else (o or "")
                              for o in (exc.stdout, exc.stderr))
            lines = out.splitlines()
            print(f"## {case}: exit {code}", *lines[-8:], sep="\n  ", flush=True)
            if log is not None:
                print(f"## {case}: exit {code}", *lines, sep="\n  ", file=log, flush=True)
    else:
        try:
            run_one(args[0])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
