"""A collective on the P2P path, run by the communicator's executor like any algorithm.

The call's steps are launched in the order the calls were made (a ticket taken at the
call, so that ops of one group whose kernels compile at different speeds still launch in
the same order on every rank), each preceded in copy mode by the copies of this rank's
pieces into its workspace, all on the communicator's stream, fitted into the caller's
stream by ``order``. Without ``stream=`` the op then waits (off the loop thread) for the
stream and raises what the kernels recorded; with ``stream=`` an error surfaces at the
next call.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from .._cuda.p2p_kernels import Mode, P2PSource
from .._memory.base import Buffer, StreamOrder
from ..errors import again
from .domain import P2PDomain
from .plan import Step, pack_sig

__all__ = ["P2POp", "Sequencer"]

_DEFAULT = 4  # cudaMemcpyDefault


class Sequencer:
    """Hands out tickets at call time; :meth:`turn` waits until every earlier ticket is
    :meth:`done`."""

    def __init__(self) -> None:
        self._next = 0
        self._served = 0
        self._finished: set[int] = set()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._error: BaseException | None = None

    @property
    def idle(self) -> bool:
        """No ticket is waiting for its turn and none failed."""
        return self._served == self._next and self._error is None

    def ticket(self) -> int:
        self._next += 1
        return self._next - 1

    def ready(self, ticket: int) -> bool:
        """True when ``ticket`` may go now (no earlier ticket is pending)."""
        if self._error is not None:
            raise again(self._error)
        return ticket == self._served

    async def turn(self, ticket: int) -> None:
        if self.ready(ticket):
            return
        fut = self._waiters[ticket] = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            self._waiters.pop(ticket, None)

    def fail(self, error: BaseException) -> None:
        """Make every waiting and later :meth:`turn` raise ``error`` (the communicator
        failed: earlier tickets may never be done)."""
        if self._error is None:
            self._error = error
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(error)

    def done(self, ticket: int) -> None:
        self._finished.add(ticket)
        while self._served in self._finished:
            self._finished.discard(self._served)
            self._served += 1
        fut = self._waiters.get(self._served)
        if fut is not None and not fut.done():
            fut.set_result(None)


class P2POp:
    """One call: ``steps`` of ``src`` between ``send`` and ``recv`` (see module doc)."""

    __slots__ = ("dom", "dtype_code", "name", "op", "order", "recv", "root", "send", "seq",
                 "src", "steps", "ticket", "timeout", "total")

    def __init__(self, dom: P2PDomain, seq: Sequencer, order: StreamOrder, timeout: float,
                 src: P2PSource, steps: list[Step], send: Buffer, recv: Buffer, *,
                 root: int, op: int, dtype_code: int, total: int, name: str) -> None:
        self.dom, self.seq, self.order, self.timeout = dom, seq, order, timeout
        self.src, self.steps, self.send, self.recv = src, steps, send, recv
        self.root, self.op, self.dtype_code, self.total, self.name = (root, op, dtype_code,
                                                                      total, name)
        self.ticket = seq.ticket()

    def placement(self) -> tuple[bool, tuple[int, int] | None, tuple[int, int] | None]:
        """Where peers read this rank's data: ``(own_ws, in_reg, out_reg)``.

        The workspace when peers would otherwise read memory this rank overwrites during
        the step (in-place one-shot all-reduce or all-to-all), or when they cannot reach
        its buffers (other processes, buffers not registered); else the buffers in place
        (same process: by pointer; registered: by registration and offset).
        """
        mode = self.steps[0].mode if self.steps else -1
        send, recv = self.send, self.recv
        if mode in (Mode.ALL_REDUCE_ONE_SHOT, Mode.ALL_TO_ALL) and \
                send.ptr < recv.ptr + recv.nbytes and recv.ptr < send.ptr + send.nbytes:
            return True, None, None
        if self.dom.direct:
            return False, None, None
        rin = self.dom.registered(send.ptr, send.nbytes)
        rout = self.dom.registered(recv.ptr, recv.nbytes) if rin is not None else None
        if rin is None or rout is None:
            return True, None, None
        return False, rin, rout

    def describe(self) -> str:
        return _describe(self.name, self.total, self.send.dtype)

    async def run(self) -> None:
        dom = self.dom
        try:
            dom.check()
            kern = dom.loaded(self.src) or await dom.kernel(self.src)
            if not self.seq.ready(self.ticket):
                await self.seq.turn(self.ticket)
            dom.check()
            waiter = dom.submit(lambda: self._enqueue(kern), self.timeout, self.name)
            if waiter is not None:
                await waiter
        finally:
            self.seq.done(self.ticket)
        if self.order.settle:
            await dom.space.settle(asyncio.get_running_loop().time() + self.timeout)
            dom.check()

    def launches(self) -> list[tuple[Step, list[tuple[int, int, int]], dict[str, Any]]]:
        """Per step: the step in kernel units, the copies into the workspace that go
        before it (``(dst, src, nbytes)``), and the launch's arguments (see
        :meth:`P2PDomain.launch`): all fixed by the buffers' addresses, the plan and the
        registrations made so far."""
        dom = self.dom
        isz = self.send.dtype.itemsize
        copy_kernel = self.src.dtype is None
        own_ws, rin, rout = self.placement()
        reg = 0 if rin is None or rout is None else (rin[0] + 1) | (rout[0] + 1) << 16
        out = []
        for step in self.steps:
            copies = [(dom.workspace + piece.dst * isz, self.send.ptr + piece.src * isz,
                       piece.count * isz) for piece in (step.pieces if own_ws else ())]
            args = {
                "own_ws": own_ws, "total": self.total, "root": self.root, "reg": reg,
                "mode_sig": pack_sig(step.mode, self.dtype_code, self.op, self.root,
                                     step.index),
                "in_ptr": self.send.ptr + step.in_off * isz,
                "out_ptr": self.recv.ptr + step.out_off * isz,
                "reg_in_off": 0 if rin is None else rin[1] + step.in_off * isz,
                "reg_out_off": 0 if rout is None else rout[1] + step.out_off * isz}
            out.append((_scaled(step, isz) if copy_kernel else step, copies, args))
        return out

    def _enqueue(self, kern: Any) -> None:
        dom = self.dom
        memcpy = dom.cp.cuda.runtime.memcpyAsync
        stream = dom.space.stream
        # (what a mismatch report says this rank called: not a method of this op, which
        # holds the call's arrays until the domain's next call)
        dom.mine = functools.partial(_describe, self.name, self.total, self.send.dtype)
        try:
            self.order.start()
            with dom.cp.cuda.Device(dom.device):
                dom.follow(stream)
                for step, copies, args in self.launches():
                    for dst, src, nbytes in copies:
                        dom.copied += nbytes
                        memcpy(dst, src, nbytes, _DEFAULT, stream.ptr)
                    dom.launch(kern, self.src, step, **args)
                dom.mark(stream)
            self.order.finish()
        except Exception as exc:
            err = dom.translated(exc)
            if err is None:
                raise
            raise err from exc


def _describe(name: str, total: int, dtype: Any) -> str:
    return f"{name} of {total} x {dtype}"


def _scaled(step: Step, unit: int) -> Step:
    """A step in kernel units (bytes for the copy kernel)."""
    if unit == 1:
        return step
    return Step(step.mode, step.index, step.n * unit, step.in_off * unit,
                step.out_off * unit, step.out_stride * unit, step.src_stride * unit,
                step.user_stride * unit, step.pieces, step.blocks)
