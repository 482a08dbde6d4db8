from math import prod

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tenplex.errors import LayoutError
from tenplex.ptree.region import (Box, contains, decompose_flat, flat_start, full_box, intersect,
                                  nbytes, subtract, to_slices, volume)


def test_intersect_and_volume():
    a, b = Box((0, 0), (4, 8)), Box((2, 4), (4, 8))
    assert intersect(a, b) == Box((2, 4), (2, 4))
    assert intersect(a, Box((4, 0), (1, 1))) is None
    assert volume(a) == 32 and nbytes(a, 2) == 64
    assert contains(a, Box((1, 1), (2, 2))) and not contains(a, b)


def test_decompose_flat_hand_checked():
    assert decompose_flat(5, 27, (4, 8)) == (
        Box((0, 5), (1, 3)), Box((1, 0), (2, 8)), Box((3, 0), (1, 3)))
    assert decompose_flat(0, 32, (4, 8)) == (Box((0, 0), (4, 8)),)
    assert decompose_flat(3, 3, (4, 8)) == ()
    with pytest.raises(LayoutError, match=r"flat range \[0, 33\) does not fit a tensor of shape \(4, 8\)"):
        decompose_flat(0, 33, (4, 8))


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@given(shapes, st.data())
def test_decompose_flat_covers_range_in_order(shape, data):
    total = prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = decompose_flat(start, stop, shape)
    assert len(boxes) <= 2 * len(shape) - 1
    marks = torch.zeros(shape, dtype=torch.int64)
    flat = torch.arange(total).view(shape)
    position = start
    for box in boxes:
        part = flat[to_slices(box)].reshape(-1)
        # each box is contiguous in row-major order and follows the previous one
        assert part.tolist() == list(range(position, position + volume(box)))
        assert flat_start(box, shape) == position
        position += volume(box)
        marks[to_slices(box)] += 1
    assert position == stop
    assert marks.view(-1)[start:stop].eq(1).all() and marks.sum() == stop - start


boxes_in = lambda shape: st.tuples(*[st.tuples(st.integers(0, n - 1), st.integers(1, n))
                                     for n in shape]).map(
    lambda spans: Box(tuple(o for o, _ in spans),
                      tuple(min(s, n - o) for (o, s), n in zip(spans, shape))))


@given(shapes.flatmap(lambda s: st.tuples(st.just(s), boxes_in(s), boxes_in(s))))
def test_subtract_partitions(args):
    shape, a, b = args
    pieces = subtract(a, b)
    assert len(pieces) <= 2 * len(shape)
    marks = torch.zeros(shape, dtype=torch.int64)
    for p in pieces:
        assert contains(a, p) and intersect(p, b) is None
        marks[to_slices(p)] += 1
    inter = intersect(a, b)
    if inter is not None:
        marks[to_slices(inter)] += 1
    expected = torch.zeros(shape, dtype=torch.int64)
    expected[to_slices(a)] = 1
    assert torch.equal(marks, expected)


def test_box_json_and_str():
    box = Box((1, 2), (3, 4))
    assert Box.from_json(box.to_json()) == box
    assert str(box) == "[1:4, 2:6]"
    assert full_box((2, 3)) == Box((0, 0), (2, 3))
    with pytest.raises(LayoutError, match="offsets has 1 axes but sizes has 2"):
        Box((0,), (1, 2))
