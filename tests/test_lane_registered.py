"""Registered host buffers: allocations other processes map (``acoll.empty_shared``), the
boards' call line, and the lane's zero-copy all_reduce between real processes
(correctness, fallbacks, disagreements, dead and stalled peers, the loop's lag)."""

from __future__ import annotations

import gc
import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

import acoll
from acoll._coll.base import Coll
from acoll._comm.lane import ZERO_COPY_MIN, ZeroCopyAllReduce, _new_board
from acoll._memory import shared
from acoll._transport import shm
from acoll._transport.shmlane import Board, board_span, head, stamp
from test_lane import _run, _run_lag

# (its ranks busy-poll, up to 4 on 2 cores: never beside the network-namespace tests, whose
# teardown timed out next to them in a clean-clone run)
pytestmark = [pytest.mark.skipif(bool(shm.unsupported()), reason=shm.unsupported() or "-"),
              pytest.mark.xdist_group("netns")]


# --------------------------------------------------------------------------- allocations
def test_empty_shared_makes_arrays_in_a_sealed_memfd_of_their_own() -> None:
    x = acoll.empty_shared((3, 5), np.float64)
    assert x.shape == (3, 5)
    assert x.dtype == np.float64
    x[:] = 7
    found = shared.find(x.__array_interface__["data"][0], x.nbytes)
    assert found is not None
    block, off = found
    assert off == 0
    assert block.nbytes >= x.nbytes
    assert os.readlink(f"/proc/self/fd/{block.fd}").startswith("/memfd:acoll-host")
    sub = x[1:]
    assert shared.find(sub.__array_interface__["data"][0], sub.nbytes) == (block, 40)
    assert shared.find(x.__array_interface__["data"][0], block.nbytes + 1) is None
    assert shared.find(np.zeros(4).__array_interface__["data"][0], 32) is None
    assert acoll.empty_shared(0, np.int8).size == 0
    with pytest.raises(acoll.InvalidUsage, match="shape"):
        acoll.empty_shared((2, -1))


def test_an_allocation_leaves_the_registry_and_closes_its_fd_with_its_last_array() -> None:
    x = acoll.empty_shared(1000, np.int32)
    start = x.__array_interface__["data"][0]
    block, _ = shared.find(start, 4)  # type: ignore[misc]
    fd = block.fd
    view = x[10:]
    del x
    gc.collect()
    assert shared.find(start, 4) is not None  # the view still holds the memory
    del view, block
    gc.collect()
    assert shared.find(start, 4) is None
    with pytest.raises(OSError):
        os.fstat(fd)  # (closed; the number is free, nothing reuses it in between here)


def test_only_an_acoll_allocation_with_its_token_and_size_is_mapped() -> None:
    x = acoll.empty_shared(4096, np.uint8)
    x[:] = 9
    block, _ = shared.find(x.__array_interface__["data"][0], 1)  # type: ignore[misc]
    pid = os.getpid()
    mm, view = shared.open_shared(pid, block.fd, block.span, block.token)
    assert view.nbytes == block.nbytes
    assert int(view[0]) == 9
    x[1] = 5  # the same memory
    assert int(view[1]) == 5
    with pytest.raises(ValueError, match="read-only"):
        view[1] = 6  # (a peer's mapping is read-only)
    del view
    mm.close()
    with pytest.raises(ValueError, match="token"):
        shared.open_shared(pid, block.fd, block.span, os.urandom(16))
    with pytest.raises(ValueError, match="bytes"):
        shared.open_shared(pid, block.fd, block.span + mmap.PAGESIZE, block.token)
    fd, board = _new_board(board_span(2, 4096))  # a memfd of another name
    try:
        with pytest.raises(ValueError, match="not an acoll host allocation"):
            shared.open_shared(pid, fd, board_span(2, 4096), block.token)
    finally:
        board.close()
        os.close(fd)
    with pytest.raises(OSError):
        shared.open_shared(pid, 10_000, block.span, block.token)


