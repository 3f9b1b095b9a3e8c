"""A fake device memory space: host NumPy memory that acoll must treat as device memory.

It drives the device code paths on a CPU: argument adoption (host buffers and buffers of
another "device" are refused), stream ordering hooks, settling, and above all staging
(:mod:`acoll._transport.staged`): its buffers have no host view (``byte_view`` raises, as
for CUDA), so a transport that moves host memory can carry them only through the staging
copies. Downloads complete *later* (their fence passes on a later loop iteration, and the
bytes are copied only then, as a real asynchronous copy would land), so a send posted
before its copy finished would carry stale bytes and fail the exact result checks.

For transports that touch device memory themselves (GPUDirect RDMA), :meth:`FakeDeviceSpace.
enqueue` queues "stream work" (a callable) that runs only when a later fence of the space
passes (:meth:`~FakeDeviceSpace.fence`, a copy's fence): a NIC that read or wrote the
buffer before waiting for the fence would see or clobber the wrong bytes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from acoll._dtypes import ReduceOp, as_host_array, avg_factor, scale_into
from acoll._memory import (
    Buffer,
    CopySignals,
    Fence,
    HostSpace,
    MemoryKind,
    MemorySpace,
    SignalledStaging,
)
from acoll._memory.base import DType, Pace, StreamOrder
from acoll.errors import InvalidUsage


class FakeDevArray:
    """A NumPy array "on" fake device ``device``; slices share memory."""

    def __init__(self, arr: np.ndarray[Any, Any], device: int = 0) -> None:
        self.arr, self.device = arr, device

    def __getitem__(self, items: Any) -> FakeDevArray:
        return FakeDevArray(self.arr[items], self.device)

    @property
    def size(self) -> int:
        return int(self.arr.size)

    def get(self) -> np.ndarray[Any, Any]:
        """A host copy."""
        return self.arr.copy()


class _Done(Fence):
    def done(self) -> bool:
        return True

    async def wait(self, deadline: float | None = None) -> None:
        return


class _Later(Fence):
    """Passes ``iterations`` loop iterations after it was made, running ``then`` first."""

    def __init__(self, then: Any, iterations: int) -> None:
        self._done = False
        self._then = then
        loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

        def step(left: int) -> None:
            if left:
                loop.call_soon(step, left - 1)
                return
            self._then()
            self._done = True
            self._event.set()

        loop.call_soon(step, iterations)

    def done(self) -> bool:
        return self._done

    async def wait(self, deadline: float | None = None) -> None:
        await self._event.wait()


class _Counted(Fence):
    """``fence``, counting the waits on it in ``staging.upload_waits``."""

    def __init__(self, fence: Fence, staging: FakeStaging) -> None:
        self.fence, self.staging = fence, staging

    def done(self) -> bool:
        return self.fence.done()

    async def wait(self, deadline: float | None = None) -> None:
        self.staging.upload_waits += 1
        await self.fence.wait(deadline)


class _Flag(Fence):
    """Passes when :meth:`set` is called."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    async def wait(self, deadline: float | None = None) -> None:
        await self._event.wait()


