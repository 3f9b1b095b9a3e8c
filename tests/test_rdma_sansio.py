"""The sans-IO parts of the RDMA transport, with plain values (no verbs, no loop):
port discovery and GID choice, the queue-pair record and transitions, frames, credits and
the rendezvous tables, the registration cache, and what failures mean."""

from __future__ import annotations

import gc
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acoll._transport.rdma import discovery, failures, flow, qp, regcache, spec, wire
from acoll._transport.rdma.discovery import GidEntry, PortInfo
from acoll._transport.rdma.flow import Credits, RecvTable, SendState, SendTable
from acoll.errors import ProtocolError
from verbs_double import E, gid_v4, gid_v6

IB, ETH = spec.LINK_LAYER_INFINIBAND, spec.LINK_LAYER_ETHERNET
V1, V2 = spec.GID_TYPE_ROCE_V1, spec.GID_TYPE_ROCE_V2


def _port(device: str = "mlx5_0", port: int = 1, *, state: int = spec.PORT_ACTIVE,
          layer: int = IB, lid: int = 7, gids: tuple[GidEntry, ...] = ()) -> PortInfo:
    if layer == IB and not gids:
        gids = (GidEntry(0, gid_v6("fe80::2:c903:0:7"), spec.GID_TYPE_IB),)
    return PortInfo(device, port, state, layer, 5, lid=lid if layer == IB else 0, speed=64,
                    width=2, gids=gids, max_qp_wr=32768, max_sge=30)


ROCE_GIDS = (GidEntry(0, gid_v6("fe80::1"), V1), GidEntry(1, gid_v6("fe80::1"), V2),
             GidEntry(2, gid_v4("10.0.0.5"), V1), GidEntry(3, gid_v4("10.0.0.5"), V2),
             GidEntry(4, gid_v6("2001:db8::5"), V2))


# ---------------------------------------------------------------------------- spec values
def test_spec_values_agree_with_the_double() -> None:
    """Two transcriptions of verbs.h (the transport's and the test double's) agree."""
    assert spec.QPS_RESET == E.IBV_QPS_RESET
    assert spec.QPS_ERR == E.IBV_QPS_ERR
    assert spec.QPS_RTS == E.IBV_QPS_RTS
    assert spec.ACCESS_REMOTE_WRITE == E.IBV_ACCESS_REMOTE_WRITE
    assert spec.WC_RECV_RDMA_WITH_IMM == E.IBV_WC_RECV_RDMA_WITH_IMM
    assert spec.WC_STATUS_NAMES[E.IBV_WC_RNR_RETRY_EXC_ERR] == "RNR_RETRY_EXC_ERR"
    assert spec.WC_STATUS_NAMES[E.IBV_WC_REM_ACCESS_ERR] == "REM_ACCESS_ERR"
    assert spec.EVENT_NAMES[E.IBV_EVENT_PORT_ERR] == "PORT_ERR"
    assert spec.GID_TYPE_ROCE_V2 == E.IBV_GID_TYPE_ROCE_V2
    assert qp.MASK["dest_qp_num"] == E.IBV_QP_DEST_QPN
    assert qp.MASK["min_rnr_timer"] == E.IBV_QP_MIN_RNR_TIMER
    assert spec.mtu_bytes(5) == 4096
    assert spec.mtu_enum(256) == 1
    with pytest.raises(ValueError, match="ibv_mtu"):
        spec.mtu_bytes(6)
    with pytest.raises(ValueError, match="path MTU"):
        spec.mtu_enum(1500)


# ---------------------------------------------------------------------------- discovery
def test_usable_ports_keep_active_ib_and_roce() -> None:
    ports = [_port("mlx5_0", 1), _port("mlx5_0", 2, state=1),
             _port("mlx5_1", 1, layer=ETH, gids=ROCE_GIDS), _port("odd", 1, layer=0)]
    found, why = discovery.usable_ports(ports)
    assert why == ""
    assert [p.name for p, _ in found] == ["mlx5_0:1", "mlx5_1:1"]


