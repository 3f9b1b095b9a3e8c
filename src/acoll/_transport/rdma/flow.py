"""Flow control of one RDMA connection: receive credits and the rendezvous tables (sans-IO).

Receive credits
    Each end keeps ``depth`` receives posted on its queue pair. Every SEND, and every RDMA
    WRITE with immediate, consumes one of the peer's receives; sending when the peer has
    none posted would be an RNR error. :class:`Credits` counts the peer's posted receives
    this end may still consume, and the receives this end has re-posted but not yet
    reported (``owed``). Every frame carries the owed count back. The last credit is kept
    for a ``CREDIT`` frame, which only returns credits: a ``CREDIT`` frame goes out when
    half the depth is owed, or as soon as anything is owed while the peer may be down to
    its reserve, so neither end can wait for credits that nobody will return.

Rendezvous (NCCL's "CTS fifo", driven by the receiver)
    A message above the eager size is announced by ``RTS``; once the receive for it is
    posted the receiver answers ``CTS`` with the buffer's address and rkey and a
    receive id, and the sender writes the message into it in chunks, the last one with
    the receive id as immediate data. :class:`SendTable` follows the sender's messages
    (``send id`` -> state), :class:`RecvTable` the receives that advertised a buffer
    (``receive id`` -> receive). Anything that does not fit (a CTS for an unknown send, a
    size that differs, an immediate for no receive) is a :class:`ProtocolError`.

:func:`chunks` cuts a write into pieces of at most ``chunk`` bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Generic, TypeVar

from ...errors import ProtocolError

__all__ = ["Credits", "RecvTable", "SendState", "SendTable", "chunks"]

T = TypeVar("T")
_U32 = 1 << 32


class Credits:
    """Receive credits of one connection (see the module doc).

    Args:
        window: receives the peer keeps posted for us (its depth).
        depth: receives we keep posted for the peer.
        reserve: credits only a ``CREDIT`` frame may use.
    """

    __slots__ = ("_peer_left", "available", "depth", "owed", "reserve", "window")

    def __init__(self, window: int, depth: int | None = None, reserve: int = 1) -> None:
        depth = window if depth is None else depth
        for name, value in (("window", window), ("depth", depth)):
            if value < 2 * reserve + 2:
                raise ValueError(f"receive {name} {value} is too small (at least "
                                 f"{2 * reserve + 2})")
        self.window = window
        self.depth = depth
        self.reserve = reserve
        self.available = window  # the peer's receives we may consume
        self.owed = 0  # our receives re-posted and not yet reported to the peer
        self._peer_left = depth  # how many of our receives the peer believes it may consume

    def can_send(self, *, credit_frame: bool = False) -> bool:
        """Whether a frame (or write with immediate) may consume a peer receive now."""
        return self.available > (0 if credit_frame else self.reserve)

    def spend(self) -> int:
        """One frame goes out: consume a credit; return the owed count it carries back
        (0 for a write with immediate, which carries nothing: call :meth:`spend_silent`)."""
        if self.available <= 0:
            raise RuntimeError("no receive credit left")  # a caller bug: check can_send
        self.available -= 1
        returned, self.owed = self.owed, 0
        self._peer_left += returned
        return returned

    def spend_silent(self) -> None:
        """A write with immediate goes out: it consumes a credit and carries none back."""
        if self.available <= 0:
            raise RuntimeError("no receive credit left")
        self.available -= 1

    def arrived(self, returned: int) -> None:
        """The peer consumed one of our receives with a frame returning ``returned``
        credits (0 for a write with immediate).

        Raises:
            ProtocolError: the peer returned more credits than it was given, or consumed
                a receive it had no credit for.
        """
        if self._peer_left <= 0:
            raise ProtocolError("the peer sent without a receive credit")
        self._peer_left -= 1
        if returned < 0 or self.available + returned > self.window:
            raise ProtocolError(f"the peer returned {returned} credits; only "
                                f"{self.window - self.available} were outstanding")
        self.available += returned

    def reposted(self, n: int = 1) -> None:
        """``n`` of our receives were consumed and posted again."""
        self.owed += n

    def should_return(self) -> bool:
        """Whether a ``CREDIT`` frame should go out now (when there is nothing else to
        carry the owed credits back)."""
        if not self.owed:
            return False
        return self.owed >= self.depth // 2 or self._peer_left <= self.reserve + 1


class SendState(enum.Enum):
    WAITING = "waiting for CTS"
    WRITING = "writing"
    PUSHING = "pushed as DATA (closing)"


class SendTable(Generic[T]):
    """The sender's rendezvous messages: ``send id`` -> (state, total, the owner's item)."""

    def __init__(self) -> None:
        self._next = 1
        self._sends: dict[int, tuple[SendState, int, T]] = {}

    def __len__(self) -> int:
        return len(self._sends)

    def add(self, total: int, item: T) -> int:
        """A new rendezvous message; returns its send id (unique among those held)."""
        while True:
            sid = self._next
            self._next = self._next + 1 if self._next < _U32 - 1 else 1
            if sid not in self._sends:
                break
        self._sends[sid] = (SendState.WAITING, total, item)
        return sid

    def cts(self, sid: int, size: int) -> T | None:
        """A CTS for ``sid`` advertising ``size`` bytes arrived. Returns the item to write
        (now WRITING), or ``None`` when the message is being pushed instead (the CTS
        crossed the push; it is ignored).

        Raises:
            ProtocolError: unknown or already answered send id, or a size other than the
                message's.
        """
        state, total, item = self._get(sid, "CTS")
        if state is SendState.PUSHING:
            return None
        if state is not SendState.WAITING:
            raise ProtocolError(f"a second CTS for send {sid}")
        if size != total:
            raise ProtocolError(f"CTS for send {sid} advertises {size} bytes for a message "
                                f"of {total}")
        self._sends[sid] = (SendState.WRITING, total, item)
        return item

    def drop(self, sid: int) -> T | None:
        """The receiver dropped ``sid`` (size mismatch): forget it and return its item; or
        ``None`` when it is being pushed (the receiver drops the parts; the push ends it).

        Raises:
            ProtocolError: unknown send id, or one already being written.
        """
        state, _total, item = self._get(sid, "DROP")
        if state is SendState.WRITING:
            raise ProtocolError(f"DROP for send {sid}, which is being written")
        if state is SendState.PUSHING:
            return None  # the push finishes it (:meth:`done`)
        del self._sends[sid]
        return item

    def push(self) -> list[tuple[int, T]]:
        """Closing: every message still waiting for a CTS is pushed as DATA instead;
        returns them (send id, item) in send order. They stay until :meth:`done`."""
        out = []
        for sid, (state, total, item) in self._sends.items():
            if state is SendState.WAITING:
                self._sends[sid] = (SendState.PUSHING, total, item)
                out.append((sid, item))
        return out

    def done(self, sid: int) -> T:
        """The message's last write or last pushed part completed: forget it."""
        return self._sends.pop(sid)[2]

    def state(self, sid: int) -> SendState | None:
        entry = self._sends.get(sid)
        return None if entry is None else entry[0]

    def items(self) -> list[T]:
        return [item for _, _, item in self._sends.values()]

    def clear(self) -> list[T]:
        out = self.items()
        self._sends.clear()
        return out

    def _get(self, sid: int, what: str) -> tuple[SendState, int, T]:
        entry = self._sends.get(sid)
        if entry is None:
            raise ProtocolError(f"{what} for send {sid}, which this end is not sending")
        return entry


