"""Property tests of the chunking and splitting arithmetic the algorithms rely on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from acoll._coll.base import chunk_ranges, split_even


@settings(deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 2048))
def test_split_even_covers_exactly_and_is_balanced(count: int, parts: int) -> None:
    ranges = split_even(count, parts)
    assert len(ranges) == parts
    start = 0
    for s, length in ranges:  # consecutive, no gap, no overlap
        assert s == start
        assert length >= 0
        start += length
    assert start == count
    lengths = [length for _, length in ranges]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the longer ones come first


@settings(deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(1, 10**5))
def test_chunk_ranges_tile_the_range(start: int, length: int, chunk: int) -> None:
    pieces = chunk_ranges(start, length, chunk)
    assert sum(n for _, n in pieces) == length
    pos = start
    for s, n in pieces:
        assert s == pos
        assert 0 < n <= chunk
        pos += n
    assert len(pieces) == -(-length // chunk)


@settings(deadline=None)
@given(st.integers(0, 10**5), st.integers(1, 64), st.integers(1, 10**5))
def test_ring_segments_and_chunks_cover_every_element_once(count: int, n: int,
                                                           chunk: int) -> None:
    seen = bytearray(count)
    for s, length in split_even(count, n):
        for cs, cl in chunk_ranges(s, length, chunk):
            for i in (cs, cs + cl - 1):
                assert 0 <= i < count
            seen[cs:cs + cl] = b"\1" * cl
    assert seen == b"\1" * count