@pytest.mark.parametrize(("spec_text", "names"), [
    ("mlx5_1", ["mlx5_1:1"]),
    ("mlx5", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1"]),
    ("=mlx5", []),
    ("mlx5_0:2", ["mlx5_0:2"]),
    ("^mlx5_0", ["mlx5_1:1"]),
    ("^mlx5_0:1", ["mlx5_0:2", "mlx5_1:1"]),
    ("=mlx5_0:1,mlx5_1", ["mlx5_0:1", "mlx5_1:1"]),
])
def test_hca_filter(spec_text: str, names: list[str]) -> None:
    ports = [_port("mlx5_0", 1), _port("mlx5_0", 2), _port("mlx5_1", 1)]
    found, why = discovery.usable_ports(ports, spec_text)
    assert [p.name for p, _ in found] == names
    assert bool(why) == (not names)
    if not names:
        assert "excluded by ACOLL_IB_HCA" in why


def test_why_no_port() -> None:
    assert discovery.usable_ports([]) == ([], "no RDMA device")
    _found, why = discovery.usable_ports([_port(state=1), _port(layer=ETH, gids=())])
    assert why == "no usable RDMA port: 2 port(s) found, 1 not active, 1 without a usable " \
                  "address (no LID / RoCE GID)"
    _found, why = discovery.usable_ports([_port(lid=0)])
    assert "without a usable address" in why
    with pytest.raises(ValueError, match="no device name"):
        discovery.usable_ports([_port()], "^")


def test_gid_choice_prefers_roce_v2_ipv4() -> None:
    port = _port(layer=ETH, gids=ROCE_GIDS)
    assert discovery.choose_gid(port).index == 3  # type: ignore[union-attr]
    # without IPv4-mapped v2: a global IPv6 v2, then a link-local v2, then v1
    rest = [g for g in ROCE_GIDS if g.index != 3]
    assert discovery.choose_gid(_port(layer=ETH, gids=tuple(rest))).index == 4  # type: ignore[union-attr]
    rest = [g for g in rest if g.index != 4]
    assert discovery.choose_gid(_port(layer=ETH, gids=tuple(rest))).index == 1  # type: ignore[union-attr]
    v1 = (ROCE_GIDS[0], ROCE_GIDS[2])
    assert discovery.choose_gid(_port(layer=ETH, gids=v1)).index == 2  # type: ignore[union-attr]
    assert discovery.choose_gid(_port(layer=ETH, gids=())) is None
    # empty entries are skipped
    empty = (GidEntry(0, bytes(16), V2),)
    assert discovery.choose_gid(_port(layer=ETH, gids=empty)) is None


def test_gid_index_setting() -> None:
    port = _port(layer=ETH, gids=ROCE_GIDS)
    assert discovery.choose_gid(port, 0).index == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"ACOLL_IB_GID_INDEX=9: .* no GID at that index"):
        discovery.choose_gid(port, 9)
    assert discovery.choose_gid(_port()).index == 0  # type: ignore[union-attr]


def test_gid_entry() -> None:
    g = GidEntry(3, gid_v4("10.1.2.3"), V2)
    assert str(g.ipv4) == "10.1.2.3"
    assert str(g) == "GID[3] ::ffff:a01:203 (RoCEv2)"
    assert GidEntry(0, gid_v6("fe80::1"), V1).ipv4 is None
    with pytest.raises(ValueError, match="16 bytes"):
        GidEntry(0, b"\0" * 4, V1)


def test_speed_and_description() -> None:
    assert discovery.link_gbps(64, 2) == 212.5  # HDR 4x
    assert discovery.link_gbps(32, 2) == 103.125  # EDR 4x
    assert discovery.link_gbps(1, 1) == 2.5
    assert discovery.link_gbps(0, 2) == 0
    assert discovery.link_gbps(0, 2, speed_ex=256) == 850.0  # XDR 4x
    line = _port().describe(GidEntry(0, gid_v6("fe80::1"), spec.GID_TYPE_IB))
    assert line.startswith("mlx5_0:1 IB 212.5 Gb/s, MTU 4096, LID 0x7, GID[0] fe80::1 (IB)")
    assert "max_qp_wr 32768" in line
    roce = _port(layer=ETH, gids=ROCE_GIDS)
    assert "RoCE" in roce.describe(ROCE_GIDS[3])
    assert "::ffff:a00:5" in roce.describe(
        ROCE_GIDS[3])