def test_the_board_call_line_carries_a_record_then_phases() -> None:
    mem = memoryview(bytearray(board_span(3, 256)))
    owner = Board(mem, 3, 256, owner=1, me=1)
    reader = Board(mem, 3, 256, owner=1, me=0)
    assert reader.called(4) is None
    assert reader.phase() == 0
    owner.post_call(4, (1, 2, 3, 64, 0, 0))
    assert reader.called(4) == (1, 2, 3, 64, 0, 0)
    assert reader.called(3) is None
    assert reader.called(5) is None
    owner.set_phase(21)
    assert reader.phase() == 21
    # the call line does not overlap the slots or the readers' ack lines
    owner.publish_at(0, 99, (7, 8, 16))
    reader.ack_at(0, 99)
    assert reader.called(4) == (1, 2, 3, 64, 0, 0)
    assert reader.phase() == 21
    assert owner.free_at(0) is False  # (reader 2 has not acknowledged)


def test_a_peer_that_posted_its_call_record_then_published_is_no_offender() -> None:
    """A waiter's list of peers without a record goes stale between polls: a peer may post
    its record, see everyone's and publish its fallback's first step in the meantime (seen
    with 8 ranks on 16 cores: a ProtocolError on every rank, of a call every rank made
    alike). Only a peer that published without a record is named."""
    seq, desc = 1847, os.urandom(16)
    mems = [memoryview(bytearray(board_span(2, 256))) for _ in range(2)]
    boards = [Board(mems[k], 2, 256, owner=k, me=0) for k in range(2)]
    peer_owns = Board(mems[1], 2, 256, owner=1, me=1)
    call = object.__new__(ZeroCopyAllReduce)
    call.lane = SimpleNamespace(boards=boards, inboxes=[None, None], rank=0)  # type: ignore[assignment]
    call.desc = SimpleNamespace(packed=desc, coll=Coll.ALL_REDUCE)  # type: ignore[assignment]
    peer_owns.post_call(seq - 1, (*head(desc, 0)[:2], 0, 0, 0, 0))  # (the op before)
    peer_owns.publish_at(seq & 1, stamp(seq, 0), head(desc, 64))
    with pytest.raises(acoll.ProtocolError, match="rank 1 runs all_reduce #1847 without"):
        call._check_published(seq, [1])
    peer_owns.post_call(seq, (*head(desc, 0)[:2], 0, 0, 0, 0))
    call._check_published(seq, [1])  # (the record is there now: its fallback runs)