class FakeStaging(SignalledStaging):
    #: whether blocks get copy counters (the native ring's staged copies); tests turn it
    #: off for whole copies
    signalled = True

    def __init__(self, delay: int, device: int | None = None,
                 before: Any = None) -> None:
        super().__init__()
        self._signals: dict[int, CopySignals] = {}
        self.piece_downloads = self.piece_uploads = 0
        self.piece_upload_fences: list[Fence] = []  # (each passes once all its pieces went)
        self.delay = delay
        self.device = device
        self._before = before if before is not None else (lambda: None)
        self._host = HostSpace()
        self.downloads = self.uploads = self.upload_waits = 0
        self.on_streams: list[tuple[str, Any]] = []  # copies on a caller's stream
        self.owns: list[bool] = []  # per such copy: whether it asked for a fence of its own

    def _allocate(self, nbytes: int) -> Buffer:
        return self._host.wrap(np.empty(nbytes, np.uint8))

    @staticmethod
    def _bytes(buf: Buffer) -> np.ndarray[Any, Any]:
        return buf.array.reshape(-1).view(np.uint8)  # type: ignore[no-any-return]

    def download(self, dst: Buffer, src: Buffer) -> Fence:
        assert dst.kind is MemoryKind.HOST
        assert src.kind is MemoryKind.CUDA
        self.downloads += 1
        d, s = self._bytes(dst), self._bytes(src)

        def copy() -> None:
            self._before()  # stream work queued before the copy runs first
            d[...] = s

        if not self.delay:
            copy()
            return _Done()
        return _Later(copy, self.delay)

    def caller_stream(self, stream: Any) -> Any:
        if stream is not None and not isinstance(stream, str):
            raise InvalidUsage("stream= must be a str on a fake device")
        return stream

    def download_on(self, stream: Any, dst: Buffer, src: Buffer,
                    after: Fence | None = None, *, own: bool = False) -> Fence:
        assert after is None or after.done()  # (fake uploads finish at once)
        self.on_streams.append(("download", stream))
        self.owns.append(own)
        return self.download(dst, src)

    def upload_on(self, stream: Any, dst: Buffer, src: Buffer, *, own: bool = False
                  ) -> Fence:
        self.on_streams.append(("upload", stream))
        self.owns.append(own)
        return self.upload(dst, src)

    def upload(self, dst: Buffer, src: Buffer) -> Fence:
        assert dst.kind is MemoryKind.CUDA
        assert src.kind is MemoryKind.HOST
        self.uploads += 1
        self._before()
        self._bytes(dst)[...] = self._bytes(src)  # later "stream" work runs after it
        return _Counted(_Done(), self)


    def signals(self, block: Buffer) -> CopySignals | None:
        if not self.signalled:
            return None
        found = self._signals.get(block.ptr)
        if found is None:
            words = np.full(32, 0xFFFFFFF8, np.uint32)  # (wraps around within a few ops)
            found = self._signals[block.ptr] = CopySignals(words, int(words.ctypes.data))
        return found

    def download_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                           pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        """Piece ``i`` lands ``delay + i`` loop iterations from now (in order), then bumps
        the ready counter."""
        self.on_streams.append(("download", stream))
        self.owns.append(True)
        self.downloads += 1
        d, s = self._bytes(dst), self._bytes(src)
        last: Fence = _Done()
        for i, (a, b) in enumerate(pieces):
            def land(a: int = a, b: int = b, value: int = signals.ready_value(i)) -> None:
                self._before()
                d[a:b] = s[a:b]
                self.piece_downloads += 1
                signals.words[signals.READY] = value

            if self.delay:
                last = _Later(land, self.delay + i)
            else:
                land()
        return last

    def upload_pieces_on(self, stream: Any, dst: Buffer, src: Buffer,
                         pieces: list[tuple[int, int]], signals: CopySignals) -> Fence:
        """A poller on the loop copies each piece once the final counter lets it (as a
        device stream waiting on the counter would), in order."""
        self.on_streams.append(("upload", stream))
        self.owns.append(True)
        self.uploads += 1
        d, s = self._bytes(dst), self._bytes(src)
        loop = asyncio.get_running_loop()
        fence = _Flag()
        at = [0]

        def poll() -> None:
            i = at[0]
            while i < len(pieces) and ((int(signals.words[signals.FINAL])
                                        - signals.final_value(i)) & 0xFFFFFFFF) < 1 << 31:
                a, b = pieces[i]
                d[a:b] = s[a:b]
                self.piece_uploads += 1
                i += 1
            at[0] = i
            if i == len(pieces):
                fence.set()
            else:
                loop.call_later(0.0002, poll)

        poll()
        self.piece_upload_fences.append(fence)
        return fence


    def join_on(self, stream: Any, fence: Fence) -> None:
        self.on_streams.append(("join", stream))


class _FakeOrder(StreamOrder):
    def __init__(self, space: FakeDeviceSpace, stream: Any) -> None:
        self.space, self.stream, self.settle = space, stream, stream is None

    def start(self) -> None:
        self.space.events.append(("start", self.stream))

    def finish(self) -> None:
        self.space.events.append(("finish", self.stream))