class RecvTable(Generic[T]):
    """The receiver's advertised buffers: ``receive id`` -> the owner's item (a receive
    waiting for its writes). Receive ids are 32-bit (they travel as immediate data)."""

    def __init__(self) -> None:
        self._next = 1
        self._recvs: dict[int, T] = {}

    def __len__(self) -> int:
        return len(self._recvs)

    def add(self, item: T) -> int:
        while True:
            rid = self._next
            self._next = self._next + 1 if self._next < _U32 - 1 else 1
            if rid not in self._recvs:
                break
        self._recvs[rid] = item
        return rid

    def written(self, rid: int) -> T:
        """The write with immediate ``rid`` arrived: the receive is complete.

        Raises:
            ProtocolError: no buffer was advertised under ``rid``.
        """
        item = self._recvs.pop(rid, None)
        if item is None:
            raise ProtocolError(f"RDMA write with immediate {rid:#x} for no advertised buffer")
        return item

    def take(self, rid: int) -> T | None:
        """Remove ``rid`` whatever happens to it next (pushed instead of written)."""
        return self._recvs.pop(rid, None)

    def items(self) -> list[T]:
        return list(self._recvs.values())

    def clear(self) -> list[T]:
        out = list(self._recvs.values())
        self._recvs.clear()
        return out


def chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` pieces of at most ``chunk`` bytes covering ``total`` bytes."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    for offset in range(0, total, chunk):
        yield offset, min(chunk, total - offset)