# ---------------------------------------------------------------------------- QP set-up
INFO = qp.QpInfo(qpn=0x123, psn=0xABCDE, lid=7, gid=gid_v6("fe80::7"), mtu=5, link_layer=IB)
PEER = qp.QpInfo(qpn=0x456, psn=0x11, lid=9, gid=gid_v6("fe80::9"), mtu=3, link_layer=IB)


def test_qp_info_roundtrip_and_checks() -> None:
    assert qp.QpInfo.unpack(INFO.pack()) == INFO
    good = msgpack.unpackb(INFO.pack())
    for change, match in [({"v": 2}, "version"), ({"qpn": 0}, "out of range"),
                          ({"qpn": 1 << 24}, "out of range"), ({"psn": -1}, "out of range"),
                          ({"gid": b"x"}, "16 bytes"), ({"mtu": 7}, "ibv_mtu"),
                          ({"ll": 5}, "link layer"), ({"lid": "7"}, "lid is a str"),
                          ({"gid": "fe80::"}, "gid is a str")]:
        with pytest.raises(ProtocolError, match=match):
            qp.QpInfo.unpack(msgpack.packb({**good, **change}))
    for raw in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1})):
        with pytest.raises(ProtocolError, match="bad QP info"):
            qp.QpInfo.unpack(raw)


def test_transitions_carry_what_the_spec_requires() -> None:
    s = qp.QpSettings(timeout=14, retry_cnt=6, rnr_retry=7, min_rnr_timer=12)
    init = qp.init_transition(1, s)
    assert init.state == spec.QPS_INIT
    assert init.mask == (E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT
                         | E.IBV_QP_ACCESS_FLAGS)
    assert init.attrs["qp_access_flags"] == (E.IBV_ACCESS_LOCAL_WRITE
                                             | E.IBV_ACCESS_REMOTE_WRITE)
    rtr = qp.rtr_transition(INFO, PEER, 1, 0, s)
    assert rtr.mask == (E.IBV_QP_STATE | E.IBV_QP_AV | E.IBV_QP_PATH_MTU | E.IBV_QP_DEST_QPN
                        | E.IBV_QP_RQ_PSN | E.IBV_QP_MAX_DEST_RD_ATOMIC
                        | E.IBV_QP_MIN_RNR_TIMER)
    assert (rtr.attrs["dest_qp_num"], rtr.attrs["rq_psn"], rtr.attrs["path_mtu"]) == (
        0x456, 0x11, 3)
    assert rtr.attrs["ah_attr"] == {"is_global": 0, "dlid": 9, "sl": 0, "port_num": 1}
    rts = qp.rts_transition(INFO, s)
    assert rts.mask == (E.IBV_QP_STATE | E.IBV_QP_SQ_PSN | E.IBV_QP_TIMEOUT
                        | E.IBV_QP_RETRY_CNT | E.IBV_QP_RNR_RETRY | E.IBV_QP_MAX_QP_RD_ATOMIC)
    assert (rts.attrs["sq_psn"], rts.attrs["timeout"], rts.attrs["retry_cnt"]) == (
        0xABCDE, 14, 6)


