"""Prepared P2P calls (``acoll._p2p.fast``) without a GPU: which calls are keyed, when a
learned call runs prepared and when it takes the general route, where its launch goes,
and what an error at launch does. CuPy, the domain and the communicator are stand-ins
that record what the prepared route asks of them (``tests/test_p2p_gpu.py`` runs the
route on real GPUs)."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import numpy as np
import pytest

from acoll._dtypes import ReduceOp
from acoll._p2p.ops import Sequencer
from acoll.errors import AcollError, TransportError

DEV = 1


class _Data:
    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr, self.device_id = ptr, device_id


class _Array:  # cupy.ndarray's few attributes the route reads
    def __init__(self, ptr: int, size: int, dtype: Any = np.float32, device: int = DEV,
                 contiguous: bool = True) -> None:
        self.data = _Data(ptr, device)
        self.size, self.dtype = size, np.dtype(dtype)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous, f_contiguous=False)


class _Stream:
    def __init__(self, ptr: int, device_id: int = DEV) -> None:
        self.ptr, self.device_id = ptr, device_id
        self.waits: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waits.append(event)


class _Event:
    made = 0

    def __init__(self) -> None:
        self.done = True
        self.records: list[Any] = []
        _Event.made += 1
        self.ptr = 0xE000 + _Event.made  # (a handle, for the native launcher)

    def record(self, stream: Any) -> None:
        self.records.append(stream)


class _Runtime:
    def __init__(self) -> None:
        self.device = 0
        self.copies: list[tuple[int, int, int, int]] = []

    def getDevice(self) -> int:  # (CuPy's names)
        return self.device

    def setDevice(self, device: int) -> None:
        self.device = device

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int,
                    stream: int) -> None:
        self.copies.append((dst, src, n, stream))


class _Cuda(types.SimpleNamespace):
    pass


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    runtime = _Runtime()
    current = _Stream(0)
    cuda = _Cuda(Stream=_Stream, runtime=runtime, get_current_stream=lambda: current,
                 current=current)
    mod = types.ModuleType("cupy")
    mod.ndarray = _Array  # type: ignore[attr-defined]
    mod.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


class _Space:
    def __init__(self) -> None:
        self.stream = _Stream(77)
        self.taken = self.given = 0
        self.current: Any = None  # CuPy's current stream on the device

    def resolve_stream(self, stream: Any) -> Any:
        assert stream is None
        return self.current

    def take_event(self) -> _Event:
        self.taken += 1
        return _Event()

    def idle_event(self) -> _Event:
        return self.take_event()

    def give_event(self, event: Any) -> None:
        self.given += 1


class _Domain:
    """The domain calls the route makes, recorded."""

    def __init__(self) -> None:
        self.device = DEV
        self.generation = 0
        self.shares_gpu = False
        self.failed = False
        self.space = _Space()
        self.fn = 1234
        self.copied = 0
        self.mine: Any = None
        self.launched: list[tuple[int, int, int]] = []  # (fn, blocks, stream ptr)
        self.followed: list[int] = []
        self.last: Any = None
        self.raise_at_launch: BaseException | None = None
        self.checks = 0
        self.launcher: Any = None  # (the native launcher: _NativeDomain below)
        self.ctx = 0

    def function(self, src: Any) -> int:
        return self.fn

    def args_for(self, step: Any, **kw: Any) -> tuple[Any, Any]:
        return dict(kw), object()

    def follow(self, stream: Any) -> None:
        self.followed.append(stream.ptr)

    def launch_prepared(self, fn: int, blocks: int, args: Any, params: Any,
                        stream_ptr: int) -> None:
        if self.raise_at_launch is not None:
            raise self.raise_at_launch
        self.launched.append((fn, blocks, stream_ptr))

    def mark(self, stream: Any) -> _Event:
        self.last = _Event()
        self.last.record(stream)
        return self.last

    def translated(self, exc: BaseException) -> TransportError | None:
        return TransportError(f"cuda: {exc}") if isinstance(exc, OSError) else None

    def submit(self, launch: Any, timeout: float, name: str) -> None:
        launch()

    def check(self) -> None:
        self.checks += 1


class _Executor:
    def __init__(self) -> None:
        self.idle = True  # (False inside a group: acoll._comm.executor)
        self.quiet = True
        self.seq = 0

    def skip(self) -> None:
        self.seq += 1

    async def run_now(self, name: str, seq: int, op: Any) -> None:
        await op


class _Host:
    def __init__(self) -> None:
        self._exec = _Executor()
        self._error: AcollError | None = None
        self._closed = False
        self._p2p_seq = Sequencer()
        self.timeout = 5.0
        self.failed_with: list[AcollError] = []

    @property
    def error(self) -> AcollError | None:
        return self._error

    def fail(self, error: AcollError) -> None:
        self.failed_with.append(error)
        self._error = self._error or error


class _Step:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks


class _Op:  # a general-route P2POp, as far as learning reads it
    def __init__(self, dom: _Domain, copies: bool = False) -> None:
        self.dom, self.name, self.src = dom, "all_reduce", "src"
        self._copies = [(900, 100, 64)] if copies else []

    def describe(self) -> str:
        return "all_reduce of 16 x float32"

    def launches(self) -> list[tuple[_Step, list[tuple[int, int, int]], dict[str, Any]]]:
        return [(_Step(4), list(self._copies), {"in_ptr": 100}),
                (_Step(2), [], {"in_ptr": 164})]


def _calls(fake_cupy: Any) -> tuple[Any, _Host, _Domain]:
    from acoll._p2p.fast import PreparedCalls
    host, dom = _Host(), _Domain()
    dom.space.current = fake_cupy.cuda.current
    return PreparedCalls(host, dom), host, dom  # type: ignore[arg-type]


def _learned(fast: Any, dom: _Domain, send: _Array, recv: _Array | None = None, *,
             op: Any = "sum", copies: bool = False) -> None:
    fast.learn(fast.key("all_reduce", send, recv, op, 0), _Op(dom, copies))


def test_keys_name_only_calls_that_can_be_prepared(fake_cupy: Any) -> None:
    fast, _, _ = _calls(fake_cupy)
    x = _Array(100, 16)
    assert fast.key("all_reduce", x, None, "sum", 0) == fast.key("all_reduce", x, None,
                                                                  ReduceOp.SUM, 0)
    assert fast.key("all_reduce", x, None, "sum", 0) != fast.key("all_reduce", x, None,
                                                                  "max", 0)
    assert fast.key("all_reduce", np.ones(16, np.float32), None, "sum", 0) is None
    assert fast.key("all_reduce", _Array(100, 16, device=0), None, "sum", 0) is None
    assert fast.key("all_reduce", x, _Array(200, 16, device=0), "sum", 0) is None
    assert fast.key("broadcast", x, None, None, np.int64(1)) is None  # root not an int
    assert fast.key("broadcast", x, None, None, 1.0) is None
    # the receive buffer's address, size and dtype are part of the call
    k1 = fast.key("all_reduce", x, _Array(200, 16), "sum", 0)
    assert k1 != fast.key("all_reduce", x, _Array(200, 16, np.int32), "sum", 0)
    assert k1 != fast.key("all_reduce", x, _Array(208, 16), "sum", 0)
    assert k1 != fast.key("all_reduce", x, None, "sum", 0)


async def test_a_learned_call_on_a_stream_launches_there(fake_cupy: Any) -> None:
    fast, host, dom = _calls(fake_cupy)
    x, st = _Array(100, 16), _Stream(55)
    assert fast.start("all_reduce", x, None, "sum", 0, st) is False  # not learned yet
    _learned(fast, dom, x, copies=True)
    assert fast.start("all_reduce", x, None, "sum", 0, st) is True
    assert dom.launched == [(1234, 4, 55), (1234, 2, 55)]  # every step, on the stream
    assert fake_cupy.cuda.runtime.copies == [(900, 100, 64, 55)]
    assert dom.copied == 64
    assert dom.followed == [55]
    assert dom.mine() == "all_reduce of 16 x float32"
    assert fast.hits == 1
    assert host._exec.seq == 1  # the call used up its sequence number
    assert host._p2p_seq.idle  # and gave its launch ticket back
    assert fake_cupy.cuda.runtime.device == 0  # the caller's device is restored
    assert st.waits == []  # the stream holds the kernel itself: no event


async def test_without_a_stream_the_kernel_goes_to_the_communicators_stream(
        fake_cupy: Any) -> None:
    fast, _, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    assert fast.start("all_reduce", x, None, "sum", 0, None) is True  # (event done)
    own = dom.space.stream
    assert {ptr for _, _, ptr in dom.launched} == {own.ptr}
    assert len(own.waits) == 1  # after an event recorded on the caller's stream
    assert own.waits[0].records == [fake_cupy.cuda.current]
    assert fake_cupy.cuda.current.waits == []  # the caller's stream never waits
    assert dom.checks == 1  # kernel errors are read before the call returns
    assert dom.space.taken == dom.space.given == 1


async def test_an_awaited_call_still_running_is_awaited(fake_cupy: Any) -> None:
    fast, _, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    waited: list[Any] = []

    async def wait_event(event: Any, deadline: float | None = None) -> None:
        waited.append(event)

    dom.space.wait_event = wait_event  # type: ignore[attr-defined]
    real_mark = dom.mark

    def running(stream: Any) -> _Event:
        event = real_mark(stream)
        event.done = False
        return event

    dom.mark = running  # type: ignore[method-assign]
    started = fast.start("all_reduce", x, None, "sum", 0, None)
    assert callable(started)
    assert dom.checks == 0
    await started()
    assert waited == [dom.last]
    assert dom.checks == 1


@pytest.mark.parametrize("why", ["busy", "ticket", "failed", "error", "closed", "kernel",
                                 "strided", "stream type", "stream device"])
async def test_the_general_route_takes_what_cannot_run_prepared(fake_cupy: Any,
                                                                why: str) -> None:
    fast, host, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    stream: Any = _Stream(55)
    if why == "busy":
        host._exec.idle = False
    elif why == "ticket":
        host._p2p_seq.ticket()  # a general-route P2P call waits for its turn
    elif why == "failed":
        dom.failed = True
    elif why == "error":
        host._error = AcollError("gone")
    elif why == "closed":
        host._closed = True
    elif why == "kernel":
        dom.fn = 0  # not compiled yet
    elif why == "strided":
        x = _Array(100, 16, contiguous=False)
    elif why == "stream type":
        stream = 55  # a raw handle
    elif why == "stream device":
        stream = _Stream(55, device_id=0)
    assert fast.start("all_reduce", x, None, "sum", 0, stream) is False
    assert dom.launched == []
    assert fast.hits == 0
    assert host._exec.seq == 0


@pytest.mark.parametrize("quiet", [True, False])
async def test_a_call_in_a_group_runs_prepared_only_with_no_other_op_in_it(
        fake_cupy: Any, quiet: bool) -> None:
    """Inside a group (``grouped=True``) the executor is not idle (calls must join the
    group), yet a prepared call may launch when the communicator has no op in the group,
    nothing running or queued (``quiet``); else it joins the group on the general route."""
    fast, host, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    host._exec.idle = False
    host._exec.quiet = quiet
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(55)) is False  # not grouped
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(55), True) is quiet
    assert bool(dom.launched) is quiet


async def test_a_registration_forgets_every_prepared_call(fake_cupy: Any) -> None:
    fast, _, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    dom.generation += 1
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(55)) is False
    assert fast.calls == {}
    _learned(fast, dom, x)
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(55)) is True


async def test_at_most_most_calls_are_kept_the_oldest_goes(fake_cupy: Any) -> None:
    from acoll._p2p.fast import MOST
    fast, _, dom = _calls(fake_cupy)
    arrays = [_Array(1000 + 64 * k, 16) for k in range(MOST + 1)]
    for a in arrays:
        _learned(fast, dom, a)
    assert len(fast.calls) == MOST
    assert fast.start("all_reduce", arrays[0], None, "sum", 0, _Stream(55)) is False
    assert fast.start("all_reduce", arrays[-1], None, "sum", 0, _Stream(55)) is True


async def test_a_cuda_error_at_launch_fails_the_communicator(fake_cupy: Any) -> None:
    fast, host, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    dom.raise_at_launch = OSError("launch failed")  # (the stand-in's "CUDA error")
    with pytest.raises(TransportError) as info:
        fast.start("all_reduce", x, None, "sum", 0, _Stream(55))
    assert isinstance(info.value.__cause__, OSError)
    assert host.failed_with == [info.value]
    assert host._p2p_seq.idle  # the ticket went back
    assert fake_cupy.cuda.runtime.device == 0


async def test_a_second_call_waits_for_the_first_launch(fake_cupy: Any) -> None:
    """While a prepared call's launch waits for the other local ranks, the next call of
    the rank is not prepared (it waits its turn on the general route)."""
    fast, host, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    pending: list[Any] = []
    later = asyncio.get_running_loop().create_future()

    def submit(launch: Any, timeout: float, name: str) -> Any:
        pending.append(launch)

        async def wait() -> None:
            await later
        return wait()

    dom.submit = submit  # type: ignore[method-assign]
    first = fast.start("all_reduce", x, None, "sum", 0, _Stream(55))
    assert callable(first)
    task = asyncio.ensure_future(first())
    await asyncio.sleep(0)
    assert not host._p2p_seq.idle
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(55)) is False
    pending[0]()  # the last local rank launches it
    later.set_result(None)
    await task
    assert host._p2p_seq.idle
    assert dom.launched


async def test_a_withdrawn_launch_gives_its_event_back(fake_cupy: Any) -> None:
    """A call whose launch never ran (the other local ranks never came: timeout) gives
    the event it took for the communicator's stream back to the pool, and its ticket."""
    fast, host, dom = _calls(fake_cupy)
    x = _Array(100, 16)
    _learned(fast, dom, x)

    def submit(launch: Any, timeout: float, name: str) -> Any:
        async def expired() -> None:
            raise TimeoutError("the other ranks of this process did not make the call")
        return expired()

    dom.submit = submit  # type: ignore[method-assign]
    started = fast.start("all_reduce", x, None, "sum", 0, None)
    assert callable(started)
    with pytest.raises(TimeoutError):
        await started()
    assert dom.launched == []
    assert dom.space.taken == dom.space.given == 1
    assert host._p2p_seq.idle


