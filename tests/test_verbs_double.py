"""The verbs test double against the rules of the verbs specification (not against what
the RDMA transport expects): queue-pair states and their required attributes, memory
keys and access flags, RNR, ordering, error states, completion-channel notification.

Everything here calls the double's pyverbs-like surface directly, as pyverbs would be
called; nothing of acoll is involved."""

from __future__ import annotations

import ctypes
import errno
import os
import select
from dataclasses import dataclass
from typing import Any

import pytest

from verbs_double import (
    E,
    Fabric,
    PortSpec,
    PyverbsRDMAError,
    PyverbsUserError,
    gid_v4,
    gid_v6,
)

RW = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE


@dataclass
class Side:
    ctx: Any
    pd: Any
    ch: Any
    cq: Any
    qp: Any
    buf: Any  # ctypes buffer
    mr: Any

    @property
    def addr(self) -> int:
        return ctypes.addressof(self.buf)


def _side(fab: Fabric, dev: str, *, size: int = 4096, access: int = RW,
          send_wr: int = 16, recv_wr: int = 16, cqe: int = 64) -> Side:
    lib = fab.lib
    ctx = lib.Context(name=dev)
    pd = lib.PD(ctx)
    ch = lib.CompChannel(ctx)
    cq = lib.CQ(ctx, cqe, None, ch, 0)
    cap = lib.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr)
    qp = lib.QP(pd, lib.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    buf = ctypes.create_string_buffer(size)
    mr = lib.MR(pd, size, access, address=ctypes.addressof(buf))
    return Side(ctx, pd, ch, cq, qp, buf, mr)


def _attr(fab: Fabric, **fields: Any) -> Any:
    attr = fab.lib.QPAttr()
    for k, v in fields.items():
        setattr(attr, k, v)
    return attr


INIT_MASK = E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT | E.IBV_QP_ACCESS_FLAGS
RTR_MASK = (E.IBV_QP_STATE | E.IBV_QP_AV | E.IBV_QP_PATH_MTU | E.IBV_QP_DEST_QPN
            | E.IBV_QP_RQ_PSN | E.IBV_QP_MAX_DEST_RD_ATOMIC | E.IBV_QP_MIN_RNR_TIMER)
RTS_MASK = (E.IBV_QP_STATE | E.IBV_QP_SQ_PSN | E.IBV_QP_TIMEOUT | E.IBV_QP_RETRY_CNT
            | E.IBV_QP_RNR_RETRY | E.IBV_QP_MAX_QP_RD_ATOMIC)


def _ah(fab: Fabric, peer_dev: str, *, roce: bool, sgid_index: int = 0) -> Any:
    lib = fab.lib
    port = fab.devices[peer_dev].ports[0]
    if roce:
        raw = port.gids[sgid_index][0]  # type: ignore[index]
        gr = lib.GlobalRoute(dgid=lib.GID(str(ipaddr(raw))), sgid_index=sgid_index,
                             hop_limit=64)
        return lib.AHAttr(is_global=1, port_num=1, gr=gr)
    return lib.AHAttr(dlid=port.lid, port_num=1)


def ipaddr(raw: bytes) -> str:
    import ipaddress

    return ipaddress.IPv6Address(raw).exploded


def _connect(fab: Fabric, a: Side, adev: str, b: Side, bdev: str, *, roce: bool = False,
             psn_a: int = 100, psn_b: int = 200, rnr_retry: int = 7, retry_cnt: int = 2,
             timeout: int = 10, min_rnr_timer: int = 1, access: int = RW,
             mtu: int = E.IBV_MTU_1024, sgid_index: int = 0) -> None:
    for me, other, other_dev, my_psn, their_psn in ((a, b, bdev, psn_a, psn_b),
                                                    (b, a, adev, psn_b, psn_a)):
        me.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=1, pkey_index=0,
                           qp_access_flags=access), INIT_MASK)
        me.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, path_mtu=mtu,
                           dest_qp_num=other.qp.qp_num, rq_psn=their_psn,
                           max_dest_rd_atomic=1, min_rnr_timer=min_rnr_timer,
                           ah_attr=_ah(fab, other_dev, roce=roce, sgid_index=sgid_index)),
                     RTR_MASK)
        me.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTS, sq_psn=my_psn, timeout=timeout,
                           retry_cnt=retry_cnt, rnr_retry=rnr_retry, max_rd_atomic=1),
                     RTS_MASK)