def test_roce_rtr_uses_the_grh() -> None:
    local = qp.QpInfo(1, 2, 0, gid_v4("10.0.0.1"), 3, ETH)
    remote = qp.QpInfo(3, 4, 0, gid_v4("10.0.0.2"), 4, ETH)
    rtr = qp.rtr_transition(local, remote, 1, 3, qp.QpSettings(traffic_class=106))
    ah = rtr.attrs["ah_attr"]
    assert (ah["is_global"], ah["dgid"], ah["sgid_index"], ah["traffic_class"]) == (
        1, gid_v4("10.0.0.2"), 3, 106)
    assert rtr.attrs["path_mtu"] == 3
    with pytest.raises(ProtocolError, match="empty GID"):
        qp.rtr_transition(local, qp.QpInfo(3, 4, 0, bytes(16), 4, ETH), 1, 3, qp.QpSettings())
    with pytest.raises(ProtocolError, match="link layer"):
        qp.rtr_transition(local, PEER, 1, 0, qp.QpSettings())
    with pytest.raises(ProtocolError, match="LID 0"):
        qp.rtr_transition(INFO, qp.QpInfo(3, 4, 0, gid_v6("fe80::9"), 4, IB), 1, 0,
                          qp.QpSettings())


def test_path_mtu_is_the_smaller_capped() -> None:
    assert qp.path_mtu(INFO, PEER, qp.QpSettings()) == 3
    assert qp.path_mtu(INFO, INFO, qp.QpSettings(mtu=4)) == 4
    assert qp.path_mtu(PEER, INFO, qp.QpSettings(mtu=5)) == 3


@pytest.mark.parametrize(("field", "value"), [("timeout", 32), ("retry_cnt", 8),
                                              ("rnr_retry", -1), ("sl", 16),
                                              ("hop_limit", 0), ("mtu", 9)])
def test_qp_settings_ranges(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field if field != "mtu" else "ibv_mtu"):
        qp.QpSettings(**{field: value})


def test_ack_timeout() -> None:
    assert qp.QpSettings(timeout=14).ack_timeout_s == pytest.approx(0.0671, rel=1e-3)
    assert qp.QpSettings(timeout=0).ack_timeout_s == float("inf")


def test_handshake_order() -> None:
    hs = qp.Handshake()
    assert qp.QpInfo.unpack(hs.created(INFO)) == INFO
    hs.sent()
    assert hs.got(PEER.pack()) == PEER
    hs.rts()
    assert not hs.can_send
    hs.ready()
    assert hs.can_send
    def run(h: qp.Handshake, step: str) -> None:
        if step == "created":
            h.created(INFO)
        elif step == "got":
            h.got(PEER.pack())
        else:
            getattr(h, step)()

    for steps in (["sent"], ["got"], ["created", "rts"], ["created", "sent", "ready"]):
        h = qp.Handshake()
        for step in steps[:-1]:
            run(h, step)
        with pytest.raises(ProtocolError, match="QP set-up"):
            run(h, steps[-1])
        assert h.step is qp.Step.FAILED
    h = qp.Handshake()
    h.created(INFO)
    h.sent()
    with pytest.raises(ProtocolError):
        h.got(b"junk")
    assert h.step is qp.Step.FAILED


# ---------------------------------------------------------------------------- frames
def test_frames_roundtrip() -> None:
    buf = memoryview(bytearray(wire.HEADER.size + 100))
    n = wire.pack_into(buf, wire.DATA, credits=3, tag=2**64 - 1, total=1000, offset=900,
                       length=100, meta=bytes(range(16)))
    assert n == wire.HEADER.size + 100
    f = wire.parse(buf, n)
    assert (f.kind, f.credits, f.tag, f.total, f.offset, f.length, f.meta) == (
        wire.DATA, 3, 2**64 - 1, 1000, 900, 100, bytes(range(16)))
    n = wire.pack_into(buf, wire.CTS, send_id=7, total=5 << 20, addr=0x7F0012345000,
                       rkey=0xBEEF, rid=42)
    f = wire.parse(buf, n)
    assert (f.kind, f.send_id, f.total, f.addr, f.rkey, f.rid) == (
        wire.CTS, 7, 5 << 20, 0x7F0012345000, 0xBEEF, 42)
    n = wire.pack_into(buf, wire.DATA, send_id=7, total=10, length=10, flags=wire.PUSH)
    assert wire.parse(buf, n).flags == wire.PUSH