class FakeDeviceSpace(MemorySpace):
    """Fake device ``device`` (see the module docstring); ``delay``: loop iterations a
    download takes (0: synchronous)."""

    kind = MemoryKind.CUDA
    delay = 2

    def __init__(self, device: int) -> None:
        self.device = device
        self._host = HostSpace()
        self._staging = FakeStaging(self.delay, device, self._run_pending)
        self.events: list[tuple[str, Any]] = []
        self.settles = 0
        self.pending: list[Any] = []  # "stream work" queued by enqueue()
        self.fences = 0

    def enqueue(self, work: Any) -> None:
        """Queue ``work()`` on the fake stream: it runs when a later fence passes."""
        self.pending.append(work)

    def _run_pending(self) -> None:
        work, self.pending = self.pending, []
        for fn in work:
            fn()

    def fence(self) -> Fence:
        """Passes ``delay`` loop iterations from now, after the work queued so far."""
        self.fences += 1
        queued, self.pending = self.pending, []

        def run() -> None:
            for fn in queued:
                fn()

        if not self.delay:
            run()
            return _Done()
        return _Later(run, self.delay)

    def __repr__(self) -> str:
        return f"fake device {self.device}"

    def adopt(self, obj: Any, what: str, *, writable: bool = False) -> Buffer:
        if not isinstance(obj, FakeDevArray):
            raise InvalidUsage(f"{what} is in host memory; this communicator uses fake "
                               f"device {self.device}")
        if obj.device != self.device:
            raise InvalidUsage(f"{what} is on fake device {obj.device}; this communicator "
                               f"uses fake device {self.device}")
        return Buffer(as_host_array(obj.arr, what, writable=writable), self)

    def empty(self, count: int, dtype: DType) -> Buffer:
        return Buffer(self._host.empty(count, dtype).array, self)

    def scratch(self, count: int, dtype: DType, slot: int = 0) -> Buffer:
        return Buffer(self._host.scratch(count, dtype, slot).array, self)

    async def reduce(self, out: Buffer, a: Buffer, b: Buffer, op: ReduceOp,
                     pace: Pace) -> None:
        await self._host.reduce(out, a, b, op, pace)

    async def finish_avg(self, buf: Buffer, n: int, pace: Pace) -> None:
        await self._host.finish_avg(buf, n, pace)

    async def copy(self, dst: Buffer, src: Buffer, pace: Pace) -> None:
        await self._host.copy(dst, src, pace)

    async def scale(self, dst: Buffer, src: Buffer, n: int, pace: Pace) -> None:
        await self._host.scale(dst, src, n, pace)

    def scale_at_call(self, stream: Any, dst: Buffer | None, src: Buffer, n: int) -> Buffer:
        """At once (the fake stream runs work as it is enqueued), recorded in ``events``."""
        self.order(stream)  # (refuses a bad stream as order() does)
        if dst is None:
            dst = self.empty(src.count, src.dtype)
        scale_into(dst.array, src.array, avg_factor(src.dtype, n))
        self.events.append(("scale", stream))
        return dst

    async def settle(self, deadline: float | None = None) -> None:
        self.settles += 1

    def pointer(self, buf: Buffer) -> int:
        return int(buf.array.__array_interface__["data"][0])

    def byte_view(self, buf: Buffer) -> memoryview:
        raise InvalidUsage("fake device memory has no host view")

    def order(self, stream: Any) -> StreamOrder:
        if stream is not None and not isinstance(stream, str):
            raise InvalidUsage("stream= must be a str on a fake device")
        return _FakeOrder(self, stream)

    def staging(self) -> FakeStaging:
        return self._staging


def to_dev(device: int = 0) -> Any:
    """``check_all``'s ``dev``: a NumPy array copied to fake device ``device``."""
    return lambda arr: FakeDevArray(np.array(arr, copy=True), device)


def to_host(buf: FakeDevArray) -> np.ndarray[Any, Any]:
    return buf.get()
