"""The native ring (acoll/_native/ring.c, acoll._comm.native_ring): the C code on its own
(threads joined by socket pairs), then inside communicators whose ranks talk over TCP:
the same bits as the Python ring, mismatches named, failures and timeouts, groups,
the build's fallbacks, and raw links that refuse strangers."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import acoll
import acoll._native as native
from acoll._comm import native_ring
from acoll._dtypes import DTYPES, finish_avg
from acoll.testing import run_ranks

LIB = native.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the native ring cannot "
                               "be built here (ACOLL_DEBUG=INFO says why)")

NATIVE_DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float32,
                 np.float64]
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}
HEADER = bytes(range(32))


def _inputs(n: int, count: int, dtype: Any, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        xs = [rng.standard_normal(count).astype(dt) for _ in range(n)]
        if count > 8:  # NaNs and signed zeros: the ties and propagation of max/min
            xs[0][3] = np.nan
            xs[1 % n][5] = -0.0
            xs[0][5] = 0.0
        return xs
    info = np.iinfo(dt)
    return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
            for _ in range(n)]


def _ring_reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """What the ring computes, in its order: segment j starts at rank j and is combined
    as ``x[j+k] (op) acc`` at each next rank (acoll's Python ring: reduce(out, src, tmp))."""
    n, count = len(xs), xs[0].size
    out = np.empty_like(xs[0])
    base, extra = divmod(count, n)
    start = 0
    for j in range(n):
        length = base + (1 if j < extra else 0)
        sl = slice(start, start + length)
        acc = xs[j][sl].copy()
        for k in range(1, n):
            _UFUNC[op](xs[(j + k) % n][sl], acc, out=acc)
        if op == "avg":
            finish_avg(acc, n)
        out[sl] = acc
        start += length
    return out


PATHS = ["helper", "inline", "mixed"]


def _inline_max(path: str, rank: int) -> int:
    inline = path == "inline" or (path == "mixed" and rank % 2 == 0)
    return 1 << 62 if inline else -1


def _ring_threads(srcs: list[np.ndarray], dsts: list[np.ndarray], dtype: Any, op: int,
                  *, mode: int = native.NativeLib.ALL_REDUCE, count: int | None = None,
                  send_items: int = 333, headers: list[bytes] | None = None,
                  deadline_ns: int = 0, path: str = "helper",
                  stages: list[Any] | None = None) -> list[tuple[int, int, bytes]]:
    """Run the C call on ``len(srcs)`` threads, rank i sending to i + 1 over a socket
    pair. ``count``: items per block (default: a whole all-reduce input). ``path``: every
    rank sends from its helper thread ("helper"), every rank runs its call on one thread
    ("inline"), or even ranks inline and odd ones the helper ("mixed")."""
    assert LIB is not None
    n = len(srcs)
    pairs = [socket.socketpair() for _ in range(n)]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    block = count if count is not None else 0
    scratch = [np.empty(max(1, block * (n - 2)), dtype) for _ in range(n)]
    results: list[Any] = [None] * n
    code = DTYPES[np.dtype(dtype)]

    def rank(r: int) -> None:
        results[r] = LIB.run(
            mode, pairs[r][0].fileno(), pairs[(r - 1) % n][1].fileno(), srcs[r].ctypes.data,
            dsts[r].ctypes.data, scratch[r].ctypes.data if n > 2 else 0,
            srcs[r].size if count is None else count, code, op, r, n, send_items,
            deadline_ns, native.State(), headers[r] if headers else HEADER,
            _inline_max(path, r), None if stages is None else stages[r])

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for a, b in pairs:
        a.close()
        b.close()
    return results


@needs_lib
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("path", PATHS)
def test_c_ring_computes_the_ring_order_bit_for_bit(n: int, dtype: Any, op: str,
                                                    path: str) -> None:
    for count in (0, 1, n - 1, 1000, 70_001):
        xs = _inputs(n, count, dtype, seed=count)
        expect = _ring_reference(xs, op)
        srcs = [x.copy() for x in xs]
        in_place = count % 2 == 0
        dsts = srcs if in_place else [np.full_like(x, 7) for x in xs]
        results = _ring_threads(srcs, dsts, dtype, OPS[op], path=path)
        assert all(r[0] == native.NR.OK for r in results), results
        for r in range(n):
            assert dsts[r].tobytes() == expect.tobytes(), (count, r)
            if not in_place:
                assert srcs[r].tobytes() == xs[r].tobytes()  # (the input is only read)


_BASE = 0xFFFFFFF0  # (the copy counters start here: their values wrap around mid-call)


def _later(value: int, than: int) -> bool:
    """``value`` has reached ``than``, compared cyclically as ``ring.c`` and
    ``cuStreamWaitValue32`` compare them."""
    return (value - than) & 0xFFFFFFFF < 0x80000000


def _staged_ring(xs: list[np.ndarray], op: str, piece: int, path: str, *, hold: bool = False,
                 pause: float = 0.0, deadline_s: float = 20.0
                 ) -> tuple[list[tuple[int, int, bytes]], list[np.ndarray], list[np.ndarray]]:
    """The staged all-reduce (ring.c's contract) with a copier thread per rank standing in
    for the device's stream: it lands ``xs[r]`` in the host copy piece by piece (a pause
    before each), bumping the ready counter, then copies each piece of the result out once
    the final counter lets it. The host copies start as garbage, so a piece read before it
    landed spoils the result. ``hold``: rank 1 holds back its downloads of segment 0 until
    rank 0 has published a final piece, which it can only do mid-call (rank 0 needs
    rank 1's segment 0 to finish). Returns the calls' results, the copied-out results, and
    the piece orders' landing times."""
    n, count = len(xs), xs[0].size
    hosts = [np.frombuffer(b"\x7f" * x.nbytes, x.dtype).copy() for x in xs]
    outs = [np.zeros_like(x) for x in xs]
    words = [np.full(32, _BASE, np.uint32) for _ in range(n)]
    stages = [native.Stage(w.ctypes.data, w.ctypes.data + 64, _BASE, _BASE, piece)
              for w in words]
    plans = [native_ring.staged_pieces(count, n, r, piece) for r in range(n)]
    seg0_stop = count // n + (1 if count % n else 0)
    errors: list[str] = []

    def copier(r: int) -> None:
        end = time.monotonic() + deadline_s
        downloads, uploads = plans[r]
        for i, (a, b) in enumerate(downloads):
            while hold and r == 1 and a < seg0_stop and not _later(int(words[0][16]),
                                                                     _BASE + 1):
                if time.monotonic() > end:
                    errors.append("rank 0 published nothing while rank 1 held back")
                    return
                time.sleep(0.0002)
            if pause:
                time.sleep(pause)
            hosts[r][a:b] = xs[r][a:b]
            words[r][0] = (_BASE + i + 1) & 0xFFFFFFFF
        for i, (a, b) in enumerate(uploads):
            while not _later(int(words[r][16]), _BASE + i + 1):
                if time.monotonic() > end:
                    errors.append(f"rank {r}: upload piece {i} never became final")
                    return
                time.sleep(0)
            outs[r][a:b] = hosts[r][a:b]

    copiers = [threading.Thread(target=copier, args=(r,), daemon=True) for r in range(n)]
    for t in copiers:
        t.start()
    results = _ring_threads(hosts, hosts, xs[0].dtype, OPS[op], path=path, stages=stages,
                            deadline_ns=time.monotonic_ns() + int(deadline_s * 1e9))
    for t in copiers:
        t.join(deadline_s)
    assert not errors, errors
    return results, outs, hosts


@needs_lib
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("path", PATHS)
def test_staged_all_reduce_reads_pieces_once_landed_and_publishes_each_final_one(
        n: int, path: str) -> None:
    """ring.c's staged all-reduce: every piece read only after its download landed (the
    host copy starts as garbage and pieces land late), every piece of the result published
    exactly in the order of staged_pieces (the copier copies each once, when the counter
    lets it), counters that wrap around mid-call; the same bits as the ring without
    copies. Uneven segments, pieces smaller and larger than a segment, a count under n."""
    for count, piece, dtype, op in ((70_001, 4096, np.float32, "sum"),
                                    (10_007, 100_000, np.int64, "max"),
                                    (n - 1, 1, np.float64, "avg"),
                                    (33_333, 777, np.int32, "prod")):
        xs = _inputs(n, count, dtype, seed=count)
        results, outs, _ = _staged_ring(xs, op, piece, path, pause=0.0002 if count > 1000
                                        else 0.0)
        assert all(r[0] == native.NR.OK for r in results), results
        expect = _ring_reference(xs, op)
        for r in range(n):
            assert outs[r].tobytes() == expect.tobytes(), (count, piece, r)


@needs_lib
@pytest.mark.parametrize("path", ["helper", "mixed"])
def test_staged_all_reduce_publishes_final_pieces_before_the_call_ends(path: str) -> None:
    """Rank 0 publishes its first final segment while its call still runs: rank 1 holds
    back its last downloads until it sees that, and rank 0 cannot finish without them.
    (Rank 1 sends from its helper thread: an inline call waits for all of its input.)"""
    xs = _inputs(2, 50_000, np.float32)
    results, outs, _ = _staged_ring(xs, "sum", 2048, path, hold=True, deadline_s=10)
    assert all(r[0] == native.NR.OK for r in results), results
    expect = _ring_reference(xs, "sum")
    assert all(o.tobytes() == expect.tobytes() for o in outs)


@needs_lib
def test_staged_copies_are_refused_off_all_reduce_and_without_counters() -> None:
    assert LIB is not None
    words = np.zeros(32, np.uint32)
    good = native.Stage(words.ctypes.data, words.ctypes.data + 64, 0, 0, 16)
    bad = [native.Stage(words.ctypes.data, words.ctypes.data + 64, 0, 0, 0),
           native.Stage(None, words.ctypes.data + 64, 0, 0, 16),
           native.Stage(words.ctypes.data, None, 0, 0, 16)]
    x = np.zeros(64, np.float32)
    a, b = socket.socketpair()
    try:
        for mode, stage in [(native.NativeLib.REDUCE_SCATTER, good),
                            (native.NativeLib.ALL_GATHER, good)] + [
                (native.NativeLib.ALL_REDUCE, s) for s in bad]:
            code, _, _ = LIB.run(mode, a.fileno(), b.fileno(), x.ctypes.data, x.ctypes.data,
                                 0, 32, DTYPES[x.dtype], 0, 0, 2, 16, 0, native.State(),
                                 HEADER, -1, stage)
            assert code == native.NR.BAD_ARGS
    finally:
        a.close()
        b.close()


def test_staged_pieces_follow_the_ring_order() -> None:
    """Downloads go in the order the ring reads its segments (own, then backwards),
    uploads in the order they become final (the next rank's segment first); together
    they cover every element once, in pieces no larger than asked, never across a
    segment's end."""
    for count, n, piece in ((10, 3, 2), (7, 4, 100), (2, 5, 1), (0, 2, 8), (1000, 2, 128)):
        base, extra = divmod(count, n)
        bounds = [q * base + min(q, extra) for q in range(n + 1)]
        for rank in range(n):
            downs, ups = native_ring.staged_pieces(count, n, rank, piece)
            for pieces in (downs, ups):
                assert sorted(i for a, b in pieces for i in range(a, b)) == list(range(count))
                assert all(0 < b - a <= piece for a, b in pieces)
                assert all(bisect_seg(bounds, a) == bisect_seg(bounds, b - 1)
                           for a, b in pieces)
            seg_order = [bisect_seg(bounds, a) for a, _ in downs]
            assert seg_order == sorted(seg_order, key=lambda q: (rank - q) % n)
            seg_order = [bisect_seg(bounds, a) for a, _ in ups]
            assert seg_order == sorted(seg_order, key=lambda q: (rank + 1 - q) % n)
    assert native_ring.staged_pieces(10, 2, 0, 3) == (
        [(0, 3), (3, 5), (5, 8), (8, 10)], [(5, 8), (8, 10), (0, 3), (3, 5)])


def bisect_seg(bounds: list[int], i: int) -> int:
    """The segment (of the ring's split, ``bounds``) holding element ``i``."""
    return max(q for q in range(len(bounds) - 1) if bounds[q] <= i)


def _rs_reference(xs: list[np.ndarray], op: str, block: int) -> list[np.ndarray]:
    """acoll's Python reduce-scatter ring: block q starts at rank q + 1 and is combined as
    ``x[next] (op) acc`` at each next rank, ending at rank q."""
    n = len(xs)
    outs = []
    for q in range(n):
        sl = slice(q * block, (q + 1) * block)
        acc = xs[(q + 1) % n][sl].copy()
        for k in range(2, n + 1):
            _UFUNC[op](xs[(q + k) % n][sl], acc, out=acc)
        if op == "avg":
            finish_avg(acc, n)
        outs.append(acc)
    return outs


@needs_lib
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.int8, np.uint32, np.int64, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("path", PATHS)
def test_c_reduce_scatter_and_all_gather_bit_for_bit(n: int, dtype: Any, op: str,
                                                     path: str) -> None:
    assert LIB is not None
    for block in (0, 1, 999, 70_001):
        xs = _inputs(n, block * n, dtype, seed=block)
        dsts = [np.full(block, 3, dtype) for _ in range(n)]
        res = _ring_threads(xs, dsts, dtype, OPS[op], mode=LIB.REDUCE_SCATTER, count=block,
                            path=path)
        assert all(r[0] == native.NR.OK for r in res), res
        for got, want in zip(dsts, _rs_reference(xs, op, block), strict=True):
            assert got.tobytes() == want.tobytes(), block
        if op != "sum":
            continue
        parts = [x[:block].copy() for x in xs]
        outs = [np.full(block * n, 5, dtype) for _ in range(n)]
        res = _ring_threads(parts, outs, dtype, 0, mode=LIB.ALL_GATHER, count=block,
                            path=path)
        assert all(r[0] == native.NR.OK for r in res), res
        for got in outs:
            assert got.tobytes() == np.concatenate(parts).tobytes(), block
        # in place: each rank's block already in its output
        outs = [np.zeros(block * n, dtype) for _ in range(n)]
        for r in range(n):
            outs[r][r * block:(r + 1) * block] = parts[r]
        res = _ring_threads([outs[r][r * block:(r + 1) * block] for r in range(n)], outs,
                            dtype, 0, mode=LIB.ALL_GATHER, count=block, path=path)
        assert all(r[0] == native.NR.OK for r in res), res
        for got in outs:
            assert got.tobytes() == np.concatenate(parts).tobytes(), block


@needs_lib
@pytest.mark.parametrize("path", PATHS)
def test_inline_calls_larger_than_the_socket_buffers_interleave(path: str) -> None:
    """Each step's block is several times a socket pair's buffer: a rank that only sent,
    or only received, would never finish."""
    for n in (2, 3):
        xs = _inputs(n, 3_000_001, np.float32, seed=n)
        expect = _ring_reference(xs, "sum")
        dsts = [np.empty_like(x) for x in xs]
        results = _ring_threads(xs, dsts, np.float32, 0, send_items=1 << 22, path=path)
        assert all(r[0] == native.NR.OK for r in results), results
        for d in dsts:
            assert d.tobytes() == expect.tobytes()


def _sender_threads() -> set[str]:
    """The ids of this process's OS threads named as the helper's sender thread."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "acoll-send":
                    found.add(tid)
        except OSError:  # (the thread ended meanwhile)
            pass
    return found


def _sender_threads_started_by_a_call(path: str) -> int:
    """How many sender threads a 2-rank call on two fresh threads starts (counted while
    the calling threads live, as ids new since before: threads that other tests left
    running, or that end meanwhile, do not count)."""
    assert LIB is not None
    pairs = [socket.socketpair() for _ in range(2)]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    xs = _inputs(2, 1000, np.float32)
    done, release = threading.Barrier(3), threading.Event()
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        assert LIB is not None
        results[r] = LIB.run(LIB.ALL_REDUCE, pairs[r][0].fileno(), pairs[1 - r][1].fileno(),
                             xs[r].ctypes.data, xs[r].ctypes.data, 0, xs[r].size, 8, 0, r, 2,
                             333, 0, native.State(), HEADER, _inline_max(path, r))
        done.wait(10)
        release.wait(10)

    before = _sender_threads()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    done.wait(10)
    started = _sender_threads() - before
    release.set()
    for t in threads:
        t.join(10)
    for a, b in pairs:
        a.close()
        b.close()
    assert all(r[0] == native.NR.OK for r in results), results
    return len(started)


@needs_lib
def test_inline_calls_start_no_sender_thread() -> None:
    """A thread whose calls all run inline never starts the helper's sender thread (and
    one whose call does not, does): threads named "acoll-send", counted from /proc."""
    assert _sender_threads_started_by_a_call("inline") == 0
    assert _sender_threads_started_by_a_call("helper") == 2


@needs_lib
@pytest.mark.parametrize("path", PATHS)
def test_c_ring_refuses_a_peer_with_another_header(path: str) -> None:
    xs = _inputs(3, 5000, np.float32)
    headers = [HEADER, HEADER, bytes(32)]
    results = _ring_threads(xs, xs, np.float32, 0, headers=headers,
                            deadline_ns=time.monotonic_ns() + 3_000_000_000, path=path)
    # rank 0 reads rank 2's header, rank 2 rank 1's: each refuses before any data. (Rank 1
    # waits for data rank 0 no longer sends; in a communicator rank 0's failure reaches it
    # at once, here its deadline ends it.)
    assert results[0][0] == results[2][0] == native.NR.MISMATCH
    assert results[0][1] == results[2][1] == 1
    assert results[0][2] == bytes(32)
    assert results[2][2] == HEADER
    assert results[1][0] == native.NR.DEADLINE


@needs_lib
@pytest.mark.parametrize("path", ["helper", "inline"])
def test_c_ring_stops_on_abort_a_closed_peer_and_its_deadline(path: str) -> None:
    assert LIB is not None
    a, b = socket.socketpair()  # a: to the "next rank", b: from the "previous"
    c, d = socket.socketpair()
    for s in (a, b, c, d):
        s.setblocking(False)
    x = np.ones(1 << 16, np.float32)

    def call(send: socket.socket, recv: socket.socket, state: native.State,
             dtype: int = 8, deadline_ns: int = 0) -> tuple[int, int, bytes]:
        assert LIB is not None  # (a 2-rank all-reduce as rank 0, in place)
        return LIB.run(LIB.ALL_REDUCE, send.fileno(), recv.fileno(), x.ctypes.data,
                       x.ctypes.data, 0, x.size, dtype, 0, 0, 2, 1024, deadline_ns, state,
                       HEADER, _inline_max(path, 0))

    state = native.State()
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(call(a, d, state)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)  # nothing comes from the previous rank
    assert t.is_alive()
    state.abort = 1
    t.join(5)
    assert out
    assert out[0][0] == native.NR.ABORTED
    assert time.monotonic() - t0 < 4
    # the previous rank's end closes: PEER_CLOSED, on the receiving side
    c.close()
    code = call(a, d, native.State())
    assert code[0] == native.NR.PEER_CLOSED
    assert code[1] == 1
    # a deadline
    e, f = socket.socketpair()
    g, h = socket.socketpair()
    for s in (e, f, g, h):
        s.setblocking(False)
    t0 = time.monotonic()
    code = call(e, h, native.State(), deadline_ns=time.monotonic_ns() + 200_000_000)
    assert code[0] == native.NR.DEADLINE
    assert 0.15 < time.monotonic() - t0 < 4
    bad = call(e, h, native.State(), dtype=10)  # (no such dtype)
    assert bad[0] == native.NR.BAD_ARGS
    for s in (a, b, d, e, f, g, h):
        s.close()


def test_a_failing_compiler_leaves_the_python_ring(tmp_path: Path, caplog: Any) -> None:
    with pytest.raises(OSError):
        native.build(cc=str(tmp_path / "no-such-cc"), cache=tmp_path)
    with caplog.at_level(logging.INFO, logger="acoll.NET"):
        assert native.load(cc=str(tmp_path / "no-such-cc")) is None
    assert "native ring unavailable" in caplog.text


@needs_lib
def test_concurrent_first_builds_share_one_library(tmp_path: Path) -> None:
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(native.build(cache=tmp_path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(set(paths)) == 1
    assert paths[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # (no leftovers)


def _tcp_only(n: int) -> tuple[list[Any], list[Any]]:
    import socket as _socket

    from acoll._transport.base import PeerInfo
    from acoll._transport.tcp import TcpTransport

    transports = [TcpTransport(("127.0.0.1", 0), _socket.AF_INET, key=bytes(32))]
    infos = [PeerInfo(rank=r, host_hash=r, proc=bytes([r]) * 16, loop=1, pid=r,
                      handles={"socket": b"x"}) for r in range(n)]
    return transports, infos


def test_every_rank_decides_alike_from_the_records() -> None:
    usable = native_ring.NativeRing.usable
    small = 64 << 10
    transports, infos = _tcp_only(2)
    assert usable([[2, 4096, small], [2, 4096, small]], transports, infos) == 4096
    for records in ([[2, 0, small], None],  # a rank without it
                    [[2, 0, small], [2, 4096, small]],  # different ACOLL_NATIVE_MIN
                    [[2, 0, small], [2, 0, 1024]],  # different ACOLL_SMALL_MSG
                    [[2, 0, small], [1, 0, small]]):  # different versions
        assert usable(records, transports, infos) is None, records
    one_t, one = _tcp_only(1)
    assert usable([[2, 0, small]], one_t, one) is None  # one rank
    from acoll._transport.base import PeerInfo

    other = [infos[0], PeerInfo(rank=1, host_hash=1, proc=bytes(16), loop=1, pid=1,
                                handles={"socket": b"x", "shm": b"y"})]
    assert usable([[2, 0, small]] * 2, transports, other) is None  # other transports


def _inproc_and_tcp() -> tuple[list[Any], Callable[[int, bytes], Any]]:
    """The in-process and TCP transports, and a maker of rank records that serve both
    (``info(rank, process id)``)."""
    import socket as _socket

    from acoll._transport import inproc
    from acoll._transport.base import PeerInfo
    from acoll._transport.tcp import TcpTransport

    key = bytes(32)
    transports = [inproc.InprocTransport(key=key),
                  TcpTransport(("127.0.0.1", 0), _socket.AF_INET, key=key)]

    def info(rank: int, proc: bytes) -> PeerInfo:
        handle = inproc._HANDLE.pack(inproc._MAGIC, proc, 7, bytes(16))
        return PeerInfo(rank=rank, host_hash=1, proc=proc, loop=7, pid=rank,
                        handles={"inproc": handle, "socket": b"x"})

    return transports, info


def test_device_records_need_one_via_host_limit_and_every_pair_over_tcp() -> None:
    """A device communicator's record carries ACOLL_GPU_VIA_HOST_MAX: the native ring runs
    its all_reduces through the host only where every rank has the same setting and every
    pair of ranks (not only the ring's edges) is joined over TCP, so that every rank sends
    the same calls through the host (its automatic limit follows every peer's
    transport)."""
    from acoll._transport import inproc

    usable = native_ring.NativeRing.usable
    small, auto = 64 << 10, -1
    transports, infos = _tcp_only(3)
    assert usable([[2, 0, small, auto]] * 3, transports, infos) == 0
    assert usable([[2, 0, small, auto]] * 2 + [[2, 0, small, 1 << 20]], transports,
                  infos) is None  # one rank with another ACOLL_GPU_VIA_HOST_MAX
    assert usable([[2, 0, small, auto]] * 2 + [[2, 0, small]], transports,
                  infos) is None  # a host communicator's record among device ones
    both, info = _inproc_and_tcp()
    # Ranks 0 and 2 in one process, 1 and 3 in another: every edge of the ring crosses
    # processes (TCP), but 0 and 2 (and 1 and 3) are in process.
    other = bytes(range(16))
    crossed = [info(r, other if r % 2 == 0 else inproc._process) for r in range(4)]
    assert usable([[2, 0, small]] * 4, both, crossed) == 0  # host: the ring's edges
    assert usable([[2, 0, small, auto]] * 4, both, crossed) is None  # device: every pair
    apart = [info(r, bytes([r]) * 16) for r in range(4)]
    assert usable([[2, 0, small, auto]] * 4, both, apart) == 0


def test_heard_counts_data_from_the_previous_rank() -> None:
    """A slow native op that times out must not be reported as "sent nothing": the ctx's
    heard set sees the C code's byte count."""
    state = native.State()
    heard = native_ring._Heard({5}, 3, state)
    assert 5 in heard
    assert 3 not in heard
    state.received = native.HEADER_SIZE  # (the header alone: nothing of the op yet)
    assert 3 not in heard
    state.received = native.HEADER_SIZE + 1
    assert 3 in heard
    assert 4 not in heard


def test_a_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="not private"):
        native.build(cache=shared)


