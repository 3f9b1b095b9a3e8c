"""Mailboxes of the shared-memory *lane*: small collectives without messages (sans-IO).

Besides its two rings, a shared-memory segment (:mod:`.shmring`) holds one mailbox per
direction. The communicator's lane (:mod:`acoll._comm.lane`) runs small collectives
between processes of one host through them: every rank writes its contribution into the
mailbox towards each peer, then reads each peer's mailbox towards it. There is no record,
no matching and no wake-up: a reader busy-polls a sequence word. This module knows the
layout and the rules, not the event loop; it works on any writable memoryview.

Mailbox layout (little endian), written by one side only except where noted::

    0     announce line (writer): Q begin | 16s descriptor | Q end
    64    ack line (reader):      Q ack of slot 0 | Q ack of slot 1
    128   slot 0: Q seq | 16s descriptor | Q payload length | 32x, then ``lane`` bytes
    ...   slot 1: the same

Sequence numbers are the communicator's op numbers plus one (0 means "never written").
An op that moves its data in several steps (a large all_reduce: a reduce-scatter step then
an all-gather step per chunk) writes step ``k`` with the *stamp* ``s + 1 + k * 2**44``
(:func:`stamp`, modulo 2**64) in slot ``(s + k) % 2``: the value a slot holds differs from
the one written there before, which is all a reader and a writer compare against.

- A lane op numbered ``s`` uses slot ``s % 2``. The writer copies the payload, then the
  *head* (descriptor and payload length), then stores ``seq``; the reader loads ``seq``
  first. On x86-64
  (total store order) plain stores and loads keep that order: this module, like the
  rings, is used on x86-64 only.
- Before reusing a slot, the writer checks that the reader acknowledged the op it last
  wrote there (``ack``): a slot is never overwritten while its reader may copy from it.
- An op that does not use the lane *announces* its number and descriptor (a seqlock:
  ``begin``, descriptor, ``end``), so that a rank waiting in the lane for that number
  learns at once that its peer called something else.

Whatever the peer wrote is checked before use: a payload length other than the one
expected is reported, never used to index.
"""

from __future__ import annotations

import struct

__all__ = ["HEAD_SIZE", "Board", "CallRecord", "Head", "Inbox", "Outbox", "board_span", "head",
           "head_desc", "head_length", "mailbox_span", "stamp"]

ALIGN = 64
_SLOT = struct.Struct("<Q16sQ32x")
assert _SLOT.size == ALIGN
_SLOTS_AT = 2 * ALIGN
_QQ = struct.Struct("<QQ")
HEAD_SIZE = 24
Head = tuple[int, int, int]
_STEP_SHIFT = 44
_WORD = (1 << 64) - 1


def stamp(seq: int, step: int) -> int:
    """What step ``step`` of op ``seq`` writes in its slot's sequence word (never 0)."""
    return (seq + 1 + (step << _STEP_SHIFT)) & _WORD


def _slot_span(lane: int) -> int:
    return ALIGN + ((lane + ALIGN - 1) & ~(ALIGN - 1))


def mailbox_span(lane: int) -> int:
    """Bytes of one mailbox whose slots hold ``lane`` payload bytes (0: no mailbox)."""
    if lane <= 0:
        return 0
    return _SLOTS_AT + 2 * _slot_span(lane)


