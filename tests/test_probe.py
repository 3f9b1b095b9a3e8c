"""The timeout probe's codec and answers (acoll._comm.probe), without sockets."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from acoll._coll.algorithms import _STEPS
from acoll._comm.agreement import CHECK_STEP
from acoll._comm.executor import Executor
from acoll._comm.ordering import P2P_TAG, SEQ_MASK
from acoll._comm.probe import (
    PROBE_STEP,
    REPLY_STEP,
    PeerState,
    is_probe,
    pack_state,
    unpack_state,
)


@pytest.mark.parametrize("state", [PeerState(False, None, 0), PeerState(True, 7, 12),
                                   PeerState(True, None, 1 << 40)])
def test_states_round_trip_in_sixteen_bytes(state: PeerState) -> None:
    meta = pack_state(state)
    assert len(meta) == 16
    assert unpack_state(meta) == state


@pytest.mark.parametrize("meta", [b"", bytes(15), bytes(17), bytes(16),  # state 0
                                  struct.pack("<iiq", 3, -1, 0),
                                  struct.pack("<iiq", 2, -2, 0),
                                  struct.pack("<iiq", 1, -1, -5)])
def test_malformed_replies_are_no_answer(meta: bytes) -> None:
    assert unpack_state(meta) is None


def test_probe_tags_lie_where_no_data_or_agreement_step_goes() -> None:
    assert _STEPS <= PROBE_STEP < REPLY_STEP < CHECK_STEP - 31  # (32 agreement rounds)
    assert is_probe((5 << 32) | PROBE_STEP)
    assert not is_probe((5 << 32) | REPLY_STEP)
    assert not is_probe((5 << 32) | (_STEPS - 1))
    assert not is_probe(P2P_TAG | (5 << 32) | PROBE_STEP)  # a send/recv's tag


class _Ctx:
    def __init__(self, seq: int, waiting_on: int | None, agree_on: int | None) -> None:
        self.seq, self.waiting_on, self.agree_on = seq, waiting_on, agree_on


async def test_answers_say_whether_the_call_was_made() -> None:
    ex = Executor(object(), object())  # type: ignore[arg-type]
    ex.seq = 10  # calls 0 .. 9 made
    assert ex.probe_state(10) == PeerState(False, None, 10)
    assert ex.probe_state(11) == PeerState(False, None, 10)
    assert ex.probe_state(9) == PeerState(True, None, 10)
    assert ex.probe_state(0) == PeerState(True, None, 10)
    running: Any = {_Ctx(9, 4, None), _Ctx(8, None, 2)}
    ex.running = running
    assert ex.probe_state(9) == PeerState(True, 4, 10)
    assert ex.probe_state(8) == PeerState(True, 2, 10)  # (waiting in its agreement)
    ex.running = set()
    ex.seq = SEQ_MASK + 3  # wrapped: the next call is numbered 2
    assert ex.probe_state(2) == PeerState(False, None, SEQ_MASK + 3)
    assert ex.probe_state(1) == PeerState(True, None, SEQ_MASK + 3)
    assert ex.probe_state(SEQ_MASK) == PeerState(True, None, SEQ_MASK + 3)
