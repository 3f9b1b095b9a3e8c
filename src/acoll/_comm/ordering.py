"""Spotting ranks that issued different calls, from the messages that reach us early.

Every message carries its sender's descriptor (:class:`~acoll._coll.base.Descriptor`) and
a tag naming the operation's sequence number (collectives) or the pair's send/recv index
(point-to-point, bit 63 set). A message that arrives before any receive was posted for it
is reported here (the transports' arrival callback). Legitimate early arrivals are for
operations this rank will run later; anything else proves that the ranks disagree, and
waiting would only end at the deadline:

- a message for an operation this rank runs (or ran) with another descriptor;
- a send issued before a collective this rank is already past;
- a collective message from a peer this rank waits on in a receive issued before it.

Send/recv stamps: each point-to-point call carries the sequence number of the next
collective when it was issued (:data:`~acoll._coll.base.ANY_SEQ` inside a group, where
order does not matter), so that a send and a recv issued at different places in the two
ranks' call orders are reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .._coll.base import ANY_SEQ, Descriptor
from ..errors import AcollError, InvalidUsage

__all__ = ["P2P_TAG", "SEQ_MASK", "OrderChecker", "p2p_tag"]

P2P_TAG = 1 << 63
SEQ_MASK = 0x7FFFFFFF
_ISSUED_WINDOW = 1024  # sequence numbers whose descriptors are kept for late messages
_DONE_WINDOW = 1024  # completed receives remembered for late arrival notices
_BLOCKED_GRACE = 0.2  # s: messages on other connections may still be on their way


def p2p_tag(index: int) -> int:
    """The tag base of the ``index``-th send (or recv) between a pair of ranks."""
    return P2P_TAG | ((index & SEQ_MASK) << 32)


class OrderChecker:
    """Order and descriptor checks for one communicator (see the module docstring).

    ``fail`` fails the communicator; ``next_seq()`` is the sequence number the next
    collective will get; ``active()`` is false once the communicator failed or closed.
    """

    def __init__(self, rank: int, check: bool, fail: Callable[[AcollError], None],
                 next_seq: Callable[[], int], active: Callable[[], bool]) -> None:
        self.rank = rank
        self.check = check
        self._fail = fail
        self._next_seq = next_seq
        self._active = active
        self._loop = asyncio.get_running_loop()
        # What this rank issued at each recent sequence number, the first foreign
        # descriptor seen for sequence numbers it has not issued yet, and the stamps of its
        # issued, unmatched receives per (peer, index).
        self._issued: dict[int, Descriptor] = {}
        self._early: dict[int, tuple[int, bytes]] = {}
        self.recv_stamps: dict[tuple[int, int], int] = {}
        self.recv_futs: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._p2p_seen: set[tuple[int, int]] = set()  # p2p messages that arrived early
        self._p2p_unclaimed: dict[tuple[int, int], int] = {}  # early sends, recv not issued
        #: the latest receives that completed (a bounded window, oldest first): an early
        #: arrival's notice can come after its receive took the message (the transport
        #: reports arrivals from a later callback), and must then be ignored
        self._p2p_done: dict[tuple[int, int], None] = {}

    def issued(self, seq: int) -> Descriptor | None:
        return self._issued.get(seq)

    def issue(self, seq: int, desc: Descriptor, *, in_group: bool) -> None:
        """Record what this rank runs at ``seq``; compare with what a peer already sent.

        Raises:
            InvalidUsage: a peer's message for ``seq`` describes another operation, or an
                early send can no longer be received in order (the communicator is failed
                first).
        """
        self._issued[seq] = desc
        self._issued.pop((seq - _ISSUED_WINDOW) & SEQ_MASK, None)
        early = self._early.pop(seq, None)
        err: InvalidUsage | None = None
        if early is not None and self.check and early[1] != desc.packed:
            err = InvalidUsage(desc.describe_difference(Descriptor.unpack(early[1]),
                                                        self.rank, early[0]))
        elif self.check and self._p2p_unclaimed and not in_group:
            # A send that arrived early and was stamped before this collective can no
            # longer be matched in order: the recv would come after the collective.
            for (peer, _index), stamp in self._p2p_unclaimed.items():
                if stamp <= seq:
                    err = InvalidUsage(
                        f"send/recv order mismatch between rank {self.rank} and rank "
                        f"{peer}: rank {peer} sent before its collective #{stamp}, but rank "
                        f"{self.rank} reached collective #{seq} without a matching recv")
                    break
        if err is not None:
            self._fail(err)
            raise err

    def recv_issued(self, peer: int, index: int, stamp: int) -> None:
        """A recv from ``peer`` (its ``index``-th) was issued with ``stamp``.

        Raises:
            InvalidUsage: ``peer``'s matching send already arrived with another stamp.
        """
        key = (peer, index & SEQ_MASK)
        self.recv_stamps[key] = stamp
        early_stamp = self._p2p_unclaimed.pop(key, None)
        if early_stamp is not None and stamp not in (early_stamp, ANY_SEQ) and self.check:
            err = InvalidUsage(
                f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
                f"{peer} sent before its collective #{early_stamp}, rank {self.rank} posts "
                f"the recv before collective #{stamp}")
            self._fail(err)
            raise err

    def recv_done(self, peer: int, index: int) -> None:
        key = (peer, index & SEQ_MASK)
        self.recv_stamps.pop(key, None)
        self.recv_futs.pop(key, None)
        self._p2p_seen.discard(key)
        self._p2p_unclaimed.pop(key, None)
        self._p2p_done[key] = None
        if len(self._p2p_done) > _DONE_WINDOW:
            del self._p2p_done[next(iter(self._p2p_done))]

    def on_arrival(self, peer: int, tag: int, meta: bytes) -> None:
        """A message came from ``peer`` before any receive was posted for it."""
        if not self._active() or not self.check:
            return
        if tag & P2P_TAG:
            self._p2p_arrival(peer, tag, meta)
            return
        seq = (tag >> 32) & SEQ_MASK
        mine = self._issued.get(seq)
        if mine is None:
            self._early.setdefault(seq, (peer, meta))
            self._p2p_blocked(peer, seq, meta)
            return
        if meta != mine.packed:
            self._fail(InvalidUsage(mine.describe_difference(Descriptor.unpack(meta),
                                                             self.rank, peer)))

    def _p2p_arrival(self, peer: int, tag: int, meta: bytes) -> None:
        other = Descriptor.unpack(meta)
        key = (peer, (tag >> 32) & SEQ_MASK)
        if key in self._p2p_done:  # (its receive already took it: a late notice)
            return
        self._p2p_seen.add(key)  # forgotten when its recv completes
        stamp = self.recv_stamps.get(key)
        if other.root == ANY_SEQ or stamp == ANY_SEQ:
            return
        if stamp is None:
            # Our matching receive is not issued yet: it will carry at least this stamp.
            stamp = self._next_seq() & SEQ_MASK
            if other.root >= stamp:
                self._p2p_unclaimed[key] = other.root  # checked as collectives are issued
                return
        elif other.root == stamp:
            return
        mine = self._issued.get(other.root)
        where = f"collective #{other.root}" + (
            f" ({mine.coll.name.lower()})" if mine is not None else "")
        self._fail(InvalidUsage(
            f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
            f"{peer} sent before its {where}, but rank {self.rank} "
            + ("was already past it" if other.root < stamp else
               f"posts the matching recv before collective #{stamp}")))

    def _p2p_blocked(self, peer: int, seq: int, meta: bytes) -> None:
        """``peer`` runs collective ``seq`` while we still wait for its send issued earlier."""
        for (frm, index), stamp in self.recv_stamps.items():
            if (frm == peer and stamp != ANY_SEQ and stamp <= seq and seq not in self._issued
                    and (frm, index) in self.recv_futs):
                # Its send (stamped before seq) should have come first; give messages that
                # travel on other connections a moment before calling it a mismatch.
                self._loop.call_later(_BLOCKED_GRACE, self._p2p_blocked_check, peer, index,
                                      seq, meta)
                return

    def _p2p_blocked_check(self, peer: int, index: int, seq: int, meta: bytes) -> None:
        key = (peer, index)
        fut = self.recv_futs.get(key)
        if (key not in self.recv_stamps or key in self._p2p_seen
                or (fut is not None and fut.done()) or not self._active()):
            return
        coll = Descriptor.unpack(meta).coll.name.lower()
        self._fail(InvalidUsage(
            f"send/recv order mismatch between rank {self.rank} and rank {peer}: rank "
            f"{self.rank} waits in recv from rank {peer}, which is already in {coll} "
            f"#{seq}: the ranks issued their calls in different orders"))