def test_every_rank_sees_the_edges_of_other_processes_alike() -> None:
    """Ranks 0, 2 and 4 in one process, 1 and 3 in another (the mixed communicator of
    tests/test_collectives.py): edge 4 -> 0 is in process, so the native ring is off, and
    a rank of the other process, which cannot connect in process to either, finds that
    too. (It once found every edge over TCP and ran the native ring alone.)"""
    from acoll._transport import inproc

    transports, info = _inproc_and_tcp()
    other = bytes(range(16))  # a process that is not this one
    mixed = [info(r, other if r % 2 == 0 else inproc._process) for r in range(5)]
    records = [[2, 0, 65536]] * 5
    assert native_ring.NativeRing.usable(records, transports, mixed) is None
    apart = [info(r, bytes([r]) * 16) for r in range(5)]  # a process each: all TCP
    assert native_ring.NativeRing.usable(records, transports, apart) == 0
    two = [info(r, other if r < 2 else inproc._process) for r in range(4)]  # 1 -> 2 ...
    assert native_ring.NativeRing.usable(records[:4], transports, two) is None


# --------------------------------------------------------------------------- communicators
@pytest.fixture
def over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of this loop talk over TCP (not in memory), so the native ring is chosen."""
    if LIB is None:
        pytest.skip("no C compiler: the native ring cannot be built here")
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")


CASES = [(np.float32, "sum"), (np.float64, "max"), (np.int32, "prod"), (np.int32, "avg"),
         (np.uint64, "min"), (np.float32, "avg"), (np.int8, "sum")]


@pytest.mark.usefixtures("over_tcp")
async def test_same_bits_as_the_python_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    async def job(comm: acoll.Communicator) -> list[np.ndarray]:
        outs = []
        for i, (dtype, op) in enumerate(CASES):
            for count in ((1 << 17) + 3, 300_001):
                x = _inputs(comm.size, count, dtype, seed=i)[comm.rank]
                if i % 2:
                    await comm.all_reduce(x, op=op)
                    outs.append(x)
                else:
                    y = np.empty_like(x)
                    await comm.all_reduce(x, y, op=op)
                    outs.append(y)
        outs.append(np.array([comm._native is not None]))
        return outs

    with_native = await run_ranks(3, job, timeout=30)
    monkeypatch.setenv("ACOLL_NATIVE", "0")
    python = await run_ranks(3, job, timeout=30)
    for a, b in zip(with_native, python, strict=True):
        assert a[-1][0]
        assert not b[-1][0]
        for x, y in zip(a[:-1], b[:-1], strict=True):
            assert x.tobytes() == y.tobytes()


@pytest.mark.usefixtures("over_tcp")
async def test_reduce_scatter_and_all_gather_same_bits_as_the_python_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    original = native_ring.NativeRing.run

    async def spy(self: native_ring.NativeRing, ctx: Any, mode: int, *args: Any) -> Any:
        ran.append(ctx.desc.coll.name)
        return await original(self, ctx, mode, *args)

    monkeypatch.setattr(native_ring.NativeRing, "run", spy)

    async def job(comm: acoll.Communicator) -> list[np.ndarray]:
        n, outs = comm.size, []
        for i, (dtype, op) in enumerate(CASES):
            for block in (40_000, 70_001):
                x = _inputs(n, block * n, dtype, seed=i)[comm.rank]
                y = np.empty(block, dtype)
                await comm.reduce_scatter(x, y, op=op)
                z = np.empty(block * n, dtype)
                await comm.all_gather(y, z)
                outs += [y, z]
        small = np.arange(8, dtype=np.float32)  # (8 x 4 x 3 bytes: the Python ring)
        big = np.empty(8 * n, np.float32)
        await comm.all_gather(small, big)
        return outs

    with_native = await run_ranks(3, job, timeout=30)
    assert ran.count("REDUCE_SCATTER") == ran.count("ALL_GATHER") == 3 * 2 * len(CASES)
    monkeypatch.setenv("ACOLL_NATIVE", "0")
    python = await run_ranks(3, job, timeout=30)
    for a, b in zip(with_native, python, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tobytes() == y.tobytes()


@pytest.mark.usefixtures("over_tcp")
async def test_a_count_mismatch_is_named_on_every_rank() -> None:
    async def job(comm: acoll.Communicator) -> str:
        x = np.ones((1 << 18) + (comm.rank == 1) * 8, np.float32)
        with pytest.raises(acoll.InvalidUsage) as info:
            await comm.all_reduce(x)
        return str(info.value)

    for msg in await run_ranks(3, job, timeout=10):
        assert "count" in msg, msg
        assert " vs " in msg, msg


@pytest.mark.usefixtures("over_tcp")
async def test_a_rank_that_never_calls_is_named_by_every_timeout() -> None:
    async def job(comm: acoll.Communicator) -> str:
        if comm.rank == 2:
            await asyncio.sleep(9)
            return ""
        with pytest.raises(acoll.TimeoutError) as info:
            await comm.all_reduce(np.ones(1 << 18, np.float32))
        return str(info.value)

    # (a 6 s timeout gives probes 0.4 s to be answered: with every rank in one loop, a
    # 2 s timeout's 0.2 s was once too short on a slow CI machine, and rank 0 named its
    # neighbour rank 3, whose loop -- the same loop -- had not answered in time)
    uid = acoll.get_unique_id()
    comms = await asyncio.gather(*(acoll.init_rank(4, uid, r, timeout=6) for r in range(4)))
    try:
        msgs = await asyncio.gather(*(job(c) for c in comms))
    finally:
        for c in comms:
            c.abort()
    for r, msg in enumerate(msgs):
        if r != 2:
            assert "rank 2" in msg, msgs


@pytest.mark.usefixtures("over_tcp")
@pytest.mark.parametrize("how", ["abort", "cancel", "cancel twice"])
async def test_a_rank_that_aborts_or_is_cancelled_mid_op_fails_every_peer(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from acoll._comm import native_ring
    monkeypatch.setattr(native_ring, "_CANCEL_WAIT", 10.0)  # (a slow machine's C call)
    uid = acoll.get_unique_id()
    n, victim = 4, 1
    comms = list(await asyncio.gather(*(acoll.init_rank(n, uid, r) for r in range(n))))
    try:
        assert all(c._native is not None for c in comms)
        # (the links first, so that the op below is inside its C call when it ends)
        await asyncio.gather(*(c.all_reduce(np.ones(1 << 18, np.float32)) for c in comms))
        bufs = [np.ones(16 << 20, np.float32) for _ in range(n)]
        tasks = [asyncio.ensure_future(c.all_reduce(b)) for c, b in zip(comms, bufs,
                                                                         strict=True)]
        await asyncio.sleep(0.005)
        t0 = time.monotonic()
        at_end: list[bytes] = []  # the victim's buffer when its call returned
        tasks[victim].add_done_callback(lambda _: at_end.append(bufs[victim].tobytes()))
        if how == "abort":
            comms[victim].abort()
        else:
            tasks[victim].cancel()
            if how == "cancel twice":  # (a second cancel while the first waits for C)
                await asyncio.sleep(0)
                tasks[victim].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - t0 < 5
        for r, res in enumerate(results):
            if r == victim or isinstance(res, np.ndarray):  # (finished before it)
                continue
            assert isinstance(res, acoll.RemoteError), res
            assert f"rank {victim}" in str(res), res
        # the victim's C call had stopped when its call returned: its buffer no longer
        # changes
        await asyncio.sleep(0.2)
        assert bufs[victim].tobytes() == at_end[0]
        for c in comms:
            c.abort()
        # every communicator's worker thread ends once its call is back
        end = time.monotonic() + 15
        while any(t.name == "acoll-native" for t in threading.enumerate()):
            assert time.monotonic() < end, "a native ring thread outlived its communicator"
            await asyncio.sleep(0.02)
    finally:
        for c in comms:
            c.abort()


@pytest.mark.usefixtures("over_tcp")
async def test_a_call_cancelled_twice_still_waits_for_the_c_code_to_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C code sees an abort only at its next check (a piece, or a 50 ms poll slice)
    and may write the buffer until then. A cancelled call waits for that before its
    cancellation reaches the caller, and a second cancel must not cut the wait short: the
    caller may reuse the buffer the moment its await ends. (A stand-in for the C call
    writes the buffer 0.1 s after it sees the abort.)"""
    import ctypes

    real_run = native.NativeLib.run
    big = 1 << 20

    def slow_to_stop(self: native.NativeLib, *args: Any, **kw: Any) -> tuple[int, int, bytes]:
        if args[6] < big:  # (the calls that make the links run for real)
            return real_run(self, *args, **kw)
        state = args[13]
        while not state.abort:
            time.sleep(0.001)
        time.sleep(0.1)
        ctypes.memset(args[4], 0x7F, 64)  # a late write into the destination
        return 1, 0, b""

    monkeypatch.setattr(native.NativeLib, "run", slow_to_stop)
    monkeypatch.setattr(native_ring, "_CANCEL_WAIT", 10.0)
    uid = acoll.get_unique_id()
    comms = list(await asyncio.gather(*(acoll.init_rank(2, uid, r) for r in range(2))))
    try:
        assert all(c._native is not None for c in comms)
        await asyncio.gather(*(c.all_reduce(np.ones(1 << 18, np.float32)) for c in comms))
        bufs = [np.ones(big, np.float32) for _ in comms]
        tasks = [asyncio.ensure_future(c.all_reduce(b)) for c, b in zip(comms, bufs,
                                                                         strict=True)]
        await asyncio.sleep(0.05)
        at_end: list[bytes] = []
        tasks[0].add_done_callback(lambda _: at_end.append(bufs[0][:16].tobytes()))
        tasks[0].cancel()
        await asyncio.sleep(0.01)
        tasks[0].cancel()  # while the first cancel waits for the C code
        await asyncio.gather(*tasks, return_exceptions=True)
        assert tasks[0].cancelled()
        await asyncio.sleep(0.2)
        assert at_end == [bufs[0][:16].tobytes()], "the buffer was written after the call ended"
        assert bufs[0][:16].tobytes() == b"\x7f" * 64
    finally:
        for c in comms:
            c.abort()


