"""Region geometry: boxes in a global tensor, as pure functions.

A :class:`Box` is a hyper-rectangle of a row-major tensor, given by
``offsets`` and ``sizes`` per axis, both in elements. A *region* (the part of
a global tensor that one rank holds) is a union of disjoint boxes, kept as a
tuple of boxes. Every piece of geometry in tenplex goes through this module.

Example:
    >>> a = Box((0, 0), (4, 8))
    >>> b = Box((2, 4), (4, 8))
    >>> intersect(a, b)
    Box(offsets=(2, 4), sizes=(2, 4))
    >>> decompose_flat(5, 27, (4, 8))  # a flat range crosses rows
    (Box(offsets=(0, 5), sizes=(1, 3)), Box(offsets=(1, 0), sizes=(2, 8)), Box(offsets=(3, 0), sizes=(1, 3)))
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

from tenplex.errors import LayoutError

__all__ = [
    "Box",
    "full_box",
    "intersect",
    "contains",
    "volume",
    "nbytes",
    "subtract",
    "decompose_flat",
    "flat_start",
    "shift",
    "relative",
    "to_slices",
    "is_contiguous",
]


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle: ``offsets[i] <= index[i] < offsets[i] + sizes[i]``.

    Attributes:
        offsets: start index per axis, in elements.
        sizes: extent per axis, in elements (>= 0).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise LayoutError(
                f"Box: offsets has {len(self.offsets)} axes but sizes has {len(self.sizes)}"
            )

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    @classmethod
    def from_json(cls, obj: Sequence[Sequence[int]]) -> "Box":
        return cls(tuple(int(v) for v in obj[0]), tuple(int(v) for v in obj[1]))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def volume(box: Box) -> int:
    """Number of elements in ``box``."""
    return prod(box.sizes)


def nbytes(box: Box, itemsize: int) -> int:
    """Bytes in ``box`` for elements of ``itemsize`` bytes."""
    return volume(box) * itemsize


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same rank, or ``None`` if empty."""
    offsets = []
    sizes = []
    for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo = ao if ao > bo else bo
        hi = min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def contains(outer: Box, inner: Box) -> bool:
    """True if every element of ``inner`` lies in ``outer``."""
    return all(
        oo <= io and io + is_ <= oo + os_
        for oo, os_, io, is_ in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes)
    )


def subtract(a: Box, b: Box) -> tuple[Box, ...]:
    """``a`` minus ``b`` as at most ``2 * ndim`` disjoint boxes.

    Slabs are peeled off axis by axis: below and above ``b`` on axis 0, then
    on axis 1 within ``b``'s axis-0 range, and so on.
    """
    inter = intersect(a, b)
    if inter is None:
        return (a,)
    out: list[Box] = []
    offsets = list(a.offsets)
    sizes = list(a.sizes)
    for axis in range(a.ndim):
        lo, hi = inter.offsets[axis], inter.offsets[axis] + inter.sizes[axis]
        start, end = offsets[axis], offsets[axis] + sizes[axis]
        if lo > start:
            o, s = list(offsets), list(sizes)
            s[axis] = lo - start
            out.append(Box(tuple(o), tuple(s)))
        if hi < end:
            o, s = list(offsets), list(sizes)
            o[axis] = hi
            s[axis] = end - hi
            out.append(Box(tuple(o), tuple(s)))
        offsets[axis], sizes[axis] = lo, hi - lo
    return tuple(out)


def flat_start(box: Box, shape: Sequence[int]) -> int:
    """Row-major flat index of ``box``'s first element in a tensor of ``shape``."""
    index = 0
    for o, n in zip(box.offsets, shape):
        index = index * n + o
    return index


def decompose_flat(start: int, stop: int, shape: Sequence[int]) -> tuple[Box, ...]:
    """Split the flat range ``[start, stop)`` of a row-major ``shape`` into boxes.

    Each returned box is contiguous in row-major order, the boxes are in flat
    order, and there are at most ``2 * ndim - 1`` of them (a partial head on
    every axis, one block of whole rows, a partial tail on every axis).

    Args:
        start: first flat element index (inclusive).
        stop: last flat element index (exclusive), ``start <= stop <= prod(shape)``.
        shape: the tensor's shape.

    Raises:
        LayoutError: if the range does not lie inside the tensor.
    """
    total = prod(shape)
    if not 0 <= start <= stop <= total:
        raise LayoutError(
            f"flat range [{start}, {stop}) does not fit a tensor of shape {tuple(shape)} "
            f"with {total} elements"
        )
    if start == stop:
        return ()
    if len(shape) == 0:
        return (Box((), ()),)
    return tuple(_decompose(start, stop, tuple(shape)))


def _decompose(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """Boxes of ``[start, stop)`` in ``shape``; ``start < stop``."""
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner = prod(shape[1:])
    first_row, first_off = divmod(start, inner)
    last_row, last_off = divmod(stop, inner)
    rest = shape[1:]
    if first_row == last_row:  # within one row of axis 0
        return [_prepend(first_row, b) for b in _decompose(first_off, last_off, rest)]
    boxes: list[Box] = []
    if first_off:
        boxes += [_prepend(first_row, b) for b in _decompose(first_off, inner, rest)]
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row,) + (0,) * len(rest), (last_row - first_row,) + rest))
    if last_off:
        boxes += [_prepend(last_row, b) for b in _decompose(0, last_off, rest)]
    return boxes


def _prepend(row: int, box: Box) -> Box:
    return Box((row,) + box.offsets, (1,) + box.sizes)


def shift(box: Box, delta: Sequence[int]) -> Box:
    """``box`` moved by ``delta`` elements per axis."""
    return Box(tuple(o + d for o, d in zip(box.offsets, delta)), box.sizes)


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of ``origin`` (which must contain it)."""
    return Box(tuple(o - r for o, r in zip(box.offsets, origin.offsets)), box.sizes)


def to_slices(box: Box) -> tuple[slice, ...]:
    """Index ``box`` out of a tensor: ``tensor[to_slices(box)]``."""
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def is_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """True if ``box`` is one contiguous run of a row-major tensor of ``shape``.

    That holds when every axis after the first one with more than one
    element is covered whole.
    """
    axes = [i for i, s in enumerate(box.sizes) if s > 1]
    if not axes:
        return True
    first = axes[0]
    return all(box.offsets[j] == 0 and box.sizes[j] == shape[j] for j in range(first + 1, len(shape)))