# ---------------------------------------------------------------- the native launcher
# The same route with acoll's C launcher (src/acoll/_native/launch.c) against the
# recording stand-in for the CUDA driver (tests/fake_libcuda.c).

@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from acoll._cuda.launcher import Launcher
    from fake_driver import FakeDriver, build_launcher_and_fake
    lib, fake = build_launcher_and_fake(tmp_path_factory.mktemp("native"))
    return Launcher(str(lib), driver=str(fake)), FakeDriver(fake)


class _NativeDomain(_Domain):
    """The domain's bookkeeping that native launches use, as the real one keeps it."""

    def __init__(self, lau: Any) -> None:
        super().__init__()
        self.launcher, self.ctx, self.epoch = lau, 0xC1, 40
        self._last_event: Any = None
        self._last_ptr = -1
        self.rank = 0

    def next_mark(self) -> _Event:
        return _Event()

    def args_for(self, step: Any, **kw: Any) -> tuple[Any, Any]:
        """A real parameter block whose first parameter is the epoch (the stand-in
        driver records the word the first parameter points to at each launch)."""
        import ctypes

        from acoll._p2p.domain import EPOCH_OFFSET, _Args
        a = _Args()
        a.inp = kw["in_ptr"]
        return a, (ctypes.c_void_p * 1)(ctypes.addressof(a) + EPOCH_OFFSET)

    def marked(self, stream: Any, event: Any) -> None:
        self._last_event, self._last_ptr, self.last = event, stream.ptr, event

    def launch_failed(self, code: int, at: int) -> TransportError:
        from acoll._p2p.domain import P2PDomain
        return P2PDomain.launch_failed(self, code, at)  # type: ignore[arg-type]


