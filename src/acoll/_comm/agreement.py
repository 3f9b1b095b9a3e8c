"""The rooted-op agreement: every rank learns whether all ranks run the same op.

In a broadcast the root, and in a reduce the leaves, receive nothing, so the descriptor
carried by data messages cannot reach them. Instead every rank computes the smallest and
largest descriptor over all ranks with a dissemination exchange (``ceil(log2 n)`` rounds of
40-byte messages, concurrent with the op itself): when they differ, every rank raises the
same :class:`~acoll.InvalidUsage`, naming the field. The state is ``min descriptor | its
rank | max descriptor | its rank`` (16 + 4 + 16 + 4 bytes).
"""

from __future__ import annotations

import asyncio

from .. import _topology as topo
from .._coll.base import Descriptor, OpContext
from .._memory import host_buffer
from .._transport.base import ConnectionLost
from ..errors import AcollError, InvalidUsage

__all__ = ["CHECK_STEP", "start_agreement"]

#: Steps of the agreement's messages count down from here (data steps count up from 0).
CHECK_STEP = 0xFFFFFFFF
_STATE = 40


async def start_agreement(ctx: OpContext) -> asyncio.Task[None]:
    """Connect, post the receives, and start the exchange as a task; the task raises
    :class:`InvalidUsage` (after failing the communicator) when the ranks disagree.
    Failing the communicator also wakes an op that is stuck because of the disagreement."""
    rounds = topo.dissemination(ctx.rank, ctx.n)
    await ctx.connect(*{p for pair in rounds for p in pair})
    me = ctx.rank.to_bytes(4, "little")
    state = bytearray(ctx.desc.packed + me + ctx.desc.packed + me)
    inbox = [bytearray(_STATE) for _ in rounds]
    recvs = [ctx.post_recv(frm, host_buffer(inbox[i]), CHECK_STEP - i)
             for i, (_, frm) in enumerate(rounds)]

    async def run() -> None:
        try:
            for i, (to, frm) in enumerate(rounds):
                send = ctx.post_send(to, host_buffer(bytes(state)), CHECK_STEP - i)
                try:
                    ctx.progress(recvs[i], frm)
                    ctx.agree_on = frm
                    await recvs[i]
                    ctx.agree_on = to
                    await send
                    ctx.agree_on = None
                except ConnectionLost as exc:
                    raise ctx.host.peer_error(frm, exc) from None
                got = inbox[i]
                if got[:16] < state[:16]:
                    state[:20] = got[:20]
                if got[20:36] > state[20:36]:
                    state[20:] = got[20:]
            if state[:16] != state[20:36]:
                low = Descriptor.unpack(bytes(state[:16]))
                high = Descriptor.unpack(bytes(state[20:36]))
                raise InvalidUsage(low.describe_difference(
                    high, int.from_bytes(state[16:20], "little"),
                    int.from_bytes(state[36:40], "little")))
        except AcollError as exc:
            ctx.host.fail(exc)
            raise

    return asyncio.get_running_loop().create_task(run())