def _fabric(roce: bool = False) -> Fabric:
    fab = Fabric()
    if roce:
        gids = [(gid_v6("fe80::a"), E.IBV_GID_TYPE_ROCE_V1),
                (gid_v4("10.0.0.1"), E.IBV_GID_TYPE_ROCE_V2)]
        fab.add_device("ra", [PortSpec(link_layer=E.IBV_LINK_LAYER_ETHERNET,
                                       active_mtu=E.IBV_MTU_1024, gids=gids)])
        gids = [(gid_v6("fe80::b"), E.IBV_GID_TYPE_ROCE_V1),
                (gid_v4("10.0.0.2"), E.IBV_GID_TYPE_ROCE_V2)]
        fab.add_device("rb", [PortSpec(link_layer=E.IBV_LINK_LAYER_ETHERNET,
                                       active_mtu=E.IBV_MTU_1024, gids=gids)])
    else:
        fab.add_device("a")
        fab.add_device("b")
    return fab


@pytest.fixture
def fab() -> Any:
    f = _fabric()
    yield f
    f.close()


@pytest.fixture
def pair(fab: Fabric) -> tuple[Side, Side]:
    a, b = _side(fab, "a"), _side(fab, "b")
    _connect(fab, a, "a", b, "b")
    return a, b


def _sge(fab: Fabric, side: Side, offset: int, length: int) -> Any:
    return fab.lib.SGE(side.addr + offset, length, side.mr.lkey)


def _send(fab: Fabric, side: Side, wr_id: int, offset: int, length: int, *,
          opcode: int = E.IBV_WR_SEND, rkey: int = 0, remote: int = 0, imm: int = 0,
          lkey: int | None = None) -> None:
    sge = fab.lib.SGE(side.addr + offset, length, side.mr.lkey if lkey is None else lkey)
    wr = fab.lib.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], imm_data=imm)
    if opcode != E.IBV_WR_SEND:
        wr.set_wr_rdma(rkey, remote)
    side.qp.post_send(wr)


def _recv(fab: Fabric, side: Side, wr_id: int, offset: int, length: int) -> None:
    side.qp.post_recv(fab.lib.RecvWR(wr_id=wr_id, num_sge=1, sg=[_sge(fab, side, offset,
                                                                      length)]))


def _poll(side: Side) -> list[tuple[int, int, int]]:
    _n, wcs = side.cq.poll(100)
    return [(w.wr_id, w.status, w.opcode) for w in wcs]


def _wait(fab: Fabric, side: Side, count: int, timeout: float = 5.0) -> list[Any]:
    """Completions from threads (retries) arrive later: poll until ``count`` came."""
    import time

    out: list[Any] = []
    end = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < end:
        _n, wcs = side.cq.poll(100)
        out.extend(wcs)
        if len(out) < count:
            time.sleep(0.002)
    return out


# ---------------------------------------------------------------------------- states
def test_transitions_need_the_required_attributes(fab: Fabric) -> None:
    a = _side(fab, "a")
    assert a.qp.qp_state == E.IBV_QPS_RESET
    with pytest.raises(PyverbsRDMAError, match="missing attributes"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT), E.IBV_QP_STATE | E.IBV_QP_PORT)
    with pytest.raises(PyverbsRDMAError, match="not allowed here"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT), INIT_MASK | E.IBV_QP_SQ_PSN)
    with pytest.raises(PyverbsRDMAError, match="not a valid transition"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR), RTR_MASK)
    with pytest.raises(PyverbsRDMAError, match="no port 2"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=2), INIT_MASK)
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=1), INIT_MASK)
    assert a.qp.qp_state == E.IBV_QPS_INIT
    with pytest.raises(PyverbsRDMAError, match="missing attributes"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR), RTR_MASK & ~E.IBV_QP_MIN_RNR_TIMER)
    with pytest.raises(PyverbsRDMAError, match="DLID 0"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, ah_attr=fab.lib.AHAttr(port_num=1)),
                    RTR_MASK)
    with pytest.raises(PyverbsRDMAError, match="path MTU"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, path_mtu=6,
                          ah_attr=_ah(fab, "b", roce=False)), RTR_MASK)
    with pytest.raises(PyverbsRDMAError, match="out of range"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, rq_psn=1 << 24,
                          ah_attr=_ah(fab, "b", roce=False)), RTR_MASK)
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, ah_attr=_ah(fab, "b", roce=False)),
                RTR_MASK)
    with pytest.raises(PyverbsRDMAError, match="missing attributes"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTS), RTS_MASK & ~E.IBV_QP_RETRY_CNT)
    with pytest.raises(PyverbsRDMAError, match="out of range"):
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTS, retry_cnt=8), RTS_MASK)
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTS), RTS_MASK)
    assert a.qp.qp_state == E.IBV_QPS_RTS
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_ERR), E.IBV_QP_STATE)
    assert a.qp.qp_state == E.IBV_QPS_ERR
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RESET), E.IBV_QP_STATE)
    assert a.qp.qp_state == E.IBV_QPS_RESET