def _native_calls(fake_cupy: Any, lau: Any) -> tuple[Any, _Host, _NativeDomain]:
    from acoll._p2p.fast import PreparedCalls
    host, dom = _Host(), _NativeDomain(lau)
    dom.space.current = fake_cupy.cuda.current
    return PreparedCalls(host, dom), host, dom  # type: ignore[arg-type]


async def test_native_a_call_on_a_stream_is_one_driver_sequence(fake_cupy: Any,
                                                                native: Any) -> None:
    lau, fake = native
    fast, host, dom = _native_calls(fake_cupy, lau)
    x, st = _Array(100, 16), _Stream(55)
    _learned(fast, dom, x, copies=True)
    fake.reset(ctx=0xC0)
    assert fast.start("all_reduce", x, None, "sum", 0, st) is True
    event = dom.last
    assert fake.log() == [
        ("G", 0xC0), ("S", 0xC1),
        ("C", 900, 100, 64, 55, 0xC1),      # the copy into the workspace, then the steps
        ("L", 1234, 4, 512, 55, 41), ("L", 1234, 2, 512, 55, 42),  # each its epoch
        ("R", event.ptr, 55, 0xC1), ("S", 0xC0)]
    assert dom.launched == []  # (nothing through the Python route)
    prep = next(iter(fast.calls.values()))
    assert [a.epoch for _, a, _, _ in prep.steps] == [41, 42]
    assert dom.epoch == 42
    assert dom.copied == 64
    assert (fast.hits, host._exec.seq) == (1, 1)
    assert host._p2p_seq.idle
    assert fake_cupy.cuda.runtime.device == 0  # CuPy's device never touched
    # the next call on another stream is ordered after this launch
    fake.reset(ctx=0xC0)
    assert fast.start("all_reduce", x, None, "sum", 0, _Stream(66)) is True
    assert ("W", 66, event.ptr, 0, 0xC1) in fake.log()
    assert [a.epoch for _, a, _, _ in prep.steps] == [43, 44]


