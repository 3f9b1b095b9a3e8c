"""The native library's 16-bit float loops (``ring.c``; :func:`acoll._dtypes.combiner`).

They must give NumPy's float16 and ml_dtypes' bfloat16 bits for every value: each test
runs every 16-bit pattern against a set of second operands (the special ones and random
ones), for each op, on the vector loops (AVX2/F16C, where this CPU has them) and on the
plain C loops, in place and not. Where both operands are NaNs, NumPy's result is
compared as a NaN only (which payload wins is its compiler's choice of operand order);
ours is the second operand's, quieted, at every position. Everywhere else, bit for
bit."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import acoll
from acoll import _communicator, _dtypes
from acoll import _native as native
from acoll._dtypes import BFLOAT16, ReduceOp, avg_factor, combiner, finish_avg, scale_into
from acoll.testing import run_ranks
from collective_cases import reference

HALVES = [np.dtype(np.float16), BFLOAT16]
IDS = ["float16", "bfloat16"]
CODES = {np.dtype(np.float16): 6, BFLOAT16: 7}
ALL = np.arange(1 << 16, dtype=np.uint16)
#: zeros, the smallest and largest subnormals, the smallest normal, the largest finite
#: float16, infinities, quiet and signalling NaNs (both formats' patterns), one, 1/3
SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00,
                    0xFC00, 0x7E00, 0x7D01, 0xFE00, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x3C00,
                    0xBC00, 0x3F80, 0x3555, 0x0200, 0x0080, 0x807F], np.uint16)
OPS = [(ReduceOp.SUM, np.add), (ReduceOp.PROD, np.multiply), (ReduceOp.MAX, np.maximum),
       (ReduceOp.MIN, np.minimum)]


@pytest.fixture(scope="module")
def lib() -> native.NativeLib:
    loaded = native.load()
    if loaded is None:
        pytest.skip("no C compiler: the native library did not build (NumPy's loops run)")
    return loaded


@pytest.fixture(params=["simd", "plain"])
def mode(request: pytest.FixtureRequest, lib: native.NativeLib) -> Iterator[str]:
    """Each test on the vector loops and on the plain ones (the library is shared by the
    process: the setting goes back afterwards)."""
    before = lib.simd
    got = lib.set_simd(request.param == "simd")
    if request.param == "simd" and not got:
        lib.set_simd(before)
        pytest.skip("this CPU has no AVX2/F16C: only the plain loops run here")
    yield request.param
    lib.set_simd(before)


def _addr(a: np.ndarray[Any, Any]) -> int:
    return int(a.ctypes.data)


def _pairs(seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Every 16-bit pattern against each of SPECIAL and 40 random patterns."""
    rng = np.random.default_rng(seed)
    second = np.concatenate([SPECIAL, rng.integers(0, 1 << 16, 40, dtype=np.uint16)])
    return np.tile(ALL, len(second)), np.repeat(second, len(ALL))


def _mismatches(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any],
                nan_ok: np.ndarray[Any, Any], dt: np.dtype[Any]) -> list[str]:
    bad = (got != want) & ~(nan_ok & np.isnan(got.view(dt)) & np.isnan(want.view(dt)))
    return [f"{int(k)}: got {got[k]:#06x} want {want[k]:#06x}"
            for k in np.flatnonzero(bad)[:5]]


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
def test_every_value_combines_as_numpy_does(lib: native.NativeLib, mode: str,
                                            dt: np.dtype[Any]) -> None:
    a, b = _pairs(int(CODES[dt]))
    x, y = a.view(dt), b.view(dt)
    both_nan = np.isnan(x) & np.isnan(y)
    for op, ufunc in OPS:
        with np.errstate(all="ignore"):
            want = ufunc(x, y).view(np.uint16)
        out = np.empty_like(a)
        assert lib.reduce(_addr(out), _addr(a), _addr(b), a.size, CODES[dt], int(op)) == 0
        assert _mismatches(out, want, both_nan, dt) == [], (mode, op)
        if op in (ReduceOp.SUM, ReduceOp.PROD):  # (two NaNs: the second's, quieted)
            assert (out[both_nan] == _quieted(b[both_nan], dt)).all(), (mode, op)
        # in place, as either operand
        first, second = a.copy(), b.copy()
        lib.reduce(_addr(first), _addr(first), _addr(b), a.size, CODES[dt], int(op))
        lib.reduce(_addr(second), _addr(a), _addr(second), a.size, CODES[dt], int(op))
        assert np.array_equal(first, out), (mode, op)
        assert np.array_equal(second, out), (mode, op)
    # AVG's sum is SUM's
    out2 = np.empty_like(a)
    lib.reduce(_addr(out2), _addr(a), _addr(b), a.size, CODES[dt], int(ReduceOp.AVG))
    with np.errstate(all="ignore"):
        assert _mismatches(out2, np.add(x, y).view(np.uint16), both_nan, dt) == []