def test_roce_needs_a_grh() -> None:
    fab = _fabric(roce=True)
    try:
        a = _side(fab, "ra")
        a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=1), INIT_MASK)
        with pytest.raises(PyverbsRDMAError, match="RoCE needs a GRH"):
            a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR,
                              ah_attr=fab.lib.AHAttr(dlid=5, port_num=1)), RTR_MASK)
        bad = fab.lib.AHAttr(is_global=1, port_num=1, gr=fab.lib.GlobalRoute(sgid_index=7))
        with pytest.raises(PyverbsRDMAError, match="no GID at index 7"):
            a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, ah_attr=bad), RTR_MASK)
    finally:
        fab.close()


def test_posting_depends_on_the_state(fab: Fabric) -> None:
    a = _side(fab, "a")
    with pytest.raises(PyverbsRDMAError, match="Failed to post recv"):
        _recv(fab, a, 1, 0, 10)  # RESET
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=1), INIT_MASK)
    _recv(fab, a, 1, 0, 10)  # receives may be posted from INIT on
    with pytest.raises(PyverbsRDMAError, match="Failed to post send"):
        _send(fab, a, 2, 0, 10)
    with pytest.raises(PyverbsUserError, match="at least one SGE"):
        fab.lib.SendWR(opcode=E.IBV_WR_SEND)


# ---------------------------------------------------------------------------- data
def test_send_recv_copies_and_completes_in_order(fab: Fabric,
                                                 pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.buf[0:10] = b"0123456789"
    for i in range(3):
        _recv(fab, b, 100 + i, 1000 * i, 1000)
    for i in range(3):
        _send(fab, a, i, i * 3, 3)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in b.cq.poll(10)[1]] == [
        (100, 0, E.IBV_WC_RECV, 3), (101, 0, E.IBV_WC_RECV, 3), (102, 0, E.IBV_WC_RECV, 3)]
    assert _poll(a) == [(0, 0, E.IBV_WC_SEND), (1, 0, E.IBV_WC_SEND),
                        (2, 0, E.IBV_WC_SEND)]
    assert bytes(b.buf[0:3]) + bytes(b.buf[1000:1003]) + bytes(b.buf[2000:2003]) == (
        b"012345678")