async def test_native_without_a_stream_goes_to_the_communicators_stream(
        fake_cupy: Any, native: Any) -> None:
    lau, fake = native
    fast, _, dom = _native_calls(fake_cupy, lau)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    fake.reset(ctx=0xC0)
    assert fast.start("all_reduce", x, None, "sum", 0, None) is True
    log = fake.log()
    ready = next(row for row in log if row[0] == "R")
    assert ready[2] == fake_cupy.cuda.current.ptr  # recorded on the caller's stream
    own = dom.space.stream.ptr
    assert ("W", own, ready[1], 0, 0xC1) in log  # our stream waits for it
    assert [row[4] for row in log if row[0] == "L"] == [own, own]
    assert ("R", dom.last.ptr, own, 0xC1) in log
    assert not any(row[0] == "W" and row[1] == fake_cupy.cuda.current.ptr for row in log)
    assert ("Q", dom.last.ptr) in log  # polled natively
    assert dom.checks == 1
    assert dom.space.taken == dom.space.given == 1


@pytest.mark.parametrize(("kind", "nth", "stream", "call"), [
    ("L", 2, 55, "cuLaunchKernel"),  # the second step's kernel, on the caller's stream
    ("R", 1, None, "cuEventRecord")])  # the caller's event, before anything launched
