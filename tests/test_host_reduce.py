"""Host reduction helpers: integer AVG truncation at the edges, and size messages."""

from __future__ import annotations

import numpy as np
import pytest

import acoll
from acoll._dtypes import finish_avg
from acoll.testing import run_ranks


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_integer_avg_truncates_toward_zero_at_the_extremes(dtype: type) -> None:
    info = np.iinfo(dtype)
    values = [info.min, info.min + 1, -7, -6, -1, 0, 1, 6, 7, info.max]
    for n in (2, 3, 7):
        arr = np.array(values, dtype)
        finish_avg(arr, n)
        # Python ints are exact: int(a / n) would round through a float, so use divmod
        want = [(-(-v // n) if v < 0 else v // n) for v in values]
        assert arr.tolist() == want, (dtype, n)


async def test_reduce_scatter_size_message_names_the_send() -> None:
    async def fn(comm: acoll.Communicator) -> str:
        try:
            await comm.reduce_scatter(np.ones(17, np.float32), np.ones(8, np.float32))
        except acoll.InvalidUsage as exc:
            return str(exc)
        return "no error"

    msgs = await run_ranks(2, fn)
    assert "send must hold 16 (2 x recv)" in msgs[0], msgs
    assert "recv must hold" not in msgs[0]


def test_numpy_integers_are_reduction_ops() -> None:
    """Found by review: op=np.int64(2) was refused while op=2 was taken."""
    assert acoll.ReduceOp.coerce(np.int64(2)) is acoll.ReduceOp(2)
    assert acoll.ReduceOp.coerce(np.uint8(0)) is acoll.ReduceOp(0)
    with pytest.raises(acoll.InvalidUsage, match="unknown reduction op"):
        acoll.ReduceOp.coerce(np.int32(99))


@pytest.mark.parametrize("op", [True, False, np.bool_(True)])
def test_a_bool_is_not_a_reduction_op(op: bool) -> None:
    """Found by review: op=True was taken as PROD (bool is an int)."""
    with pytest.raises(acoll.InvalidUsage, match="unknown reduction op"):
        acoll.ReduceOp.coerce(op)


_OVERFLOWING = {"float16": 60000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1.7e308}


@pytest.mark.parametrize("strict", ["seterr", "warnings"])
@pytest.mark.parametrize("count", [4, 1 << 17])
async def test_overflow_gives_inf_under_strict_floating_point_settings(
        strict: str, count: int) -> None:
    """Found by review (session 56): with warnings as errors (``pytest -W error``) or
    ``np.seterr(all="raise")``, a sum that overflows (or inf + -inf) raised NumPy's
    RuntimeWarning / FloatingPointError out of the collective and failed the communicator;
    NCCL returns inf and NaN. Each rank's reduction now keeps the IEEE result."""
    import warnings

    from acoll._dtypes import parse_dtype

    async def body(comm: acoll.Communicator) -> list[np.ndarray]:
        out = []
        for name, big in _OVERFLOWING.items():
            dt = parse_dtype(name)
            for op in ("sum", "prod", "avg", "max"):
                x = np.full(count, big, np.float64).astype(dt)
                await comm.all_reduce(x, op=op)
                out.append(x.astype(np.float64))
            y = np.full(count, np.inf if comm.rank == 0 else -np.inf, np.float64).astype(dt)
            await comm.all_reduce(y)
            out.append(y.astype(np.float64))
        return out

    with warnings.catch_warnings():
        if strict == "warnings":
            warnings.simplefilter("error")
            results = await run_ranks(2, body)
        else:
            with np.errstate(all="raise"):
                results = await run_ranks(2, body)
    for got in results:
        for i, name in enumerate(_OVERFLOWING):
            big = float(np.float64(_OVERFLOWING[name]).astype(parse_dtype(name)))
            sums, prods, avgs, maxes, nans = got[5 * i: 5 * i + 5]
            assert np.isposinf(sums).all(), name
            assert np.isposinf(prods).all(), name
            assert np.isfinite(avgs).all(), name
            assert (maxes == big).all(), name
            assert np.isnan(nans).all(), name


def test_reduction_helpers_keep_the_ieee_result_when_numpy_raises() -> None:
    from acoll._dtypes import BFLOAT16, ReduceOp, combiner, reduce_into, scale_into

    for dt in (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)):
        big = np.full(9, np.finfo(dt).max if dt != BFLOAT16 else 3e38, dt)
        with np.errstate(all="raise"):
            out = np.zeros_like(big)
            combiner(ReduceOp.SUM, dt)(big, big, out=out)
            assert np.isposinf(out.astype(np.float64)).all(), dt
            out[:] = 0
            reduce_into(out, big, big, ReduceOp.PROD)
            assert np.isposinf(out.astype(np.float64)).all(), dt
            inf = np.full(9, np.inf, dt)
            scale_into(out, inf, dt.type(0))
            assert np.isnan(out.astype(np.float64)).all(), dt