def test_bad_frames() -> None:
    buf = memoryview(bytearray(200))
    with pytest.raises(ProtocolError, match="shorter than its header"):
        wire.parse(buf, 10)
    n = wire.pack_into(buf, 99)
    with pytest.raises(ProtocolError, match="unknown RDMA frame kind 99"):
        wire.parse(buf, n)
    n = wire.pack_into(buf, wire.DATA, total=100, length=50)
    with pytest.raises(ProtocolError, match="announces 50 bytes and carries 49"):
        wire.parse(buf, n - 1)
    n = wire.pack_into(buf, wire.CTS)
    with pytest.raises(ProtocolError, match="CTS frame carries 4 unexpected"):
        wire.parse(buf, n + 4)
    n = wire.pack_into(buf, wire.DATA, total=10, offset=8, length=5)
    with pytest.raises(ProtocolError, match="exceeds its message"):
        wire.parse(buf, n)
    n = wire.pack_into(buf, wire.RTS, flags=wire.PUSH)
    with pytest.raises(ProtocolError, match="bad flags"):
        wire.parse(buf, n)
    wire.pack_into(buf, wire.CREDIT)
    buf[2] = 1
    with pytest.raises(ProtocolError, match="reserved"):
        wire.parse(buf, wire.HEADER.size)


# ---------------------------------------------------------------------------- credits
def test_credits_reserve_and_return() -> None:
    c = Credits(4)
    assert c.can_send()
    for _ in range(3):
        assert c.spend() == 0
    assert not c.can_send()  # the last credit is for a CREDIT frame
    assert c.can_send(credit_frame=True)
    c.arrived(2)  # the peer consumed one of ours and returned 2
    assert c.available == 3
    c.reposted()
    assert not c.should_return()  # 1 owed: below half the depth, the peer has 3 left
    c.reposted()
    assert c.should_return()  # half the depth owed
    assert c.spend() == 2
    assert not c.should_return()
    # a peer down to its reserve + 1 gets even a single owed credit back at once
    d = Credits(8)
    for _ in range(6):
        d.arrived(0)
    d.reposted()
    assert d.owed == 1
    assert d.should_return()


def test_credits_violations() -> None:
    c = Credits(4)
    with pytest.raises(ProtocolError, match="returned 1 credits; only 0"):
        c.arrived(1)
    c = Credits(4, 4)
    for _ in range(4):
        c.arrived(0)
    with pytest.raises(ProtocolError, match="without a receive credit"):
        c.arrived(0)
    with pytest.raises(ValueError, match="too small"):
        Credits(3)
    c = Credits(4)
    for _ in range(4):
        c.spend_silent()
    with pytest.raises(RuntimeError):
        c.spend()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), depth_a=st.integers(4, 12), depth_b=st.integers(4, 12))
def test_credits_never_deadlock_or_overrun(seed: int, depth_a: int, depth_b: int) -> None:
    """Two ends sending random amounts with random delivery delays: every message goes
    out eventually, no end ever sends into a missing receive, and when both are idle
    neither waits for credits the other owes."""
    rng = random.Random(seed)
    ends = [Credits(depth_b, depth_a), Credits(depth_a, depth_b)]
    posted = [depth_a, depth_b]  # receives each end has posted
    todo = [rng.randrange(0, 200), rng.randrange(0, 200)]
    wires: list[list[int]] = [[], []]  # frames in flight to end i: returned credits
    for _ in range(20_000):
        moves = []
        for i in (0, 1):
            if todo[i] and ends[i].can_send():
                moves.append(("send", i))
            if ends[i].should_return() and ends[i].can_send(credit_frame=True):
                moves.append(("credit", i))
            if wires[1 - i]:
                moves.append(("deliver", 1 - i))
        if not moves:
            break
        kind, i = rng.choice(moves)
        if kind in ("send", "credit"):
            if kind == "send":
                todo[i] -= 1
            wires[1 - i].append(ends[i].spend())
        else:  # a frame reaches end i: it consumed a receive there, which is re-posted
            assert posted[i] > 0, "a frame met no posted receive"
            posted[i] -= 1
            ends[i].arrived(wires[i].pop(0))
            posted[i] += 1
            ends[i].reposted()
    assert todo == [0, 0]
    assert wires == [[], []]


