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