async def test_native_a_failed_driver_call_fails_the_communicator_naming_it(
        fake_cupy: Any, native: Any, kind: str, nth: int, stream: int | None,
        call: str) -> None:
    lau, fake = native
    fast, host, dom = _native_calls(fake_cupy, lau)
    x = _Array(100, 16)
    _learned(fast, dom, x)
    fake.reset(ctx=0xC0)
    fake.fail(kind, nth, 719)
    with pytest.raises(TransportError, match=rf"{call} returned CUresult 719"):
        fast.start("all_reduce", x, None, "sum", 0,
                   None if stream is None else _Stream(stream))
    assert len(host.failed_with) == 1
    assert host._p2p_seq.idle
    assert fake.current == 0xC0
    assert dom.space.taken == dom.space.given  # (the caller's event went back)
    if kind == "R":
        assert not any(row[0] == "L" for row in fake.log())


async def test_native_a_failed_wait_of_the_callers_stream_still_marks_the_launch(
        fake_cupy: Any, native: Any) -> None:
    """Ranks sharing a GPU launch on their own stream even with stream=, and the
    caller's stream then waits for the launch's event; if only that wait fails, the
    kernels run: the launch is noted (the next launch orders after it) and the caller's
    event goes back, as on the Python route."""
    lau, fake = native
    fast, host, dom = _native_calls(fake_cupy, lau)
    dom.shares_gpu = True
    x, st = _Array(100, 16), _Stream(55)
    _learned(fast, dom, x)
    fake.reset(ctx=0xC0)
    fake.fail("W", 2, 719)  # the first wait is ours on the caller's event; then this
    with pytest.raises(TransportError, match=r"caller's stream\) returned CUresult 719"):
        fast.start("all_reduce", x, None, "sum", 0, st)
    own = dom.space.stream.ptr
    assert ("W", st.ptr, dom.last.ptr, 0, 0xC1) in fake.log()
    assert dom._last_ptr == own
    assert dom.space.taken == dom.space.given == 1
    assert len(host.failed_with) == 1