def _quieted(b: np.ndarray[Any, Any], dt: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """The NaN a sum or product of two NaNs gives: the second operand's, quieted."""
    if dt == BFLOAT16:
        return (b & 0x8000) | 0x7FC0
    return b | 0x0200


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
def test_two_nans_give_the_second_quieted_wherever_they_sit(lib: native.NativeLib, mode: str,
                                                            dt: np.dtype[Any]) -> None:
    """A sum or product of two NaNs is the second operand's NaN, quieted, on every rank
    and at every position (the vector body and the scalar tail of a call alike), so the
    same data cut into pieces differently gives the same bits."""
    nan = ALL[np.isnan(ALL.view(dt))]
    rng = np.random.default_rng(3)
    firsts, seconds = rng.choice(nan, 64), rng.choice(nan, 64)
    for op in (ReduceOp.SUM, ReduceOp.PROD):
        for length in (1, 7, 8, 9, 21, 64):
            for x, y in zip(firsts, seconds, strict=True):
                a, b = np.full(length, x, np.uint16), np.full(length, y, np.uint16)
                out = np.empty_like(a)
                lib.reduce(_addr(out), _addr(a), _addr(b), length, CODES[dt], int(op))
                assert (out == _quieted(b, dt)).all(), (mode, op, length, hex(x), hex(y))


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
def test_every_value_scales_by_each_rank_counts_factor(lib: native.NativeLib, mode: str,
                                                       dt: np.dtype[Any]) -> None:
    nan = np.isnan(ALL.view(dt))
    for n in [*range(1, 34), 48, 100, 127, 1000]:
        f = avg_factor(dt, n)
        with np.errstate(all="ignore"):
            want = np.multiply(ALL.view(dt), f).view(np.uint16)
        out = np.empty_like(ALL)
        assert lib.scale(_addr(out), _addr(ALL), ALL.size, CODES[dt], float(f)) == 0
        # (a NaN times the factor: NumPy quiets it as the C code does; same bits)
        assert _mismatches(out, want, np.zeros_like(nan), dt) == [], (mode, n)
        same = ALL.copy()
        lib.scale(_addr(same), _addr(same), same.size, CODES[dt], float(f))
        assert np.array_equal(same, out)


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
def test_the_rings_average_divides_as_finish_avg(lib: native.NativeLib, dt: np.dtype[Any]
                                                 ) -> None:
    """The ring's AVG finish on 16-bit floats (for an AVG given to it unscaled; acoll
    scales floating-point inputs first): float32 division, one rounding, as
    :func:`acoll._dtypes.finish_avg` does, for every value."""
    average = ctypes.CDLL(str(lib.path)).acoll_nr_average
    average.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    for n in (1, 2, 3, 7, 100):
        want = ALL.view(dt).copy()
        with np.errstate(all="ignore"):
            finish_avg(want, n)
        got = ALL.copy()
        assert average(_addr(got), got.size, CODES[dt], n) == 0
        assert _mismatches(got, want.view(np.uint16), np.isnan(ALL.view(dt)), dt) == [], n
    assert average(_addr(got), got.size, CODES[dt], 0) == native.NR.BAD_ARGS


def test_bad_arguments_are_refused(lib: native.NativeLib) -> None:
    a = np.zeros(8, np.uint16)
    assert lib.reduce(_addr(a), _addr(a), _addr(a), 8, 10, 0) == native.NR.BAD_ARGS
    assert lib.reduce(_addr(a), _addr(a), _addr(a), 8, 6, 5) == native.NR.BAD_ARGS
    assert lib.reduce(_addr(a), _addr(a), _addr(a), -1, 6, 0) == native.NR.BAD_ARGS
    assert lib.scale(_addr(a), _addr(a), 8, 8, 0.5) == native.NR.BAD_ARGS  # float32
    assert lib.scale(_addr(a), _addr(a), -1, 6, 0.5) == native.NR.BAD_ARGS


class _Spy:
    """Counts the elements handed to a native function, then calls it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.items = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.items += args[3] if len(args) == 6 else args[2]
        return self.fn(*args)


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
def test_combiner_hands_large_contiguous_arrays_to_the_native_loops(
        lib: native.NativeLib, dt: np.dtype[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays past the threshold go native; small, strided, partly overlapping and
    read-only outputs and other dtypes stay on NumPy; the results (and errors) are
    NumPy's either way."""
    red, scl = _Spy(lib.reduce), _Spy(lib.scale)
    monkeypatch.setattr(_dtypes, "_native_reduce", red)
    monkeypatch.setattr(_dtypes, "_native_scale", scl)
    least = _dtypes._HALF_MIN[dt]
    rng = np.random.default_rng(5)

    def rand(n: int) -> np.ndarray[Any, Any]:
        return rng.standard_normal(n).astype(dt)

    add = combiner(ReduceOp.SUM, dt)
    assert combiner(ReduceOp.SUM, np.dtype(np.int32)) is np.add  # (floats: see _dtypes._ieee)
    big_a, big_b = rand(least + 3), rand(least + 3)
    out = np.empty_like(big_a)
    add(big_a, big_b, out=out)
    assert red.items == least + 3
    assert np.array_equal(out.view(np.uint16), np.add(big_a, big_b).view(np.uint16))
    red.items = 0
    small = rand(least - 1)
    add(small, small, out=np.empty_like(small))  # below the threshold
    long_a = rand(2 * least + 2)
    strided = long_a[::2]
    res = np.empty_like(strided)
    add(strided, strided, out=res)  # not contiguous
    assert np.array_equal(res.view(np.uint16), np.add(strided, strided).view(np.uint16))
    shifted = rand(least + 8)
    want = np.add(shifted[1:], shifted[:-1])
    add(shifted[1:], shifted[:-1], out=shifted[:-1])  # partly overlapping its output
    assert np.array_equal(shifted[:-1].view(np.uint16), want.view(np.uint16))
    square = rand(4 * least).reshape(2 * least, 2)
    with pytest.raises(ValueError, match="broadcast"):  # (same size, other shape)
        add(square, square, out=np.empty((least, 4), dt))
    swapped = rand(least + 8).astype(dt.newbyteorder())
    res2 = np.empty_like(swapped)
    add(swapped, swapped, out=res2)  # (another byte order: not the combiner's dtype)
    assert np.array_equal(res2, np.add(swapped, swapped))
    frozen = rand(least + 8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        add(shifted, shifted, out=frozen)  # NumPy's own refusal
    assert red.items == 0
    # scaling (AVG's): native past the threshold, exact
    f = avg_factor(dt, 3)
    x = rand(least + 5)
    y = np.empty_like(x)
    scale_into(y, x, f)
    assert scl.items == least + 5
    assert np.array_equal(y.view(np.uint16), np.multiply(x, f).view(np.uint16))
    # A Python float is rounded to the dtype first, on the native path and on NumPy's
    # (below the threshold) alike: ml_dtypes releases differ on whether bfloat16 * float
    # rounds the float to bfloat16 (0.7, here) or promotes to float32 (0.6, the GPU host).
    small_x = x[: least - 1]
    small_y = np.empty_like(small_x)
    for plain in (1 / 3, 0.1):
        want = np.multiply(x, dt.type(plain))
        assert want.dtype == dt
        scale_into(y, x, plain)
        assert np.array_equal(y.view(np.uint16), want.view(np.uint16))
        scale_into(small_y, small_x, plain)
        assert np.array_equal(small_y.view(np.uint16), want[: least - 1].view(np.uint16))


@pytest.mark.parametrize("dt", HALVES, ids=IDS)
@pytest.mark.parametrize("nranks", [2, 3])
async def test_collectives_on_16_bit_floats_give_numpys_bits(
        lib: native.NativeLib, dt: np.dtype[Any], nranks: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks in one loop over TCP: SUM, MAX and AVG all_reduce, reduce_scatter and reduce
    on random 16-bit floats, run twice: with the native ring and loops (forming the
    communicators loads them: the process's record of loaded libraries is emptied first)
    and with neither (ACOLL_NATIVE=0: the Python ring on NumPy's loops). Same algorithms,
    so the same bits; with 2 ranks (one addition, no order) also the reference's."""
    monkeypatch.setenv("ACOLL_SHM_DISABLE", "1")
    monkeypatch.setenv("ACOLL_NET", "socket")
    count = 70_001

    def inputs(rank: int, n: int) -> np.ndarray[Any, Any]:
        return (np.random.default_rng(rank).standard_normal(n) * 50).astype(dt)

    async def fn(comm: acoll.Communicator) -> list[bytes]:
        got = []
        mine = inputs(comm.rank, count)
        whole = inputs(comm.rank, count * comm.size)
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
            x = mine.copy()
            await comm.all_reduce(x, op=op)
            out = np.empty(count, dt)
            await comm.reduce_scatter(whole, out, op=op)
            res = np.zeros(count, dt)
            await comm.reduce(mine, res, op=op, root=0)
            got += [x.tobytes(), out.tobytes(), res.tobytes()]
        return got

    monkeypatch.setattr(native, "_loaded", {})
    spy = _Spy(lib.reduce)
    monkeypatch.setattr(_dtypes, "_native_reduce", None)

    def register(red: Any, scl: Any) -> None:
        _dtypes.use_native_halves(None if red is None else spy, scl)

    monkeypatch.setattr(native, "use_native_halves", register)
    monkeypatch.setattr(_communicator, "use_native_halves", register)
    fast = await run_ranks(nranks, fn)
    assert spy.items > 0  # (the native loops ran)
    monkeypatch.setenv("ACOLL_NATIVE", "0")
    slow = await run_ranks(nranks, fn)
    assert _dtypes._native_reduce is None  # (an ACOLL_NATIVE=0 communicator turned it off)
    for r in range(nranks):
        for k, (f, s) in enumerate(zip(fast[r], slow[r], strict=True)):
            assert f == s, f"rank {r}, result {k}"
    if nranks == 2:
        for k, op in enumerate((ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)):
            want = reference([inputs(r, count) for r in range(2)], op)
            assert fast[0][3 * k] == want.tobytes(), op


def test_the_native_ring_takes_16_bit_floats(lib: native.NativeLib) -> None:
    from acoll._comm import native_ring
    assert {6, 7} <= native_ring._NATIVE_DTYPES
    assert lib.version >= 5
