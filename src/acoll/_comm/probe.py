"""Asking a silent peer whether it made a call, when that call timed out here.

An op that times out names the rank it was waiting for. Whether that rank is the cause
depends on why it sent nothing: it may not have made the call (stalled elsewhere, or a
bug in its program), or it may be inside the call, itself waiting for a third rank. Only
that rank knows, so the waiting rank asks it, once per op and peer, over their data
connection: a *probe* (an empty message under step :data:`PROBE_STEP` of the op's tag)
answered by a *reply* (step :data:`REPLY_STEP`) whose 16-byte meta says::

    i state (1: has not made the call, 2: has made it; +4: it is not running the call
      but is still in an earlier one) | i rank it waits for, in the call or else in the
      earlier one (-1: none known) | q the number of calls it has made on the communicator

The probe's own meta is the asking rank's descriptor of the call (16 zero bytes: none).
A probed rank running that call with another descriptor (the ranks' counts, dtypes or
ops differ, and so did the algorithms they chose, so that neither sent the other a
message to check) fails with :class:`~acoll.InvalidUsage` naming the difference, after
answering.

A rank whose peer has not made the call, or does not answer within the probe's wait,
names that peer at once, unless the peer is held in an earlier call waiting for a third
rank: that rank is named (the peer waits for it too). A rank whose peer made the call
waits a grace period for the cause to arrive from the rank that found it, so that every
rank reports the same cause; if none comes it names the rank the peer waits for, where
the peer said, else the peer.
A rank whose op has waited a while for a silent peer (one second, then two, four, ...)
also sends it a *descriptor check* (an empty message under step :data:`DESC_STEP`, its
meta the rank's descriptor), which gets no reply: the peer, once it runs that call,
compares as for a probe. So such a disagreement ends in about a second, not at the
deadline. Probes and checks are answered from the connection's arrival callback, outside
any op, and never reach the order checks. The steps lie in the range data steps never use (see
``acoll._coll.algorithms._STEPS``), below the agreement's.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from .._coll.base import consume
from .._deadline import wait_for
from .._memory import host_buffer
from .._transport.base import META_SIZE, Connection
from .ordering import P2P_TAG

__all__ = ["DESC_STEP", "PROBE_STEP", "REPLY_STEP", "PeerState", "answer", "ask",
           "is_desc_check", "is_probe", "pack_state", "send_desc_check", "take",
           "unpack_state"]

PROBE_STEP = 0xFFFFFFC0
REPLY_STEP = 0xFFFFFFC1
DESC_STEP = 0xFFFFFFC2
_STEP_MASK = 0xFFFFFFFF
_NOT_CALLED, _CALLED, _EARLIER = 1, 2, 4
_STATE = struct.Struct("<iiq")


@dataclass(frozen=True)
class PeerState:
    """Where a probed rank stood in the probed call."""

    called: bool  #: it has made the call (it may be running it, or queued behind another)
    waiting_on: int | None  #: the rank it waits for (in ``earlier``'s call if set), if known
    calls: int  #: calls it has made on the communicator
    earlier: bool = False  #: not running the call: still in an earlier one


def pack_state(state: PeerState) -> bytes:
    """The reply's meta for ``state``."""
    waiting = -1 if state.waiting_on is None else state.waiting_on
    code = (_CALLED if state.called else _NOT_CALLED) | (_EARLIER if state.earlier else 0)
    return _STATE.pack(code, waiting, state.calls)


def unpack_state(meta: bytes) -> PeerState | None:
    """The state a reply's meta carries; ``None`` for meta that is not a valid reply."""
    if len(meta) != _STATE.size:
        return None
    code, waiting, calls = _STATE.unpack(meta)
    if code & ~_EARLIER not in (_NOT_CALLED, _CALLED) or waiting < -1 or calls < 0:
        return None
    return PeerState(code & ~_EARLIER == _CALLED, None if waiting < 0 else waiting, calls,
                     bool(code & _EARLIER))


def is_probe(tag: int) -> bool:
    """Whether a message's tag is a probe's (a collective's tag with step PROBE_STEP)."""
    return not tag & P2P_TAG and tag & _STEP_MASK == PROBE_STEP


def is_desc_check(tag: int) -> bool:
    """Whether a message's tag is a descriptor check's (step DESC_STEP)."""
    return not tag & P2P_TAG and tag & _STEP_MASK == DESC_STEP


def send_desc_check(conn: Connection, seq: int, desc: bytes) -> None:
    """Send the peer at the other end of ``conn`` this rank's descriptor ``desc`` of
    collective ``seq`` (no reply comes)."""
    conn.isend(host_buffer(bytearray(0)), (seq << 32) | DESC_STEP,
               desc).add_done_callback(consume)


def take(conn: Connection, tag: int) -> None:
    """Take the empty message that arrived under ``tag`` off ``conn``."""
    conn.irecv(host_buffer(bytearray(0)), tag).add_done_callback(consume)


async def ask(conn: Connection, seq: int, wait: float, desc: bytes = bytes(META_SIZE)
              ) -> PeerState | None:
    """Probe the peer at the other end of ``conn`` about collective ``seq`` (``desc``: this
    rank's packed descriptor of it): its state, or ``None`` when no valid reply came within
    ``wait`` seconds (or the connection broke)."""
    tag = seq << 32
    reply = conn.irecv(host_buffer(bytearray(0)), tag | REPLY_STEP)
    reply.add_done_callback(consume)  # (however this ends: abandoned, it must not log)
    sent = conn.isend(host_buffer(bytearray(0)), tag | PROBE_STEP, desc)
    sent.add_done_callback(consume)
    try:
        meta = await wait_for(asyncio.shield(reply), wait)
    except Exception:  # (timed out, or the connection broke)
        return None
    return unpack_state(meta)


def answer(conn: Connection, probe_tag: int, state: PeerState) -> None:
    """Take the probe that arrived under ``probe_tag`` off ``conn`` and send the reply."""
    take(conn, probe_tag)
    base = probe_tag & ~_STEP_MASK
    conn.isend(host_buffer(bytearray(0)), base | REPLY_STEP,
               pack_state(state)).add_done_callback(consume)
