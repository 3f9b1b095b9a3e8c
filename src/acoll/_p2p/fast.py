"""Prepared calls: the short route for a P2P collective like a recent one.

The general route of a GPU collective adopts and checks its buffers, builds a descriptor,
orders the communicator's stream after the caller's with events, plans the call and fills
the kernel's arguments: tens of microseconds of Python per call, as long as the kernel
itself for small messages. NCCL users call the same collective on the same buffers over
and over; so does a serving loop. Here such a call costs a dictionary lookup and a
launch.

A call on the general route that reaches the P2P path is *learned*: keyed by the
collective, each buffer's address, element count and dtype, the op and the root, the
launches it made are kept (steps, copies into the workspace, a kernel parameter block per
step). A later call with the same key, on CuPy arrays (contiguous, on this device) runs
**prepared** when

- the communicator is usable and idle (no op running or queued, no group, no P2P launch
  waiting for its turn, no kernel error recorded),
- its kernel is compiled, and ``stream=`` is ``None`` or a CuPy stream of this device;

otherwise it takes the general route (which also reports every misuse). With
``stream=`` a prepared call launches on that stream itself (no events between streams;
NCCL does the same), after :meth:`~acoll._p2p.domain.P2PDomain.follow` orders it after
this rank's last launch when that went to another stream. Without ``stream=``, and for
ranks sharing a GPU (one thread drives them), it launches on the communicator's stream
after an event recorded on the caller's at the call, as on the general route: the
caller's stream never waits for the kernel then (kernels that spin for their peers on a
stream shared by two communicators, or by two ranks of one GPU, could wait for each other
forever). Without ``stream=`` it then polls the event recorded
after its launch for :data:`~acoll._memory.cuda.TIGHT_SPIN_S` without yielding (a small
all-reduce over NVLink ends within it), then sleeps in the loop like every GPU wait.
Errors and cancellation end the communicator as on the general route.

With ``ACOLL_P2P_NATIVE=1`` the launch's driver calls (and the waits' event queries) are
made by acoll's C launcher instead (:mod:`acoll._cuda.launcher`: one C call for every
local rank's launch), in the same order on the same streams; it measured no faster on one
H200, so it is off by default.

Where the peers read this rank's data depends on the registrations: a registration or
deregistration forgets every prepared call. At most :data:`MOST` are kept (the oldest
goes). ``ACOLL_P2P_PREPARED=0`` turns the route off.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from .._comm.executor import fail_and_raise
from .._config import Setting, parse_bool
from .._cuda.launcher import AT_RECORD, AT_THEN, NOT_READY, Copy, Launcher, Step
from .._cuda.p2p_kernels import THREADS, P2PSource
from .._dtypes import ReduceOp
from .._memory.cuda import TIGHT_SPIN_S
from ..errors import AcollError

if TYPE_CHECKING:
    from .domain import P2PDomain
    from .ops import P2POp


class _Host(Protocol):
    """What a prepared call uses of its communicator (a protocol, so that this part
    does not import the communicator's module, which imports it)."""

    _exec: Any
    _error: Any
    _closed: bool
    _p2p_seq: Any
    timeout: float

    @property
    def error(self) -> AcollError | None: ...

    def fail(self, error: AcollError) -> None: ...

__all__ = ["MOST", "PREPARED", "Prepared", "PreparedCalls"]

PREPARED = Setting("P2P_PREPARED", parse_bool, True,
                   "Repeated P2P collectives on the same buffers skip the general route "
                   "(see acoll._p2p.fast).", "P2P")
#: Prepared calls kept per communicator.
MOST = 64

_DEFAULT = 4  # cudaMemcpyDefault
Key = tuple[Any, ...]


class Prepared:
    """One learned call: its launches (each with its copies and parameter block). It
    holds addresses only, never the call's arrays (their memory may be freed and reused:
    a later call on the same addresses is the same call)."""

    __slots__ = ("_native", "copied", "describe", "fn", "src", "steps")

    def __init__(self, op: P2POp) -> None:
        dom = op.dom
        self.src: P2PSource = op.src
        text = op.describe()
        self.describe: Callable[[], str] = lambda: text
        self.fn = 0  # CUfunction, once known
        self.steps: list[tuple[int, Any, Any, list[tuple[int, int, int]]]] = []
        self.copied = 0
        for step, copies, kw in op.launches():
            args, params = dom.args_for(step, **kw)
            self.steps.append((step.blocks, args, params, copies))
            self.copied += sum(c[2] for c in copies)
        self._native: tuple[int, int, Any] | None = None

    def native(self) -> tuple[int, int]:
        """The addresses of this call's step and copy arrays for the native launcher
        (:mod:`acoll._cuda.launcher`), built at the first use (``fn`` known by then)."""
        if self._native is None:
            from .domain import EPOCH_OFFSET
            steps = (Step * len(self.steps))()
            copies = (Copy * max(1, sum(len(s[3]) for s in self.steps)))()
            k = 0
            for i, (blocks, args, params, cps) in enumerate(self.steps):
                step = steps[i]
                step.fn, step.blocks, step.threads = self.fn, blocks, THREADS
                step.params = ctypes.addressof(params)
                step.epoch_field = ctypes.addressof(args) + EPOCH_OFFSET
                step.first_copy, step.ncopies = k, len(cps)
                for dst, src, nbytes in cps:
                    copies[k].dst, copies[k].src, copies[k].nbytes = dst, src, nbytes
                    k += 1
            # (the arrays are kept with their addresses: the launcher reads them)
            self._native = (ctypes.addressof(steps), ctypes.addressof(copies),
                            (steps, copies))
        return self._native[0], self._native[1]


def _contiguous(a: Any) -> bool:
    flags = a.flags
    return bool(flags.c_contiguous or flags.f_contiguous)


class PreparedCalls:
    """A communicator's prepared calls (see the module docstring)."""

    def __init__(self, comm: _Host, dom: P2PDomain) -> None:
        import cupy as cp
        self.comm, self.dom = comm, dom
        self.ndarray = cp.ndarray
        self.stream_type = cp.cuda.Stream
        self.runtime = cp.cuda.runtime
        self.calls: dict[Key, Prepared] = {}
        self.generation = dom.generation
        #: Calls run prepared so far (tests and benchmarks read it).
        self.hits = 0

    # ------------------------------------------------------------------ keys
    def key(self, name: str, send: Any, recv: Any, op: Any, root: int) -> Key | None:
        """The key of a call on CuPy arrays of this device (``None``: never prepared)."""
        nd = self.ndarray
        if type(send) is not nd or (recv is not None and type(recv) is not nd):
            return None
        sdata = send.data
        if sdata.device_id != self.dom.device:
            return None
        if recv is None:
            rkey: tuple[Any, ...] = ()
        else:
            rdata = recv.data
            if rdata.device_id != self.dom.device:
                return None
            rkey = (rdata.ptr, recv.size, recv.dtype)
        if op is not None and type(op) is not ReduceOp:
            op = ReduceOp.coerce(op)
        if type(root) is not int:  # (1.0 or np.int64(1) would hash like a checked 1)
            return None
        return (name, sdata.ptr, send.size, send.dtype, rkey, op, root)

    def learn(self, key: Key | None, op: P2POp | None) -> None:
        """Keep the launches of general-route call ``op`` under ``key``."""
        if key is None or op is None:
            return
        self._sync()
        if key in self.calls:
            return
        if len(self.calls) >= MOST:
            del self.calls[next(iter(self.calls))]
        self.calls[key] = Prepared(op)

    def _sync(self) -> None:
        if self.generation != self.dom.generation:
            self.calls.clear()
            self.generation = self.dom.generation

    # ------------------------------------------------------------------ running
    def start(self, name: str, send: Any, recv: Any, op: Any, root: int,
              stream: Any, grouped: bool = False
              ) -> Callable[[], Coroutine[Any, Any, None]] | bool:
        """Launch the call prepared if it can be (see the module docstring).

        Returns ``False`` (nothing done: take the general route), ``True`` (done: the
        result is readable, or ordered on ``stream``) or a function whose coroutine
        completes that (awaited at once, or when the group exits). ``grouped``: the call
        is made inside a group (:mod:`acoll._comm.groups`), which it may not join when
        the communicator already has ops in it.
        """
        comm, dom = self.comm, self.dom
        if self.generation != dom.generation:
            self._sync()
            return False
        key = self.key(name, send, recv, op, root)
        prep = self.calls.get(key) if key is not None else None
        if prep is None or not _contiguous(send) or (recv is not None and
                                                     not _contiguous(recv)):
            return False
        ex = comm._exec
        if (comm._error is not None or comm._closed
                or not (ex.quiet if grouped else ex.idle)
                or not comm._p2p_seq.idle or dom.failed):
            return False
        fn = prep.fn or dom.function(prep.src)
        if not fn:
            return False
        prep.fn = fn
        if stream is None:
            st = dom.space.resolve_stream(None)  # (CuPy's current stream on the device)
        elif (type(stream) is self.stream_type
              and getattr(stream, "device_id", -1) == dom.device):
            st = stream
        else:
            return False
        ready = None
        lau = dom.launcher
        if dom.shares_gpu or stream is None:
            # The kernel goes to our own stream, after the caller's work queued so far
            # (recorded now, not at the launch, which may run after the other local
            # ranks' launches made the caller's stream wait for their kernels). Without
            # stream= the caller's stream never waits for the kernel, as on the general
            # route: kernels spinning for their peers on a stream the application shares
            # between communicators (the default stream) could wait for each other.
            space = dom.space
            ready = space.idle_event() if lau is not None else None
            if ready is not None:
                assert lau is not None
                rc = lau.record(dom.ctx, ready.ptr, st.ptr)
                if rc:
                    space.give_event(ready)
                    fail_and_raise(comm, dom.launch_failed(rc, AT_RECORD))
            else:
                rt = self.runtime
                prev = rt.getDevice()
                if prev != dom.device:
                    rt.setDevice(dom.device)
                try:
                    ready = space.take_event()
                    ready.record(st)
                finally:
                    if prev != dom.device:
                        rt.setDevice(prev)
        self.hits += 1
        ex.skip()
        seq = ex.seq - 1
        # A ticket, as on the general route: a later P2P call of this rank waits until
        # this one's launch ran (at most one launch of a rank waits for the others').
        turns = comm._p2p_seq
        ticket = turns.ticket()
        done: list[Any] = []
        settle = stream is None
        try:
            launch: Callable[[], None]
            if lau is not None:
                launch = _NativeLaunch(lau, dom, prep, st, ready, done, settle)
            else:
                launch = lambda: self._launch(prep, st, ready, done, settle)  # noqa: E731
            try:
                waiter = dom.submit(launch, comm.timeout, name)
            except BaseException:
                turns.done(ticket)
                raise
            if waiter is None:  # launched (else _finish gives the ticket back)
                turns.done(ticket)
            if waiter is None and stream is not None:
                return True
            if waiter is None and _spun(lau, done[0]):
                dom.check()
                return True
        except AcollError as exc:
            fail_and_raise(comm, exc)
        return lambda: ex.run_now(name, seq, self._finish(waiter, ticket, ready, done,
                                                          settle))

    def _launch(self, prep: Prepared, caller: Any, ready: Any, done: list[Any],
                settle: bool) -> None:
        dom = self.dom
        rt = self.runtime
        prev = rt.getDevice()
        if prev != dom.device:
            rt.setDevice(dom.device)
        try:
            dom.mine = prep.describe
            stream = caller
            if ready is not None:  # our own stream, after the caller's (see start())
                space = dom.space
                stream = space.stream
                stream.wait_event(ready)
                space.give_event(ready)
            dom.follow(stream)
            ptr = stream.ptr
            fn = prep.fn
            for blocks, args, params, copies in prep.steps:
                for dst, src, nbytes in copies:
                    rt.memcpyAsync(dst, src, nbytes, _DEFAULT, ptr)
                dom.launch_prepared(fn, blocks, args, params, ptr)
            dom.copied += prep.copied
            event = dom.mark(stream)
            if stream is not caller and not settle:
                caller.wait_event(event)
            done.append(event)
        except Exception as exc:
            err = dom.translated(exc)
            if err is None:
                raise
            raise err from exc
        finally:
            if prev != dom.device:
                rt.setDevice(prev)

    async def _finish(self, waiter: Any, ticket: int, ready: Any, done: list[Any],
                      settle: bool) -> None:
        dom = self.dom
        if waiter is not None:
            try:
                await waiter
            except BaseException:
                if not done and ready is not None:  # withdrawn: never launched
                    dom.space.give_event(ready)
                raise
            finally:
                self.comm._p2p_seq.done(ticket)
        if settle:
            event = done[0]
            if waiter is not None:  # (else start() polled it already)
                _spun(self.dom.launcher, event)
            if not event.done:
                loop = asyncio.get_running_loop()
                await dom.space.wait_event(event, loop.time() + self.comm.timeout)
            dom.check()


def _spun(lau: Launcher | None, event: Any) -> bool:
    """Whether ``event`` passed within :data:`TIGHT_SPIN_S` of polling it (without
    yielding: a small kernel over NVLink ends within it)."""
    if lau is not None:
        rc = lau.spin(event.ptr, TIGHT_SPIN_S)
        if rc == 0:
            return True
        if rc == NOT_READY:
            return False
        # (another CUresult: Event.done below raises it as CuPy words it)
    end = time.perf_counter() + TIGHT_SPIN_S
    while not event.done:
        if time.perf_counter() >= end:
            return False
    return True


class _NativeLaunch:
    """One rank's enqueue of a prepared call through the native launcher.

    Called alone it runs its own job; :class:`~acoll._p2p.domain.LocalLaunch` instead
    fills the jobs of every local rank (:meth:`fill`), runs them in one C call and then
    lets each :meth:`finish`. Either way it does what :meth:`PreparedCalls._launch` does,
    in the same order on the same streams."""

    __slots__ = ("caller", "dom", "done", "event", "launcher", "prep", "ready", "settle",
                 "stream")

    def __init__(self, lau: Launcher, dom: P2PDomain, prep: Prepared, caller: Any,
                 ready: Any, done: list[Any], settle: bool) -> None:
        self.launcher, self.dom, self.prep, self.caller = lau, dom, prep, caller
        self.ready, self.done, self.settle = ready, done, settle
        self.stream: Any = None
        self.event: Any = None

    def __call__(self) -> None:
        lau = self.launcher
        jobs = lau.jobs(1)
        self.fill(jobs[0])
        lau.run(jobs, 1)
        self.finish(jobs[0])

    def fill(self, job: Any) -> None:
        """Write this rank's job (stream, waits, steps, the event to record). A CUDA error
        on the way (CuPy making the ring's events) is raised as the path's error."""
        try:
            self._fill(job)
        except Exception as exc:
            err = self.dom.translated(exc)
            if err is None:
                raise
            raise err from exc

    def _fill(self, job: Any) -> None:
        dom, prep, caller = self.dom, self.prep, self.caller
        dom.mine = prep.describe
        if self.ready is not None:  # our own stream, after the caller's (see start())
            stream = dom.space.stream
            job.wait1 = self.ready.ptr
        else:
            stream = caller
            job.wait1 = 0
        ptr = stream.ptr
        last = dom._last_event
        job.wait2 = last.ptr if last is not None and ptr != dom._last_ptr else 0
        event = dom.next_mark()
        job.ctx, job.stream, job.record = dom.ctx, ptr, event.ptr
        job.then_stream = caller.ptr if stream is not caller and not self.settle else 0
        steps, copies = prep.native()
        job.steps, job.copies, job.nsteps = steps, copies, len(prep.steps)
        job.epoch_base = dom.epoch
        # (advanced even if the job then fails before its launches: a failed launch
        # fails the communicator, whose epochs are never used again)
        dom.epoch += len(prep.steps)
        self.stream, self.event = stream, event

    def finish(self, job: Any) -> None:
        """After the C call: note the launch as ``mark`` does once its event was recorded
        (also when only the caller's stream's wait then failed: its kernels run), give
        the caller's event back, and raise the job's failure."""
        dom = self.dom
        if self.ready is not None:  # (whatever was enqueued captured it already)
            dom.space.give_event(self.ready)
        if job.result and job.failed_at != AT_THEN:
            raise dom.launch_failed(job.result, job.failed_at)
        dom.marked(self.stream, self.event)
        if job.result:
            raise dom.launch_failed(job.result, job.failed_at)
        dom.copied += self.prep.copied
        self.done.append(self.event)