# ---------------------------------------------------------------------------- rendezvous
def test_send_table_life() -> None:
    t: SendTable[str] = SendTable()
    a, b = t.add(100, "a"), t.add(200, "b")
    assert a != b
    assert len(t) == 2
    assert t.cts(a, 100) == "a"
    assert t.state(a) is SendState.WRITING
    with pytest.raises(ProtocolError, match="second CTS"):
        t.cts(a, 100)
    with pytest.raises(ProtocolError, match="advertises 150 bytes for a message of 200"):
        t.cts(b, 150)
    with pytest.raises(ProtocolError, match="which is being written"):
        t.drop(a)
    with pytest.raises(ProtocolError, match="not sending"):
        t.cts(999, 1)
    assert t.done(a) == "a"
    assert t.drop(b) == "b"
    assert len(t) == 0


def test_send_table_push_crossing_cts_and_drop() -> None:
    t: SendTable[str] = SendTable()
    a, b, c = t.add(10, "a"), t.add(20, "b"), t.add(30, "c")
    t.cts(b, 20)
    assert t.push() == [(a, "a"), (c, "c")]
    assert t.cts(a, 10) is None  # the CTS crossed the push: ignored
    assert t.drop(c) is None  # so does a DROP; the push ends it
    assert t.state(c) is SendState.PUSHING
    assert t.done(c) == "c"
    assert sorted(t.clear()) == ["a", "b"]


def test_recv_table_ids_wrap_and_skip_used() -> None:
    t: RecvTable[str] = RecvTable()
    t._next = (1 << 32) - 1
    first, second = t.add("x"), t.add("y")
    assert (first, second) == ((1 << 32) - 1, 1)  # 32-bit ids, 0 never used
    t._next = 1
    assert t.add("z") == 2  # 1 is in use
    assert t.written(second) == "y"
    with pytest.raises(ProtocolError, match="no advertised buffer"):
        t.written(second)
    assert t.take(first) == "x"
    assert t.take(first) is None


def test_chunks() -> None:
    assert list(flow.chunks(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(flow.chunks(8, 4)) == [(0, 4), (4, 4)]
    assert list(flow.chunks(0, 4)) == []
    with pytest.raises(ValueError, match="positive"):
        list(flow.chunks(1, 0))


# ---------------------------------------------------------------------------- reg cache
class _Owner:
    """Anything weakly referenceable stands for an array owning memory."""


class _Log:
    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int, bool]] = {}
        self.n = 0

    def reg(self, addr: int, length: int, writable: bool) -> int:
        self.n += 1
        self.live[self.n] = (addr, length, writable)
        return self.n

    def dereg(self, region: int) -> None:
        del self.live[region]


def test_cache_hits_inside_a_registered_range() -> None:
    log = _Log()
    c: regcache.RegCache[int] = regcache.RegCache(log.reg, log.dereg)
    owner = _Owner()
    e = c.acquire(0x1000, 100, True, owner, extent=(0x1000, 4096))
    c.release(e)
    again = c.acquire(0x1800, 64, False, owner)  # read-only request, writable entry
    assert again is e
    assert (c.hits, c.misses) == (1, 1)
    c.release(again)
    # a writable request does not take a read-only entry
    ro = c.acquire(0x9000, 10, False, owner)
    c.release(ro)
    rw = c.acquire(0x9000, 10, True, owner)
    assert rw is not ro
    assert c.misses == 3
    c.release(rw)
    with pytest.raises(ValueError, match="does not contain"):
        c.acquire(0x20000, 100, False, owner, extent=(0x20010, 4096))


