"""Unit tests of tenplex.store.blocks: block digests, byte runs of a box, needed blocks, runs."""

from __future__ import annotations

import math

import numpy as np
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tenplex.store.blocks import BlockHasher, box_runs, coalesce, digest, needed_blocks


@given(data=st.binary(min_size=0, max_size=5000), block=st.integers(1, 700),
       cuts=st.lists(st.integers(0, 5000), max_size=8))
def test_block_hasher_digests_blocks_however_the_stream_is_cut(data, block, cuts):
    hasher = BlockHasher(block)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for a, b in zip(points, points[1:]):
        hasher.update(data[a:b])
    expected = [xxhash.xxh3_128_hexdigest(data[i:i + block]) for i in range(0, len(data), block)]
    assert hasher.finish() == expected
    assert len(expected) == math.ceil(len(data) / block)
    assert all(digest(data[i:i + block]) == d for i, d in zip(range(0, len(data), block), expected))


@st.composite
def boxes(draw):
    """``(view shape, offsets, sizes, base)``: a box inside a row-major view."""
    view = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    offsets, sizes = [], []
    for n in view:
        lo = draw(st.integers(0, n - 1))
        offsets.append(lo)
        sizes.append(draw(st.integers(1, n - lo)))
    return view, tuple(offsets), tuple(sizes), draw(st.integers(0, 1000))


@given(boxes())
def test_box_runs_cover_exactly_the_box(case):
    view, offsets, sizes, base = case
    starts, length = box_runs(view, offsets, sizes, base)
    flat = np.arange(math.prod(view), dtype=np.int64).reshape(view) + base
    expected = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
    got = (starts[:, None] + np.arange(length)[None, :]).reshape(-1)
    assert np.array_equal(np.sort(got), np.sort(expected))
    assert np.all(np.diff(starts) >= length)  # runs are sorted and disjoint


@given(st.integers(1, 300), st.integers(1, 5000),
       st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 400)), max_size=10))
def test_needed_blocks_are_the_blocks_runs_touch(block, size, runs):
    starts = np.array([min(a, size) for a, _ in runs], dtype=np.int64)
    ends = np.array([min(a + n, size) for a, n in runs], dtype=np.int64)
    got = needed_blocks(starts, ends, block, size)
    expected = sorted({b // block for a, e in zip(starts, ends) for b in range(a, e)})
    assert got.tolist() == expected


@given(st.lists(st.integers(0, 200), unique=True), st.integers(0, 5))
def test_coalesce_merges_runs_with_small_gaps(blocks, gap):
    blocks = np.array(sorted(blocks), dtype=np.int64)
    runs = coalesce(blocks, gap)
    covered = [b for first, last in runs for b in range(first, last)]
    assert set(blocks.tolist()) <= set(covered)
    assert covered == sorted(set(covered))  # disjoint and ascending
    for first, last in runs:  # every run starts and ends on a needed block
        assert first in blocks and last - 1 in blocks
    for (_, a), (b, _) in zip(runs, runs[1:]):
        assert b - a > gap  # runs closer than the gap were merged
    assert coalesce(blocks) == coalesce(blocks, 0)