# --------------------------------------------------------------------------- processes
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("n", "loop"), [(2, "asyncio"), (3, "debug"), (4, "uvloop")])
def test_collectives_on_registered_buffers_match_numpy(n: int, loop: str) -> None:
    """Every collective, op and dtype on buffers inside a registered allocation at
    offsets that are multiples of 8 but not of 16; all_reduce, all_gather,
    reduce_scatter and broadcast of at least ZERO_COPY_MIN bytes read the peers' buffers
    in place (counted), the rest take their usual paths; results bit for bit against
    NumPy."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    results = _run("reg_matrix", n, cpus=max(n, os.cpu_count() or 1), loop=loop, wait=400)
    for res in results:
        assert res is not None
        assert res["boards"], res
        assert res["zero_copy"] >= 20, res  # (in place and not, most dtypes and ops)
        assert res["zero_copy"] == results[0]["zero_copy"]  # type: ignore[index]
        for name in ("all_gather", "reduce_scatter", "broadcast"):
            assert res["by"].get(name, 0) >= 4, res["by"]
        assert res["checks"] == results[0]["checks"]  # type: ignore[index]


@pytest.mark.parametrize("n", [2, 3])
def test_buffers_refilled_right_after_each_call_never_corrupt_a_peer(n: int) -> None:
    for res in _run("reg_reuse", n, cpus=4):
        assert res is not None
        assert res["zero_copy"] == 150, res
        assert res["bad"] == 0, res


def test_other_collectives_never_let_a_peer_read_spoiled_buffers() -> None:
    for res in _run("reg_reuse_colls", 3, cpus=4):
        assert res is not None
        assert res["bad"] == 0, res
        assert res["by"] == {"all_gather": 20, "reduce_scatter": 20, "broadcast": 20}, res


def test_ranks_without_registered_buffers_make_every_rank_take_the_plain_plan() -> None:
    for res in _run("reg_mixed", 3, cpus=4):
        assert res is not None
        assert res["zc_calls"] == 3, res
        assert res["zero_copy"] == 0, res


def test_a_buffer_not_from_empty_shared_registers_nothing_anywhere() -> None:
    for res in _run("reg_refused", 2, cpus=4):
        assert res is not None
        assert res["index"] == -1, res
        assert res["zc_calls"] == 0, res
        assert res["ok"], res


def test_deregistered_buffers_take_the_plain_plan_and_sub_arrays_register() -> None:
    for res in _run("reg_dereg", 2, cpus=4):
        assert res is not None
        assert res["before"] == 1, res
        assert res["after"] == 2, res
        assert res["index"] == 1, res


def test_zero_copy_ops_mix_with_other_lane_ops_in_groups_and_tasks() -> None:
    for res in _run("reg_group", 3, cpus=4):
        assert res is not None
        assert res["zero_copy"] == 5, res


@pytest.mark.parametrize("scenario", ["reg_mismatch_count", "reg_mismatch_kind",
                                      "reg_mismatch_small", "reg_mismatch_root",
                                      "reg_mismatch_gather", "reg_mismatch_plain"])
def test_disagreements_on_registered_buffers_are_named_on_every_rank(scenario: str) -> None:
    results = _run(scenario, 3, cpus=4)
    for res in results:
        assert res is not None
        assert res["error"] == "InvalidUsage", res
        assert res["after"] < 10, res  # not the 60 s deadline
    word = {"reg_mismatch_kind": "", "reg_mismatch_root": "root"}.get(scenario, "count")
    assert all(word in r["message"] for r in results if r), results


@pytest.mark.parametrize("n", [2, 3])
def test_a_late_peer_still_reads_the_record_of_a_call_that_fell_back(n: int) -> None:
    """A rank whose buffers are not registered falls back without waiting for its peers'
    records; its next lane op must not replace its record before every peer read it."""
    for res in _run("reg_late_reader", n, cpus=4):
        assert res is not None
        assert res.get("error") is None, res
        assert res["zero_copy"] == 1, res  # (the second call, on every rank)


def test_a_peer_killed_during_zero_copy_ops_fails_the_survivors_at_once() -> None:
    results = _run("reg_killed", 3, cpus=4)
    assert results[1] is None  # SIGKILLed
    for rank in (0, 2):
        res = results[rank]
        assert res is not None
        assert res["error"] == "RemoteError", res
        assert res["after"] < 10, res
        assert res["zero_copy"] >= 1, res


@pytest.mark.parametrize("where", ["phase", "combine"])
def test_a_peer_stalled_between_phases_is_named_by_the_timeout(where: str) -> None:
    """Stalled after it published phase 1 (the peers copy its part, then wait for its
    phase 2), or before (they copy each other's parts, then wait for its phase 1)."""
    results = _run("reg_stalled", 3, cpus=4, env_extra={"REG_STALL_AT": where})
    for rank in (0, 2):
        res = results[rank]
        assert res is not None
        assert res["error"] == "TimeoutError", res
        assert "rank 1" in res["message"], res
        assert res["after"] < 10, res


def test_large_zero_copy_all_reduces_keep_the_loop_responsive() -> None:
    """Bounded on the part of each gap the loop's thread ran (as the all_gather test)."""
    for res in _run_lag("reg_lag", 2, 0.015, cpus=4):
        assert res is not None
        assert res["ops"] >= 3, res
        assert res["zero_copy"] == res["ops"] + 1, res
        assert res["ticks"] > 20, res
        assert res["worst_busy_lag"] < 0.015, res


@pytest.mark.parametrize("cancel", [False, True])
def test_a_peer_that_left_early_never_lets_a_reader_return_its_new_bytes(cancel: bool) -> None:
    """Rank 0 leaves the last phase (its deadline, or a cancellation) while rank 1 still
    copies from rank 0's buffer, and refills it: rank 1 raises instead of returning a
    result with rank 0's new bytes in it."""
    results = _run("reg_left_early", 2, cpus=4,
                   env_extra={"REG_CANCEL": "1"} if cancel else None)
    assert results[0] is not None
    assert results[0]["error"] == ("CancelledError" if cancel else "TimeoutError"), results
    late = results[1]
    assert late is not None
    assert late["error"] in ("RemoteError", "TimeoutError"), late
    assert late["after"] < 10, late


def test_an_abort_marks_a_zero_copy_op_run_by_another_task_as_abandoned() -> None:
    """The abandoned mark is set by the abort itself, not later by the op's task (which
    a caller that moves on may never let run first)."""
    results = _run("reg_aborted_under", 2, cpus=4)
    assert results[0] is not None
    assert results[0]["error"] == "ClosedError", results
    late = results[1]
    assert late is not None
    assert late["error"] == "RemoteError", late
    assert "left the call" in late["message"] or "rank 0" in late["message"], late


@pytest.mark.parametrize("alone", [0, 1])
def test_one_rank_deregistering_alone_makes_every_rank_take_the_plain_plan(alone: int
                                                                            ) -> None:
    """(Before: a ProtocolError when the deregistering rank had the higher number, the
    plain plan when it had the lower: the verdict followed the order of the records.)"""
    for res in _run("reg_dereg_alone", 2, cpus=4, env_extra={"REG_ALONE": str(alone)}):
        assert res is not None
        assert res["error"] is None, res
        assert res["ok"], res
        assert res["zero_copy"] == 0, res


@pytest.mark.parametrize("native", ["0", "-1"])
def test_float16_zero_copy_all_reduces_keep_the_loop_responsive(native: str) -> None:
    """NumPy's float16 loops (ACOLL_NATIVE=0) are 70x slower than its float32 ones:
    pieces are sized by time, so the loop ticks between them; the native loops (the
    default) take a fraction of that time, and the loop stays as responsive."""
    for res in _run_lag("reg_lag_f16", 2, 0.008, cpus=4,
                        env_extra={"ACOLL_NATIVE": native}):
        assert res is not None
        assert res["zero_copy"] == 3, res
        if native == "0":
            assert res["ticks"] > 10, res  # (the ticker ran during the slow sums)
        assert res["worst_busy_lag"] < 0.008, res


def test_empty_shared_refuses_dtypes_and_sizes_it_cannot_share_and_leaks_nothing() -> None:
    def memfds() -> int:
        return sum(os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:acoll-host")
                   for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}"))

    before = memfds()
    for dtype in (object, "V0", [("a", object)]):
        with pytest.raises(acoll.InvalidUsage, match="fixed-size"):
            acoll.empty_shared(16, dtype)
    with pytest.raises(acoll.InvalidUsage, match="too many"):
        acoll.empty_shared((1 << 40, 1 << 40), np.uint8)  # (wraps to 0 in int64)
    with pytest.raises(acoll.InvalidUsage, match="shape"):
        acoll.empty_shared((2, True))
    with pytest.raises(acoll.InvalidUsage, match="sub-array"):
        acoll.empty_shared(4, ("f4", (3,)))
    with pytest.raises(acoll.InvalidUsage, match="not a dtype"):  # (was NumPy's TypeError)
        acoll.empty_shared(4, "foo")
    assert acoll.empty_shared(np.int64(4), np.int16).shape == (4,)  # (NumPy integers)
    assert acoll.empty_shared([2, np.int32(3)]).shape == (2, 3)
    assert memfds() == before


def test_zero_copy_starts_at_half_a_mebibyte() -> None:
    assert ZERO_COPY_MIN == 512 << 10  # (the scenarios' sizes are chosen around it)
