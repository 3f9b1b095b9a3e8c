"""The order checker's bookkeeping of point-to-point messages, driven directly."""

from __future__ import annotations

import pytest

from acoll._coll.base import Coll, Descriptor
from acoll._comm.ordering import OrderChecker, p2p_tag
from acoll.errors import AcollError


async def test_an_arrival_notice_after_its_receive_completed_is_ignored() -> None:
    """Seen once on the 16-core GPU host (3 ranks in one loop): rank 0's send arrived
    before rank 1 posted its recv, the recv took it at once, and the transport's arrival
    notice (a later callback) then recorded it as an unclaimed early send, so rank 1's
    next collective failed with a false "send/recv order mismatch". A notice for a
    message whose receive already completed is now ignored."""
    failures: list[AcollError] = []
    checker = OrderChecker(1, True, failures.append, lambda: 1, lambda: True)
    sent = Descriptor(Coll.SEND_RECV, 0, 0, 1, 3, 0)  # stamped before collective #1
    checker.recv_issued(0, 0, 1)
    checker.recv_done(0, 0)
    checker.on_arrival(0, p2p_tag(0), sent.packed)  # the late notice
    checker.issue(1, Descriptor(Coll.CLOSE, 0, 0, 0, 0), in_group=False)
    assert failures == []


async def test_an_early_send_whose_recv_never_came_is_still_a_mismatch() -> None:
    """The control: the same send with no receive issued before collective #1."""
    failures: list[AcollError] = []
    checker = OrderChecker(1, True, failures.append, lambda: 1, lambda: True)
    sent = Descriptor(Coll.SEND_RECV, 0, 0, 1, 3, 0)
    checker.on_arrival(0, p2p_tag(0), sent.packed)
    with pytest.raises(AcollError, match="send/recv order mismatch"):
        checker.issue(1, Descriptor(Coll.CLOSE, 0, 0, 0, 0), in_group=False)
    assert failures