class _Slots:
    """Two stamped slots at ``slots_at`` in ``mem`` (see the layouts above): what a
    mailbox and a board share. The writing side publishes, the reading side looks."""

    def __init__(self, mem: memoryview, lane: int, slots_at: int) -> None:
        self.mem = mem
        self.lane = lane
        self._span = _slot_span(lane)
        self._slots_at = slots_at
        self._words = mem.cast("Q")  # for single 8-byte loads and stores
        self._seq_word = [(slots_at + i * self._span) // 8 for i in (0, 1)]
        self._last = [0, 0]  # (writing side) the stamp last written to each slot

    def payload(self, slot: int, nbytes: int) -> memoryview:
        start = self._slots_at + slot * self._span + ALIGN
        return self.mem[start:start + nbytes]

    def publish_at(self, slot: int, value: int, head: Head) -> None:
        """Publish the step stamped ``value`` (:func:`stamp`) in ``slot``: ``head`` after
        the payload, which the caller copied first, then the stamp (the last store).
        Call only when the slot is free."""
        w = self._words
        at = self._seq_word[slot]
        w[at + 1], w[at + 2], w[at + 3] = head
        self._last[slot] = value
        w[at] = value

    def arrived_at(self, slot: int, value: int) -> bool:
        """Whether the writer published the step stamped ``value`` in ``slot``."""
        return self._words[self._seq_word[slot]] == value

    def head_at(self, slot: int) -> Head:
        """The head (descriptor and payload length) the writer published last in ``slot``."""
        w = self._words
        at = self._seq_word[slot]
        return w[at + 1], w[at + 2], w[at + 3]

    def release(self) -> None:
        self._words.release()
        self.mem.release()


class _Box(_Slots):
    def __init__(self, mem: memoryview, lane: int) -> None:
        if mem.nbytes != mailbox_span(lane):
            raise ValueError(f"mailbox of {mem.nbytes} bytes for a lane of {lane}")
        super().__init__(mem, lane, _SLOTS_AT)
        self._ack_word = [ALIGN // 8, ALIGN // 8 + 1]


class Outbox(_Box):
    """The writing side of a mailbox (towards one peer)."""

    def free(self, seq: int) -> bool:
        """Whether the slot of op ``seq`` may be written (its last op was read)."""
        return self.free_at(seq & 1)

    def publish(self, seq: int, head: Head) -> None:
        """Publish op ``seq`` (a one-step op: its stamp is ``seq + 1``, in slot
        ``seq % 2``). Call only when :meth:`free` says so."""
        self.publish_at(seq & 1, seq + 1, head)

    def free_at(self, slot: int) -> bool:
        """Whether ``slot`` may be written (what this side last wrote there was read)."""
        return self._words[self._ack_word[slot]] == self._last[slot]

    def announce(self, seq: int, desc: bytes) -> None:
        """Say that op ``seq`` (with ``desc``) runs off the lane."""
        w = self._words
        w[0] = seq + 1
        self.mem[8:24] = desc
        w[3] = seq + 1


class Inbox(_Box):
    """The reading side of a mailbox (from one peer)."""

    def arrived(self, seq: int) -> bool:
        """Whether the peer published op ``seq`` in its slot."""
        return self.arrived_at(seq & 1, seq + 1)

    def head(self, seq: int) -> Head:
        """The head (descriptor and payload length) the peer published for op ``seq``."""
        return self.head_at(seq & 1)

    def ack(self, seq: int) -> None:
        """Give op ``seq``'s slot back to the writer (after copying from it)."""
        self.ack_at(seq & 1, seq + 1)

    def ack_at(self, slot: int, value: int) -> None:
        """Give ``slot`` back after copying the step stamped ``value`` from it."""
        self._words[self._ack_word[slot]] = value

    def announced(self, seq: int) -> bytes | None:
        """The descriptor the peer announced for op ``seq`` (it ran off the lane), or
        ``None``."""
        w = self._words
        end = w[3]
        if end != seq + 1:
            return None
        desc = bytes(self.mem[8:24])
        return desc if w[0] == end else None


def head(desc: bytes, nbytes: int) -> Head:
    """What a slot says besides its payload: the op's 16-byte descriptor and the payload's
    length, as the three 64-bit words that follow the slot's sequence word."""
    a, b = _QQ.unpack(desc)
    return a, b, nbytes


def head_desc(h: Head) -> bytes:
    """The 16-byte descriptor in a head."""
    return _QQ.pack(h[0], h[1])


def head_length(h: Head) -> int:
    """The payload length in a head."""
    return h[2]


# ----------------------------------------------------------------------------- boards

def board_span(nranks: int, lane: int) -> int:
    """Bytes of a board for ``nranks`` ranks whose slots hold ``lane`` payload bytes."""
    return 2 * ALIGN + nranks * ALIGN + 2 * _slot_span(lane)


#: what a rank says of a call on registered buffers: (descriptor word a, descriptor word b,
#: send registration + 1, send offset, recv registration + 1, recv offset); 0 for a
#: registration means the buffer is not in one
CallRecord = tuple[int, int, int, int, int, int]


class Board(_Slots):
    """A rank's *board*: one shared area its owner writes and every peer reads, for steps
    that send the same bytes to every peer (an all-gather step: written once instead of
    once per peer). Layout (little endian)::

        0                  16s token (the owner's, checked by whoever maps it)
        64 + 64 k          ack line of reader k: Q ack of slot 0 | Q ack of slot 1
        64 + 64 n          call line (owner): Q call stamp | 6Q call record | Q phase
        128 + 64 n         slot 0: Q stamp | 16s descriptor | Q payload length | 32x,
                           then ``lane`` bytes
        ...                slot 1: the same

    The owner reuses a slot once every reader acknowledged the stamp it last wrote there;
    a reader loads the stamp first, copies, then acknowledges in its own line. ``me`` is
    the rank using this view (the owner, or a reader).

    The call line serves calls on registered buffers (the lane's zero-copy collectives):
    the owner writes what it calls op ``seq`` with (:data:`CallRecord`), then the stamp
    ``seq + 1``; then, as it goes, the op's *phase* (a number that only grows). Readers
    load the stamp first. A record stays until the owner's next such call, which it makes
    only after every peer read this one (the op's phases say so)."""

    def __init__(self, mem: memoryview, nranks: int, lane: int, owner: int, me: int) -> None:
        if mem.nbytes < board_span(nranks, lane):
            raise ValueError(f"board of {mem.nbytes} bytes for {nranks} ranks and a lane "
                             f"of {lane}")
        super().__init__(mem, lane, 2 * ALIGN + nranks * ALIGN)
        self.owner, self.me = owner, me
        self._readers = [(k, (ALIGN + k * ALIGN) // 8) for k in range(nranks) if k != owner]
        self._acks = [word for _, word in self._readers]
        self._my_ack = (ALIGN + me * ALIGN) // 8
        self._call = (ALIGN + nranks * ALIGN) // 8

    # owner side
    def free_at(self, slot: int) -> bool:
        """Whether every reader acknowledged what the owner last wrote in ``slot``."""
        w, last = self._words, self._last[slot]
        return all(w[a + slot] == last for a in self._acks)

    def unread(self, slot: int) -> list[int]:
        """The readers that did not acknowledge what the owner last wrote in ``slot``."""
        w, last = self._words, self._last[slot]
        return [k for k, a in self._readers if w[a + slot] != last]

    # reader side
    def ack_at(self, slot: int, value: int) -> None:
        """Acknowledge, in this reader's own line, the step stamped ``value``."""
        self._words[self._my_ack + slot] = value

    # the call line
    def post_call(self, seq: int, record: CallRecord) -> None:
        """(owner) Say what op ``seq`` is called with: the record, then the stamp."""
        w, at = self._words, self._call
        for k, value in enumerate(record, 1):
            w[at + k] = value
        w[at] = seq + 1

    def called(self, seq: int) -> CallRecord | None:
        """What the owner called op ``seq`` with, or None if it has not said (its line
        holds an earlier op's record, or none)."""
        w, at = self._words, self._call
        if w[at] != seq + 1:
            return None
        return w[at + 1], w[at + 2], w[at + 3], w[at + 4], w[at + 5], w[at + 6]

    def set_phase(self, value: int) -> None:
        """(owner) Publish how far the current call got (a number that only grows)."""
        self._words[self._call + 7] = value

    def phase(self) -> int:
        """How far the owner's current call got (see :meth:`set_phase`)."""
        return self._words[self._call + 7]