def test_write_with_immediate(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.buf[0:5] = b"hello"
    _recv(fab, b, 7, 0, 0)
    _send(fab, a, 1, 0, 5, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, rkey=b.mr.rkey,
          remote=b.addr + 100, imm=0xABCD)
    [wc] = b.cq.poll(10)[1]
    assert (wc.wr_id, wc.status, wc.opcode, wc.imm_data, wc.byte_len) == (
        7, 0, E.IBV_WC_RECV_RDMA_WITH_IMM, 0xABCD, 5)
    assert wc.wc_flags & E.IBV_WC_WITH_IMM
    assert bytes(b.buf[100:105]) == b"hello"
    assert _poll(a) == [(1, 0, E.IBV_WC_RDMA_WRITE)]
    # a plain write consumes no receive and makes no completion at the responder
    _send(fab, a, 2, 0, 5, opcode=E.IBV_WR_RDMA_WRITE, rkey=b.mr.rkey, remote=b.addr + 200)
    assert b.cq.poll(10) == (0, [])
    assert bytes(b.buf[200:205]) == b"hello"


@pytest.mark.parametrize("case", ["wrong-rkey", "outside", "no-remote-write-mr",
                                  "no-remote-write-qp"])
def test_remote_access_errors(case: str) -> None:
    fab = _fabric()
    try:
        a = _side(fab, "a")
        b = _side(fab, "b", access=E.IBV_ACCESS_LOCAL_WRITE if case == "no-remote-write-mr"
                  else RW)
        _connect(fab, a, "a", b, "b", access=E.IBV_ACCESS_LOCAL_WRITE
                 if case == "no-remote-write-qp" else RW)
        _recv(fab, b, 9, 0, 16)
        rkey = b.mr.rkey + 1 if case == "wrong-rkey" else b.mr.rkey
        remote = b.addr + 4090 if case == "outside" else b.addr
        _send(fab, a, 1, 0, 16, opcode=E.IBV_WR_RDMA_WRITE, rkey=rkey, remote=remote)
        _send(fab, a, 2, 0, 16)  # behind the failed one: flushed
        assert _poll(a) == [(1, E.IBV_WC_REM_ACCESS_ERR, E.IBV_WC_RDMA_WRITE),
                            (2, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_SEND)]
        assert a.qp.qp_state == E.IBV_QPS_ERR
        assert b.qp.qp_state == E.IBV_QPS_ERR
        assert _poll(b) == [(9, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV)]
        event = b.ctx.get_async_event()
        assert (event.event_type, event.qp_num) == (E.IBV_EVENT_QP_ACCESS_ERR, b.qp.qp_num)
        assert bytes(b.buf[0:16]) == bytes(16)  # nothing was written
    finally:
        fab.close()


def test_unregistered_local_buffer(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair
    _recv(fab, b, 1, 0, 100)
    _send(fab, a, 1, 0, 10, lkey=a.mr.lkey + 99)
    assert _poll(a) == [(1, E.IBV_WC_LOC_PROT_ERR, E.IBV_WC_SEND)]
    assert a.qp.qp_state == E.IBV_QPS_ERR


def test_send_larger_than_the_receive(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair
    _recv(fab, b, 1, 0, 8)
    _send(fab, a, 2, 0, 9)
    assert _poll(b) == [(1, E.IBV_WC_LOC_LEN_ERR, E.IBV_WC_RECV)]
    assert _poll(a) == [(2, E.IBV_WC_REM_INV_REQ_ERR, E.IBV_WC_SEND)]
    assert (a.qp.qp_state, b.qp.qp_state) == (E.IBV_QPS_ERR, E.IBV_QPS_ERR)


def test_receive_buffer_needs_local_write() -> None:
    fab = _fabric()
    try:
        a, b = _side(fab, "a"), _side(fab, "b", access=0)
        _connect(fab, a, "a", b, "b")
        _recv(fab, b, 1, 0, 64)
        _send(fab, a, 2, 0, 8)
        assert _poll(b) == [(1, E.IBV_WC_LOC_PROT_ERR, E.IBV_WC_RECV)]
        assert _poll(a) == [(2, E.IBV_WC_REM_OP_ERR, E.IBV_WC_SEND)]
    finally:
        fab.close()


def test_memory_region_rules(fab: Fabric) -> None:
    a = _side(fab, "a")
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(PyverbsRDMAError, match="remote write needs local write"):
        fab.lib.MR(a.pd, 64, E.IBV_ACCESS_REMOTE_WRITE, address=ctypes.addressof(buf))
    with pytest.raises(PyverbsRDMAError, match="0 bytes"):
        fab.lib.MR(a.pd, 0, 0, address=ctypes.addressof(buf))
    mr = fab.lib.MR(a.pd, 64, RW, address=ctypes.addressof(buf))
    assert mr.lkey != mr.rkey


# ---------------------------------------------------------------------------- RNR
def test_send_without_a_receive_is_rnr_then_error(fab: Fabric) -> None:
    a, b = _side(fab, "a"), _side(fab, "b")
    _connect(fab, a, "a", b, "b", rnr_retry=2)
    _send(fab, a, 1, 0, 4)
    [wc] = _wait(fab, a, 1)
    assert (wc.wr_id, wc.status) == (1, E.IBV_WC_RNR_RETRY_EXC_ERR)
    assert fab.stats["rnr_naks"] == 3  # the first try and two retries
    assert a.qp.qp_state == E.IBV_QPS_ERR
    assert b.qp.qp_state == E.IBV_QPS_RTS  # the responder is not affected


def test_write_with_immediate_without_a_receive_is_rnr(fab: Fabric) -> None:
    a, b = _side(fab, "a"), _side(fab, "b")
    _connect(fab, a, "a", b, "b", rnr_retry=0)
    _send(fab, a, 1, 0, 4, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, rkey=b.mr.rkey,
          remote=b.addr)
    assert _poll(a) == [(1, E.IBV_WC_RNR_RETRY_EXC_ERR, E.IBV_WC_RDMA_WRITE)]


def test_rnr_retries_succeed_once_a_receive_is_posted(fab: Fabric,
                                                      pair: tuple[Side, Side]) -> None:
    """rnr_retry 7 retries forever; the send, and those behind it, go once the
    responder posts receives."""
    a, b = pair
    a.buf[0:2] = b"ok"
    _send(fab, a, 1, 0, 2)
    _send(fab, a, 2, 0, 1)
    assert a.cq.poll(10) == (0, [])
    _recv(fab, b, 5, 0, 10)
    _recv(fab, b, 6, 100, 10)
    assert [w.wr_id for w in _wait(fab, b, 2)] == [5, 6]
    assert [(w.wr_id, w.status) for w in _wait(fab, a, 2)] == [(1, 0), (2, 0)]
    assert bytes(b.buf[0:2]) == b"ok"
    assert fab.stats["rnr_naks"] >= 1


# ---------------------------------------------------------------------------- paths
def test_psn_mismatch_times_out(fab: Fabric) -> None:
    a, b = _side(fab, "a"), _side(fab, "b")
    _connect(fab, a, "a", b, "b", retry_cnt=1, timeout=8)
    b.qp.rq_psn += 1  # as if b had been told another PSN
    _recv(fab, b, 1, 0, 10)
    _send(fab, a, 1, 0, 4)
    [wc] = _wait(fab, a, 1)
    assert wc.status == E.IBV_WC_RETRY_EXC_ERR
    assert fab.stats["timeouts"] == 2


def test_destroyed_peer_times_out(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.qp.close()
    _send(fab, a, 1, 0, 4)
    [wc] = _wait(fab, a, 1)
    assert wc.status == E.IBV_WC_RETRY_EXC_ERR


def test_port_down_times_out_and_reports(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair
    _recv(fab, b, 1, 0, 10)
    fab.port_down("b")
    assert b.ctx.get_async_event().event_type == E.IBV_EVENT_PORT_ERR
    with pytest.raises(PyverbsRDMAError) as info:
        b.ctx.get_async_event()
    assert info.value.error_code == errno.EAGAIN
    _send(fab, a, 1, 0, 4)
    [wc] = _wait(fab, a, 1)
    assert wc.status == E.IBV_WC_RETRY_EXC_ERR


def test_queue_pair_connected_elsewhere_times_out(fab: Fabric) -> None:
    a, b, c = _side(fab, "a"), _side(fab, "b"), _side(fab, "b")
    _connect(fab, a, "a", b, "b")
    b.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RESET), E.IBV_QP_STATE)
    _connect(fab, c, "b", b, "b")  # b now answers c only
    _recv(fab, b, 1, 0, 10)
    _send(fab, a, 1, 0, 4)
    assert _wait(fab, a, 1)[0].status == E.IBV_WC_RETRY_EXC_ERR


def test_roce_routes_by_gid_and_gid_type() -> None:
    fab = _fabric(roce=True)
    try:
        a, b = _side(fab, "ra"), _side(fab, "rb")
        _connect(fab, a, "ra", b, "rb", roce=True, sgid_index=1)
        _recv(fab, b, 1, 0, 10)
        _send(fab, a, 1, 0, 4)
        assert _poll(a) == [(1, 0, E.IBV_WC_SEND)]
        # v1 on one side, v2 on the other: no connection
        c, d = _side(fab, "ra"), _side(fab, "rb")
        _connect(fab, c, "ra", d, "rb", roce=True, sgid_index=1)
        d.qp.ah.gr.sgid_index = 0
        _recv(fab, d, 1, 0, 10)
        _send(fab, c, 1, 0, 4)
        assert _wait(fab, c, 1)[0].status == E.IBV_WC_RETRY_EXC_ERR
    finally:
        fab.close()


# ---------------------------------------------------------------------------- queues
def test_error_state_flushes_everything(fab: Fabric, pair: tuple[Side, Side]) -> None:
    _a, b = pair
    for i in range(3):
        _recv(fab, b, i, 0, 10)
    fab.fail_qp(b.qp.qp_num)
    assert _poll(b) == [(i, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV) for i in range(3)]
    assert b.ctx.get_async_event().event_type == E.IBV_EVENT_QP_FATAL
    _recv(fab, b, 9, 0, 10)  # posting in ERR is allowed: flushed at once
    assert _poll(b) == [(9, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV)]


def test_queue_depth_counts_until_polled(fab: Fabric) -> None:
    a, b = _side(fab, "a", send_wr=2), _side(fab, "b")
    _connect(fab, a, "a", b, "b")
    for i in range(4):
        _recv(fab, b, i, 0, 10)
    _send(fab, a, 1, 0, 1)
    _send(fab, a, 2, 0, 1)
    with pytest.raises(PyverbsRDMAError) as info:
        _send(fab, a, 3, 0, 1)  # both completed, neither polled: the queue is full
    assert info.value.error_code == errno.ENOMEM
    assert len(a.cq.poll(1)[1]) == 1
    _send(fab, a, 3, 0, 1)


def test_completion_queue_overflow(fab: Fabric) -> None:
    a, b = _side(fab, "a", cqe=2), _side(fab, "b")
    _connect(fab, a, "a", b, "b")
    for i in range(3):
        _recv(fab, b, i, 0, 10)
    for i in range(3):
        _send(fab, a, i, 0, 1)
    assert a.ctx.get_async_event().event_type == E.IBV_EVENT_CQ_ERR
    assert a.qp.qp_state == E.IBV_QPS_ERR


def test_channel_notifies_once_per_arm(fab: Fabric, pair: tuple[Side, Side]) -> None:
    a, b = pair

    def readable() -> bool:
        return bool(select.select([b.ch.fd], [], [], 0)[0])

    with pytest.raises(PyverbsRDMAError) as info:
        b.ch.get_cq_event(b.cq)
    assert info.value.error_code == errno.EAGAIN
    for i in range(4):
        _recv(fab, b, i, 0, 10)
    _send(fab, a, 1, 0, 1)  # not armed: no event
    assert not readable()
    b.cq.req_notify()
    _send(fab, a, 2, 0, 1)
    _send(fab, a, 3, 0, 1)
    assert readable()
    b.ch.get_cq_event(b.cq)  # one event for the arm, not one per completion
    assert not readable()
    b.cq.ack_events(1)
    assert b.cq.num_events == 0
    assert len(b.cq.poll(10)[1]) == 3


def test_deferred_mode_runs_work_later() -> None:
    queued: list[Any] = []
    fab = Fabric(schedule=lambda delay, fn: queued.append((delay, fn)))
    fab.add_device("a")
    fab.add_device("b")
    try:
        a, b = _side(fab, "a"), _side(fab, "b")
        _connect(fab, a, "a", b, "b")
        _recv(fab, b, 1, 0, 10)
        a.buf[0:1] = b"z"
        _send(fab, a, 1, 0, 1)
        a.buf[0:1] = b"y"  # the HCA reads the buffer when it runs the request, not now
        assert a.cq.poll(1) == (0, [])
        while queued:
            _delay, fn = queued.pop(0)
            fn()
        assert _poll(a) == [(1, 0, E.IBV_WC_SEND)]
        assert bytes(b.buf[0:1]) == b"y"
    finally:
        fab.close()


def test_crash_leaves_descriptors_to_their_owners(fab: Fabric,
                                                  pair: tuple[Side, Side]) -> None:
    a, b = pair
    fab.crash(b.ctx)
    with pytest.raises(PyverbsRDMAError):
        b.ctx.query_port(1)
    os.fstat(b.ch.fd)  # still open: closed by its owner
    _send(fab, a, 1, 0, 1)
    assert _wait(fab, a, 1)[0].status == E.IBV_WC_RETRY_EXC_ERR


def test_device_queries(fab: Fabric) -> None:
    ctx = fab.lib.Context(name="a")
    assert [d.name for d in fab.lib.get_device_list()] == [b"a", b"b"]
    attr = ctx.query_device()
    assert attr.phys_port_cnt == 1
    port = ctx.query_port(1)
    assert (port.state, port.link_layer, port.lid) == (E.IBV_PORT_ACTIVE,
                                                       E.IBV_LINK_LAYER_INFINIBAND, 1)
    assert ctx.query_gid(1, 0).gid.startswith("fe80:0000:0000:0000:0002:c903")
    with pytest.raises(PyverbsRDMAError):
        ctx.query_port(2)
    with pytest.raises(PyverbsRDMAError, match="Failed to find device"):
        fab.lib.Context(name="nope")
    with pytest.raises(PyverbsUserError, match="Invalid GID"):
        fab.lib.GID("fe80::1")  # pyverbs wants all 8 words
    ctx.close()


# ------------------------------------------------------------------ dma-buf and RDMA READ
RWR = RW | E.IBV_ACCESS_REMOTE_READ


def test_dmabuf_mr_rules() -> None:
    """pyverbs' DmaBufMR(pd, length, access, dmabuf=fd, offset): the descriptor must be an
    open dma-buf and the range inside it; the region's addresses are offsets (iova)."""
    from verbs_double import export_dmabuf

    fab = _fabric()
    fab.add_device("nodma")
    fab.devices["nodma"].dmabuf = False
    try:
        lib = fab.lib
        pd = lib.PD(lib.Context(name="a"))
        mem = ctypes.create_string_buffer(8192)
        fd = export_dmabuf(ctypes.addressof(mem), 8192)
        try:
            mr = lib.DmaBufMR(pd, 4096, RWR, dmabuf=fd, offset=4096)
            assert (mr.addr, mr.length) == (4096, 4096)  # iova = offset
            assert mr.translate(4096 + 5) == ctypes.addressof(mem) + 4096 + 5
            with pytest.raises(PyverbsRDMAError) as info:
                lib.DmaBufMR(pd, 4096, RWR, dmabuf=fd, offset=8192)
            assert info.value.error_code == errno.EINVAL
            other = os.memfd_create("not-a-dmabuf")
            with pytest.raises(PyverbsRDMAError) as info:
                lib.DmaBufMR(pd, 16, RWR, dmabuf=other, offset=0)
            assert info.value.error_code == errno.EINVAL
            os.close(other)
            with pytest.raises(PyverbsRDMAError) as info:
                lib.DmaBufMR(pd, 16, RWR, dmabuf=-1, offset=0)
            assert info.value.error_code == errno.EBADF
            with pytest.raises(PyverbsRDMAError) as info:
                lib.DmaBufMR(pd, 16, E.IBV_ACCESS_REMOTE_WRITE, dmabuf=fd)
            assert info.value.error_code == errno.EINVAL  # remote write needs local write
            nopd = lib.PD(lib.Context(name="nodma"))
            with pytest.raises(PyverbsRDMAError) as info:
                lib.DmaBufMR(nopd, 16, RWR, dmabuf=fd)
            assert info.value.error_code == errno.EOPNOTSUPP
        finally:
            os.close(fd)
        # registered regions outlive the descriptor, as the kernel's do
        assert pd.mrs[mr.lkey] is mr
    finally:
        fab.close()


def test_dmabuf_mr_of_older_pyverbs() -> None:
    old = Fabric(dmabuf_api="object")
    none = Fabric(dmabuf_api=None)
    old.add_device("a")
    try:
        pd = old.lib.PD(old.lib.Context(name="a"))
        with pytest.raises(TypeError, match="DmaBuf"):
            old.lib.DmaBufMR(pd, 16, RWR, dmabuf=3)
        assert none.lib.DmaBufMR is None
    finally:
        old.close()


def test_writes_and_reads_through_a_dmabuf_region(fab: Fabric, pair: tuple[Side, Side]
                                                  ) -> None:
    """A write lands at the dma-buf's memory through its iova; a region without remote
    write access refuses it (REM_ACCESS_ERR), as for ordinary regions."""
    from verbs_double import export_dmabuf

    a, b = pair
    mem = ctypes.create_string_buffer(8192)
    fd = export_dmabuf(ctypes.addressof(mem), 8192)
    try:
        mr = fab.lib.DmaBufMR(b.pd, 8192, RWR, dmabuf=fd, offset=0)
        ro = fab.lib.DmaBufMR(b.pd, 8192, E.IBV_ACCESS_LOCAL_WRITE, dmabuf=fd, offset=0)
    finally:
        os.close(fd)
    ctypes.memmove(a.addr, b"gpu!", 4)
    _send(fab, a, 1, 0, 4, opcode=E.IBV_WR_RDMA_WRITE, rkey=mr.rkey, remote=100)
    assert _poll(a) == [(1, E.IBV_WC_SUCCESS, E.IBV_WC_RDMA_WRITE)]
    assert mem.raw[100:104] == b"gpu!"
    _send(fab, a, 2, 0, 4, opcode=E.IBV_WR_RDMA_WRITE, rkey=ro.rkey, remote=100)
    assert _poll(a) == [(2, E.IBV_WC_REM_ACCESS_ERR, E.IBV_WC_RDMA_WRITE)]


def test_rdma_read_rules(fab: Fabric) -> None:
    """READ: the remote region needs remote read access and the responder queue pair
    must allow remote reads; the local region needs local write access."""
    for remote_access, qp_access, local_access, want in (
            (RWR, RWR, RW, E.IBV_WC_SUCCESS),
            (RW, RWR, RW, E.IBV_WC_REM_ACCESS_ERR),
            (RWR, RW, RW, E.IBV_WC_REM_ACCESS_ERR),
            (RWR, RWR, 0, E.IBV_WC_LOC_PROT_ERR)):
        a = _side(fab, "a", access=local_access)
        b = _side(fab, "b", access=remote_access)
        _connect(fab, a, "a", b, "b", access=qp_access)
        ctypes.memmove(b.addr, b"remote", 6)
        _send(fab, a, 7, 0, 6, opcode=E.IBV_WR_RDMA_READ, rkey=b.mr.rkey, remote=b.addr)
        assert _poll(a) == [(7, want, E.IBV_WC_RDMA_READ)]
        if want == E.IBV_WC_SUCCESS:
            assert a.buf.raw[:6] == b"remote"
            assert fab.stats["read"] >= 1


def test_loopback_queue_pair_reads_its_own_memory(fab: Fabric) -> None:
    a = _side(fab, "a", access=RWR)
    port = fab.devices["a"].ports[0]
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_INIT, port_num=1, pkey_index=0,
                      qp_access_flags=RWR), INIT_MASK)
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTR, path_mtu=E.IBV_MTU_1024,
                      dest_qp_num=a.qp.qp_num, rq_psn=5, max_dest_rd_atomic=1,
                      min_rnr_timer=1, ah_attr=fab.lib.AHAttr(dlid=port.lid, port_num=1)),
                RTR_MASK)
    a.qp.modify(_attr(fab, qp_state=E.IBV_QPS_RTS, sq_psn=5, timeout=10, retry_cnt=2,
                      rnr_retry=7, max_rd_atomic=1), RTS_MASK)
    ctypes.memmove(a.addr + 100, b"x", 1)
    _send(fab, a, 1, 0, 1, opcode=E.IBV_WR_RDMA_READ, rkey=a.mr.rkey, remote=a.addr + 100)
    assert _poll(a) == [(1, E.IBV_WC_SUCCESS, E.IBV_WC_RDMA_READ)]
    assert a.buf.raw[:1] == b"x"


def test_device_memory_needs_a_peer_memory_module() -> None:
    mem = ctypes.create_string_buffer(4096)
    base = ctypes.addressof(mem)
    for peermem in (False, True):
        fab = _fabric()
        fab.peermem = peermem
        fab.device_memory = lambda addr, n: addr < base + 4096 and base < addr + n
        try:
            pd = fab.lib.PD(fab.lib.Context(name="a"))
            if peermem:
                assert fab.lib.MR(pd, 4096, RW, address=base).length == 4096
            else:
                with pytest.raises(PyverbsRDMAError) as info:
                    fab.lib.MR(pd, 4096, RW, address=base)
                assert info.value.error_code == errno.EFAULT
        finally:
            fab.close()