async def test_native_local_ranks_launch_in_one_c_call_each_learning_its_outcome(
        fake_cupy: Any, native: Any) -> None:
    from acoll._p2p.domain import LocalLaunch
    lau, fake = native
    group = LocalLaunch(2)
    ranks = [_native_calls(fake_cupy, lau) for _ in range(2)]
    for r, (_, _, dom) in enumerate(ranks):
        dom.rank, dom.ctx = r, 0xC1 + r

        def submit(launch: Any, timeout: float, name: str, r: int = r) -> Any:
            fut = group.submit(0, r, launch)
            if fut is None:
                return None

            async def wait() -> None:
                await fut
            return wait()
        dom.submit = submit  # type: ignore[method-assign]
    xs = [_Array(100 + 1000 * r, 16) for r in range(2)]
    for (fast, _, dom), x in zip(ranks, xs, strict=True):
        _learned(fast, dom, x)
    fake.reset(ctx=0xC0)
    fake.fail("L", 1, 719)  # rank 0's first kernel
    first = ranks[0][0].start("all_reduce", xs[0], None, "sum", 0, _Stream(55))
    assert callable(first)  # waits for rank 1, which launches both
    assert fake.log() == []
    assert ranks[1][0].start("all_reduce", xs[1], None, "sum", 0, _Stream(66)) is True
    log = fake.log()
    assert sum(row[0] == "G" for row in log) == 1  # one C call for both ranks
    assert [row[1] for row in log if row[0] == "S"] == [0xC1, 0xC2, 0xC0]
    assert [row[4] for row in log if row[0] == "L"] == [55, 66, 66]  # rank 0 stopped
    with pytest.raises(TransportError, match="cuLaunchKernel returned CUresult 719"):
        await first()
    assert ranks[1][1].failed_with == []  # (rank 0's executor fails its communicator)
    assert ranks[1][2]._last_ptr == 66
    assert ranks[0][2]._last_ptr == -1  # rank 0 never recorded its event


class _Job:
    def __init__(self) -> None:
        self.value = 0


class _BatchLauncher:
    """Records what LocalLaunch hands the native launcher."""

    def __init__(self) -> None:
        self.runs: list[int] = []
        self.arrays: dict[int, list[_Job]] = {}

    def jobs(self, n: int) -> list[_Job]:
        return self.arrays.setdefault(n, [_Job() for _ in range(n)])

    def run(self, jobs: Any, n: int) -> int:
        self.runs.append(n)
        return 0


class _Rank:
    def __init__(self, lau: Any, rank: int, log: list[Any], fail_fill: bool = False,
                 fail_finish: bool = False) -> None:
        self.launcher, self.rank, self.log = lau, rank, log
        self.fail_fill, self.fail_finish = fail_fill, fail_finish

    def __call__(self) -> None:
        self.log.append(("alone", self.rank))

    def fill(self, job: _Job) -> None:
        if self.fail_fill:
            raise TransportError(f"fill {self.rank}")
        job.value = self.rank
        self.log.append(("fill", self.rank))

    def finish(self, job: _Job) -> None:
        assert job.value == self.rank
        if self.fail_finish:
            raise TransportError(f"finish {self.rank}")
        self.log.append(("finish", self.rank))


async def test_local_ranks_native_launches_are_one_c_call_errors_to_their_rank() -> None:
    from acoll._p2p.domain import LocalLaunch
    lau, log = _BatchLauncher(), []
    group = LocalLaunch(3)
    f0 = group.submit(0, 2, _Rank(lau, 2, log, fail_finish=True))
    f1 = group.submit(0, 0, _Rank(lau, 0, log, fail_fill=True))
    assert f0 is not None
    assert f1 is not None
    assert group.submit(0, 1, _Rank(lau, 1, log)) is None  # the last one launches all
    assert lau.runs == [2]  # one C call for the two that filled their job
    assert log == [("fill", 1), ("fill", 2), ("finish", 1)]
    with pytest.raises(TransportError, match="finish 2"):
        f0.result()
    with pytest.raises(TransportError, match="fill 0"):
        f1.result()
    # the caller's own error is raised to it
    group2 = LocalLaunch(2)
    f2 = group2.submit(0, 0, _Rank(lau, 0, log))
    with pytest.raises(TransportError, match="finish 1"):
        group2.submit(0, 1, _Rank(lau, 1, log, fail_finish=True))
    assert f2 is not None
    assert f2.result() is None
    # launches that are not all native (or of another launcher) run one by one
    log.clear()
    group3 = LocalLaunch(2)
    f3 = group3.submit(0, 1, _Rank(_BatchLauncher(), 1, log))
    assert group3.submit(0, 0, _Rank(lau, 0, log)) is None
    assert log == [("alone", 0), ("alone", 1)]
    assert f3 is not None
    assert f3.result() is None