def test_cache_evicts_idle_least_recent_only() -> None:
    log = _Log()
    c: regcache.RegCache[int] = regcache.RegCache(log.reg, log.dereg, max_entries=2)
    owners = [_Owner() for _ in range(4)]
    held = c.acquire(0x1000, 10, False, owners[0])
    for i in (1, 2):
        c.release(c.acquire(0x1000 * (i + 1), 10, False, owners[i]))
    assert len(c) == 2
    assert c.evictions == 1  # the idle 0x2000 went, the held one stayed
    assert [a for a, _, _ in log.live.values()] == [0x1000, 0x3000]
    c.release(held)
    c.release(c.acquire(0x5000, 10, False, owners[3]))
    assert [a for a, _, _ in log.live.values()] == [0x3000, 0x5000]


def test_cache_bytes_limit() -> None:
    log = _Log()
    c: regcache.RegCache[int] = regcache.RegCache(log.reg, log.dereg, max_bytes=100)
    owner = _Owner()
    c.release(c.acquire(0x1000, 60, False, owner))
    c.release(c.acquire(0x2000, 60, False, owner))
    assert len(c) == 1
    assert c.registered_bytes == 60


def test_cache_entry_dies_with_its_owner() -> None:
    log = _Log()
    c: regcache.RegCache[int] = regcache.RegCache(log.reg, log.dereg)
    owner = _Owner()
    c.release(c.acquire(0x1000, 10, False, owner))
    del owner
    gc.collect()
    # the same address, reused by new memory, is not served from the stale entry
    fresh = _Owner()
    e = c.acquire(0x1000, 10, False, fresh)
    assert c.misses == 2
    assert len(log.live) == 1  # the stale region was deregistered
    c.release(e)


def test_cache_uncached_owner_and_close() -> None:
    log = _Log()
    c: regcache.RegCache[int] = regcache.RegCache(log.reg, log.dereg)
    e = c.acquire(0x1000, 10, False, 12345)  # an int cannot be weakly referenced
    assert len(c) == 0
    assert len(log.live) == 1
    c.release(e)
    assert not log.live
    owner = _Owner()
    busy = c.acquire(0x2000, 10, False, owner)
    c.release(c.acquire(0x3000, 10, False, owner))
    assert c.close() == [busy]
    assert len(log.live) == 1  # in use: deregistered at its release
    c.release(busy)
    assert not log.live
    with pytest.raises(ValueError, match="closed"):
        c.acquire(0x1000, 1, False, owner)
    with pytest.raises(RuntimeError, match="released more often"):
        c.release(busy)


# ---------------------------------------------------------------------------- failures
def test_completion_failure_messages() -> None:
    msg = failures.completion_failure(E.IBV_WC_RETRY_EXC_ERR, "sending to", "host:1", 0x81)
    assert msg == ("RDMA sending to host:1 failed: RETRY_EXC_ERR, vendor error 0x81 (the "
                   "peer stopped answering (process or node gone, link down, or a "
                   "path/MTU/PSN mismatch))")
    assert "REM_ACCESS_ERR" in failures.completion_failure(E.IBV_WC_REM_ACCESS_ERR, "w", "p")
    assert "status 99" in failures.completion_failure(99, "w", "p")
    assert failures.is_flush(E.IBV_WC_WR_FLUSH_ERR)
    assert not failures.is_flush(E.IBV_WC_RETRY_EXC_ERR)


@pytest.mark.parametrize(("event", "scope"), [
    (E.IBV_EVENT_QP_FATAL, failures.Scope.QP), (E.IBV_EVENT_QP_ACCESS_ERR, failures.Scope.QP),
    (E.IBV_EVENT_QP_REQ_ERR, failures.Scope.QP), (E.IBV_EVENT_CQ_ERR, failures.Scope.CQ),
    (E.IBV_EVENT_PORT_ERR, failures.Scope.PORT),
    (E.IBV_EVENT_DEVICE_FATAL, failures.Scope.DEVICE),
    (E.IBV_EVENT_PORT_ACTIVE, failures.Scope.NONE), (E.IBV_EVENT_COMM_EST, failures.Scope.NONE),
    (E.IBV_EVENT_LID_CHANGE, failures.Scope.NONE), (77, failures.Scope.NONE)])
def test_event_scopes(event: int, scope: failures.Scope) -> None:
    assert failures.event_scope(event)[0] is scope
