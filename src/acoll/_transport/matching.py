"""Tag matching for one direction of a connection, as a plain state machine (sans-IO).

Every transport matches incoming messages to posted receives by tag under the same rules
(see :mod:`acoll._transport.base`); this module holds those rules once, with no sockets,
no event loop and no clock, in the manner of h11. The owner (a connection) feeds it
*inputs* and acts on its *outputs*; nothing here calls back into the owner except the
storage allocator it was given.

Inputs:

- :meth:`Matcher.post` -- a receive was posted: ``(tag, dest buffer, token)``.
- :meth:`Matcher.place` -- the header of one part of a streamed message arrived
  ``(tag, total, offset, length, meta)``; the answer says where that part's payload goes.
  A message may come in several parts, at any offsets, in any order (TCP stripes large
  messages over several sockets). A whole message is one part of ``total`` bytes at 0.
- :meth:`Matcher.landed` -- ``n`` payload bytes of a message were written where
  :meth:`~Matcher.place` said.
- :meth:`Matcher.hold` -- a whole message arrived *by reference*: an opaque ``ref`` the
  owner can copy from later (a sender's buffer in the same process, a remote RDMA
  descriptor). Nothing is copied or stored here.
- :meth:`Matcher.withdraw` -- the sender took back a held message nobody received yet.
- :meth:`Matcher.fail` / :meth:`Matcher.peer_closed` -- the connection broke, or the peer
  closed it in order (complete early messages stay receivable).

Outputs:

- where a part's payload goes: a slice of the posted buffer (zero copy), a slice of
  storage (the message came early; storage comes from the ``alloc`` callable), or
  ``None``: read and drop it (a wrong-sized message being drained, or a dead connection);
- :class:`Message` objects handed back by :meth:`~Matcher.post`, :meth:`~Matcher.landed`,
  :meth:`~Matcher.hold`, :meth:`~Matcher.fail` and :meth:`~Matcher.peer_closed`: each is
  one *delivery* the owner must carry out now (see :class:`Message`); every posted token
  is handed back exactly once, and no token is ever handed back twice;
- :meth:`Matcher.take_arrivals`: ``(tag, meta)`` of each message that arrived before its
  receive was posted, once per message, for the owner's arrival notification.

Rules (the contract of :mod:`acoll._transport.base`):

- One receive per tag at a time: posting a tag that already has a receive waiting (or a
  receive whose wrong-sized message is still being drained) raises :class:`ProtocolError`.
- A message whose size differs from its receive fails that receive with
  :class:`MessageSizeError` only once the whole message has come and been dropped (never
  stored), so the caller may post the same tag again at once without catching the tail.
- A streamed message that arrives early is stored only up to ``max_early`` bytes (and a
  wrong-sized one drained only up to that size); a larger one is a :class:`ProtocolError`,
  as are parts outside their message, parts disagreeing on its size, and parts adding up
  to more than it (including a tag reused before its previous message was received).
- After :meth:`~Matcher.fail` everything is handed back failed and later posts fail at
  once; after :meth:`~Matcher.peer_closed` complete early messages stay receivable, each
  once, and everything else fails. The first of the two decides; later ones do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..errors import ProtocolError
from .base import MessageSizeError

__all__ = ["Matcher", "Message"]

T = TypeVar("T")  # the owner's receive token (TCP: the receive's future)
R = TypeVar("R")  # the owner's reference to a held message

_EMPTY = memoryview(bytearray())


class Message(Generic[T, R]):
    """One message, and, when handed back, the delivery the owner must carry out now.

    A message handed back by the matcher is out of its tables; act on it in this order:

    1. ``error`` is set: fail ``token`` (if not ``None``) with it; release ``ref`` (if not
       ``None``: the held message is dropped).
    2. else ``storage`` is set: copy ``storage`` into ``dest`` (at the owner's pace), then
       complete ``token`` with ``meta``.
    3. else ``ref`` is set: copy the held message into ``dest``, complete ``token`` with
       ``meta``, release ``ref``.
    4. else the payload is already in ``dest``: complete ``token`` with ``meta``.

    Attributes:
        tag, total, meta: the message's tag, size in bytes and the sender's meta.
        token: the receive it was matched to (``None``: no receive).
        dest: that receive's buffer.
        storage: where it was kept because it came before its receive.
        ref: the held message (see :meth:`Matcher.hold`).
        error: why ``token`` fails (``MessageSizeError``, the connection's failure).
    """

    __slots__ = ("claimed", "dest", "drop", "error", "meta", "owned", "received", "ref",
                 "storage", "table", "tag", "token", "total")

    def __init__(self, tag: int, total: int, token: T | None = None,
                 dest: memoryview | None = None) -> None:
        self.tag = tag
        self.total = total
        self.token = token
        self.dest = dest
        self.meta = b""
        self.storage: memoryview | None = None
        self.ref: R | None = None
        self.error: Exception | None = None
        self.claimed = 0  # payload bytes announced by part headers
        self.received = 0  # payload bytes landed
        self.drop = False  # being drained: payload is read and thrown away
        self.owned = False  # ``dest`` is the owner's own memory, not a user's (see post)
        # the matcher's table that holds it (None once handed back or dropped)
        self.table: dict[int, Message[T, R]] | None = None

    @property
    def complete(self) -> bool:
        """Every byte of the message has arrived (for a held one: from the start)."""
        return self.received == self.total

    def __repr__(self) -> str:
        state = ("error" if self.error is not None else "stored" if self.storage is not None
                 else "held" if self.ref is not None else "direct")
        return (f"<Message tag={self.tag:#x} {self.received}/{self.total} {state}"
                f"{' matched' if self.token is not None else ''}>")


class Matcher(Generic[T, R]):
    """Matches one direction's messages to receives by tag. See the module doc.

    Args:
        alloc: ``alloc(n)`` returns ``n`` writable bytes of storage for an early message
            (called once per early streamed message, never for a held one).
        max_early: the largest streamed message kept (or drained) without a matching
            receive; ``None`` for no limit.
        limit_name: how error messages name ``max_early`` (the setting behind it).
    """

    def __init__(self, alloc: Callable[[int], memoryview], *, max_early: int | None = None,
                 limit_name: str = "max_early") -> None:
        self._alloc = alloc
        self._max_early = max_early if max_early is not None else 1 << 64
        self._limit_name = limit_name
        self._posted: dict[int, Message[T, R]] = {}  # receives waiting (or being filled)
        self._early: dict[int, Message[T, R]] = {}  # messages that came before a receive
        self._draining: dict[int, Message[T, R]] = {}  # wrong-sized, being dropped
        #: ``(tag, meta)`` of early messages not yet handed out: read it and clear it, or
        #: call :meth:`take_arrivals`.
        self.arrivals: list[tuple[int, bytes]] = []
        self._ended: Exception | None = None
        self._keeping = False

    # ------------------------------------------------------------------ state
    @property
    def ended(self) -> Exception | None:
        """The exception given to :meth:`fail` or :meth:`peer_closed`, if either came."""
        return self._ended

    @property
    def keeping(self) -> bool:
        """:meth:`peer_closed` came first: complete early messages stay receivable."""
        return self._keeping

    def take_arrivals(self) -> list[tuple[int, bytes]]:
        """``(tag, meta)`` of each message that came before its receive, since the last
        call (once per message, in arrival order)."""
        out, self.arrivals = self.arrivals, []
        return out

    def early(self) -> list[Message[T, R]]:
        """The messages kept for receives not posted yet (for inspection)."""
        return list(self._early.values())

    @property
    def receiving(self) -> bool:
        """A posted receive is waiting for (or taking in) its message."""
        return bool(self._posted)

    def __len__(self) -> int:
        """Messages and receives the matcher holds (posted, early, draining)."""
        return len(self._posted) + len(self._early) + len(self._draining)

    # ------------------------------------------------------------------ receives
    def post(self, tag: int, dest: memoryview, token: T, *, owned: bool = False
             ) -> Message[T, R] | None:
        """A receive of ``dest.nbytes`` bytes (``dest`` is byte-shaped) under ``tag``;
        ``owned``: ``dest`` is the owner's own memory (a transport may then let it be
        written a moment after the receive ended, see :attr:`Message.owned`).

        Returns ``None`` when it waits (its delivery will come out of :meth:`landed`,
        :meth:`hold`, :meth:`fail` or :meth:`peer_closed`), or the delivery to carry out
        now: the early message it matched, a :class:`MessageSizeError`, or the failure
        the connection ended with.

        Raises:
            ProtocolError: a receive for ``tag`` is already waiting (a caller bug: the
                token is not kept, and nothing changed).
        """
        nbytes = dest.nbytes
        msg = self._early.get(tag)
        if self._ended is not None and not (self._keeping and msg is not None):
            failed: Message[T, R] = Message(tag, nbytes, token, dest)
            failed.error = self._ended
            return failed
        if tag in self._posted or tag in self._draining or (
                msg is not None and msg.token is not None):
            raise ProtocolError(f"a receive for tag {tag:#x} is already posted")
        if msg is None:
            msg = Message(tag, nbytes, token, dest)
            msg.owned = owned
            msg.table = self._posted
            self._posted[tag] = msg
            return None
        msg.token = token
        if msg.total != nbytes:
            msg.error = MessageSizeError(tag, nbytes, msg.total, msg.meta)
            if msg.received < msg.total:  # fail it once the rest has been drained
                del self._early[tag]
                msg.drop, msg.storage = True, None
                msg.table = self._draining
                self._draining[tag] = msg
                return None
        else:
            msg.dest = dest
            if msg.received < msg.total:  # still arriving into storage: delivered then
                return None
        del self._early[tag]
        msg.table = None
        return msg

    # ------------------------------------------------------------------ streamed messages
    def place(self, tag: int, total: int, offset: int, length: int, meta: bytes
              ) -> tuple[Message[T, R], memoryview | None]:
        """A part of ``length`` bytes at ``offset`` of message ``tag`` (``total`` bytes)
        was announced. Returns the message (pass it to :meth:`landed`) and where the
        part's payload goes: the posted buffer, storage, or ``None`` (drop it).

        Raises:
            ProtocolError: the part lies outside the message, disagrees with earlier parts
                about its size, adds up with them to more than it, or the message would
                have to be kept or drained and is larger than ``max_early``.
        """
        if length > total or offset > total - length:
            raise ProtocolError(f"frame part {offset}+{length} exceeds message size {total}")
        if self._ended is not None:  # nobody will receive it: drop it
            return Message(tag, total), None
        msg = self._draining.get(tag) if self._draining else None
        if msg is None:
            msg = self._posted.get(tag)
            if msg is None:
                msg = self._early.get(tag)
                if msg is None:  # early: kept in storage until its receive is posted
                    if total > self._max_early:
                        raise ProtocolError(
                            f"message {tag:#x} of {total} bytes arrived before its receive "
                            f"was posted; at most {self._max_early} bytes are kept "
                            f"({self._limit_name})")
                    msg = Message(tag, total)
                    msg.storage = self._alloc(total) if total else _EMPTY
                    msg.table = self._early
                    self._early[tag] = msg
                    self.arrivals.append((tag, meta))
            elif msg.total != total and not msg.claimed:
                msg = self._drain_posted(msg, total, meta)
        if msg.total != total:
            raise ProtocolError(f"parts of message {tag:#x} disagree on its size")
        if msg.claimed + length > total:
            raise ProtocolError(f"parts of message {tag:#x} exceed its size {total} (or "
                                f"its tag was reused before it was received)")
        msg.claimed += length
        msg.meta = meta
        if msg.drop:
            return msg, None
        if msg.storage is not None:
            return msg, msg.storage[offset:offset + length]
        assert msg.dest is not None
        return msg, msg.dest[offset:offset + length]

    def _drain_posted(self, posted: Message[T, R], total: int, meta: bytes
                      ) -> Message[T, R]:
        """The first part of a wrong-sized message for a posted receive: drain it."""
        tag = posted.tag
        if total > self._max_early:
            raise ProtocolError(f"message {tag:#x} of {total} bytes, where a receive of "
                                f"{posted.total} bytes was posted")
        del self._posted[tag]
        posted.table = None
        msg: Message[T, R] = Message(tag, total, posted.token)
        msg.error = MessageSizeError(tag, posted.total, total, meta)
        msg.drop = True
        msg.table = self._draining
        self._draining[tag] = msg
        return msg

    def landed(self, msg: Message[T, R], n: int) -> Message[T, R] | None:
        """``n`` more payload bytes of ``msg`` were written where :meth:`place` said (or
        dropped). Returns ``msg`` as a delivery once it is complete and matched, else
        ``None`` (also for a message the matcher no longer holds)."""
        msg.received += n
        table = msg.table
        if msg.received < msg.total or table is None:
            return None
        if msg.token is None:
            return None  # complete; kept in storage until its receive is posted
        del table[msg.tag]
        msg.table = None
        return msg

    # ------------------------------------------------------------------ held messages
    def hold(self, tag: int, total: int, meta: bytes, ref: R) -> Message[T, R] | None:
        """A whole message of ``total`` bytes arrived as ``ref``, which the owner can copy
        from later. Returns ``None`` when it is kept for a receive not posted yet (its
        delivery comes out of a later :meth:`post`), else the delivery to carry out now:
        the posted receive it matched, a :class:`MessageSizeError` (the message is
        dropped), or, after the connection ended, just the release of ``ref``.

        Raises:
            ProtocolError: a message with this tag is already kept or being drained (the
                tag was reused before its previous message was received).
        """
        if self._ended is not None:
            dropped: Message[T, R] = Message(tag, total)
            dropped.ref, dropped.error, dropped.meta = ref, self._ended, meta
            return dropped
        if tag in self._early or tag in self._draining:
            raise ProtocolError(f"message {tag:#x} arrived before the previous message "
                                f"with that tag was received")
        msg = self._posted.get(tag)
        if msg is None or msg.claimed:
            if msg is not None:
                raise ProtocolError(f"message {tag:#x} is already arriving in parts")
            msg = Message(tag, total)
            msg.ref, msg.meta, msg.received, msg.claimed = ref, meta, total, total
            msg.table = self._early
            self._early[tag] = msg
            self.arrivals.append((tag, meta))
            return None
        del self._posted[tag]
        msg.table = None
        msg.ref, msg.meta = ref, meta
        if msg.total != total:
            msg.error = MessageSizeError(tag, msg.total, total, meta)
        return msg

    def withdraw(self, tag: int, ref: R) -> bool:
        """Take back the held message ``ref`` if no receive has matched it yet (the sender
        dropped it); returns whether it was still here. No delivery results."""
        msg = self._early.get(tag)
        if msg is None or msg.ref is not ref or msg.token is not None:
            return False
        del self._early[tag]
        msg.table = None
        return True

    # ------------------------------------------------------------------ the end
    def fail(self, exc: Exception) -> list[Message[T, R]]:
        """The connection broke (or is closed locally): hand back every waiting receive
        failed with ``exc`` and every held message to release; drop the rest. Later
        posts fail with ``exc`` at once. Does nothing after :meth:`fail` or
        :meth:`peer_closed`."""
        if self._ended is not None:
            return []
        self._ended = exc
        return self._end(exc, keep=False)

    def peer_closed(self, exc: Exception) -> list[Message[T, R]]:
        """The peer closed in order (no more messages will come): like :meth:`fail`, but
        complete early messages stay, each receivable once by a later :meth:`post`.
        Does nothing after :meth:`fail` or :meth:`peer_closed`."""
        if self._ended is not None:
            return []
        self._ended = exc
        self._keeping = True
        return self._end(exc, keep=True)

    def _end(self, exc: Exception, *, keep: bool) -> list[Message[T, R]]:
        out: list[Message[T, R]] = []
        kept: dict[int, Message[T, R]] = {}
        for table in (self._posted, self._draining, self._early):
            for msg in table.values():
                if keep and table is self._early and msg.complete and msg.token is None:
                    kept[msg.tag] = msg
                    continue
                msg.table = None
                if msg.token is not None or msg.ref is not None:
                    msg.error = exc
                    out.append(msg)
            table.clear()
        self._early.update(kept)
        self.arrivals.clear()
        return out