@pytest.mark.usefixtures("over_tcp")
async def test_calls_in_a_group_take_turns_on_the_native_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's calls run together, and on the native ring one at a time in their
    sequence order; a rank that makes the same calls outside a group (or another task's
    call that joins an open group) takes the same path: every rank decides alike."""
    ran: list[tuple[int, int]] = []
    original = native_ring.NativeRing.run

    async def spy(self: native_ring.NativeRing, ctx: Any, *args: Any) -> Any:
        ran.append((self.rank, ctx.seq))
        return await original(self, ctx, *args)

    monkeypatch.setattr(native_ring.NativeRing, "run", spy)

    async def job(comm: acoll.Communicator) -> list[float]:
        a = np.full(1 << 18, comm.rank + 1.0, np.float32)
        b = np.full(1 << 18, 2 * comm.rank + 1.0, np.float32)
        c = np.full(3 << 16, 1.0, np.float32)
        if comm.rank == 1:  # (the others in a group)
            await comm.all_reduce(a)
            await comm.all_reduce(b)
            await comm.reduce_scatter(c, c[:1 << 16].copy())
        else:
            async with comm.group():
                await comm.all_reduce(a)
                await comm.all_reduce(b)
                await comm.reduce_scatter(c, c[:1 << 16].copy())
        return [float(a[-1]), float(b[0])]

    for res in await run_ranks(3, job, timeout=20):
        assert res == [6.0, 9.0]
    for rank in range(3):  # (every call on the native ring, in sequence order)
        seqs = [seq for r, seq in ran if r == rank]
        assert len(seqs) == 3
        assert seqs == sorted(seqs)


@pytest.mark.usefixtures("over_tcp")
async def test_an_unbounded_timeout_runs_the_native_ring() -> None:
    async def job(comm: acoll.Communicator) -> float:
        x = np.ones(1 << 18, np.float32)
        await comm.all_reduce(x)
        assert comm._native is not None
        return float(x[0])

    assert await run_ranks(2, job, timeout=float("inf")) == [2.0, 2.0]


async def test_a_raw_link_without_the_key_is_refused() -> None:
    from acoll._deadline import deadline_after
    from acoll._transport.tcp import TcpTransport

    good = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=bytes(range(32)))
    listener = await good.listen()
    stranger = TcpTransport(("127.0.0.1", 0), socket.AF_INET, key=bytes(32))
    try:
        with pytest.raises(acoll.AcollError, match="key"):
            await stranger.connect_raw(listener.handle, b"{}", deadline_after(5))
    finally:
        listener.close()
        good.close()
        stranger.close()


@pytest.mark.usefixtures("over_tcp")
async def test_without_a_compiler_the_python_ring_runs(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path, caplog: Any) -> None:
    from acoll import _dtypes
    monkeypatch.setenv("ACOLL_NATIVE_CC", str(tmp_path / "missing-cc"))
    monkeypatch.setenv("ACOLL_NATIVE", "1")
    for name in ("_native_reduce", "_native_scale"):  # (put back afterwards)
        monkeypatch.setattr(_dtypes, name, getattr(_dtypes, name))

    async def job(comm: acoll.Communicator) -> float:
        x = np.ones(1 << 18, np.float32)
        await comm.all_reduce(x)
        assert comm._native is None
        return float(x[-1])

    with caplog.at_level(logging.WARNING, logger="acoll.INIT"):
        assert await run_ranks(2, job, timeout=20) == [2.0, 2.0]
    assert "ACOLL_NATIVE=1 but the native library could not be built" in caplog.text
    assert _dtypes._native_reduce is None  # (NumPy's 16-bit loops, as the warning says)


@pytest.mark.usefixtures("over_tcp")
async def test_raw_links_refuse_a_hello_that_does_not_fit(caplog: Any) -> None:
    """A raw link (authenticated, so from a holder of the job's key) that claims another
    destination, or a rank already linked, is refused; the ring goes on."""
    from acoll._deadline import deadline_after
    from acoll._transport.tcp import TcpTransport

    async def job(comm: acoll.Communicator) -> float:
        x = np.ones(1 << 18, np.float32)
        await comm.all_reduce(x)  # the links exist now
        if comm.rank == 0:
            links = comm._links
            transport = links.choice[1]
            assert isinstance(transport, TcpTransport)
            import msgpack

            for hello in ({"rank": 0, "to": 2, "raw": True},  # to another rank
                          {"rank": 0, "to": 1, "raw": True}):  # a second link from rank 0
                link = await transport.connect_raw(links._handles[1]["socket"],
                                                   msgpack.packb(hello),
                                                   deadline_after(5))
                link.abort()
        await asyncio.sleep(0.2)
        await comm.all_reduce(x)
        return float(x[0])

    with caplog.at_level(logging.WARNING, logger="acoll.INIT"):
        assert await run_ranks(3, job, timeout=20) == [9.0] * 3
    assert caplog.text.count("refused a raw socket link") == 2


@pytest.mark.usefixtures("over_tcp")
async def test_no_thread_outlives_its_communicators() -> None:
    """Each communicator's worker thread, and the C helper thread each calling thread
    keeps (ring.c), end when the communicator closes: the process's OS threads come back
    to their count (read from /proc, which sees threads Python does not know of)."""
    import os

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    async def job(comm: acoll.Communicator) -> bool:
        x = np.ones(1 << 18, np.float32)
        await comm.all_reduce(x)
        return comm._native is not None

    assert all(await run_ranks(2, job, timeout=20))  # (pools of other threads start once)
    await asyncio.sleep(0.3)
    before = threads()
    for _ in range(5):
        assert all(await run_ranks(2, job, timeout=20))
    end = time.monotonic() + 15  # (a slow machine)
    while threads() > before:
        assert time.monotonic() < end, f"{threads()} threads, {before} before"
        await asyncio.sleep(0.05)


@needs_lib
async def test_the_c_calls_hard_stop_follows_the_timeout_the_op_runs_under(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 48): the C call's own deadline (twice the timeout plus
    30 s) used the timeout the communicator was formed with, so a longer one set later
    failed a slow peer's call early on the native ring only."""
    seen: list[float] = []
    real = native.NativeLib.run

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((args[12] - time.monotonic_ns()) / 1e9)  # (the hard stop, ns)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(native.NativeLib, "run", spy)
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")  # (over TCP: the native ring)

    async def job(comm: acoll.Communicator) -> bool:
        comm.timeout = 100.0
        await comm.all_reduce(np.ones(300_001, np.float32))
        return comm._native is not None

    assert all(await run_ranks(2, job, timeout=1, together=True))
    assert seen
    assert all(200 < left <= 230 for left in seen), seen
