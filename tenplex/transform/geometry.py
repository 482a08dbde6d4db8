"""Per-leaf resharding geometry: who holds what, and how target pieces are covered.

The planner asks, for one tensor leaf, which source holder classes (pools of
replica ranks) hold which boxes, and how each target holder class's pieces
are cut into *segments*, each held whole by one or more source pieces. Leaves
with the same shapes, layout and stage mapping share one :class:`LeafGeometry`
(all 96 layers' QKV weights that move from stage 3 to stage 1, say), so the
geometry is computed once per kind of leaf rather than once per leaf.

Everything here is pure and deterministic; nothing touches tensor data.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from tenplex.ptree.region import Box, contains, full_box, intersect, subtract, volume
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import TensorLeaf
from tenplex.transform.plan import KIND_CODE, OpKind

__all__ = ["SegmentType", "Segment", "LeafGeometry", "signature", "tp_symmetric", "tp_shift"]

class SegmentType(enum.IntEnum):
    """What covers a segment of a target piece (not an :class:`~tenplex.transform.plan.OpKind`)."""

    COPY = 0
    """Live source pieces hold it: it becomes copy ops."""
    FILL = 1
    """Padding only the target has: it becomes an ``OpKind.FILL`` op."""
    MISSING = 2
    """No live source holds it: a store read, or :class:`~tenplex.errors.MissingDataError`."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A box of one target piece and the source pieces that hold all of it.

    Attributes:
        type: a :class:`SegmentType`.
        box: the global box.
        dst_piece: the target piece index.
        alts: ``((pool, src_piece, kind code), ...)``, best first; empty
            unless ``type == SegmentType.COPY``.
    """

    type: int
    box: Box
    dst_piece: int
    alts: tuple[tuple[int, int, int], ...]


def signature(src: Sharding, dst: Sharding, leaf: TensorLeaf) -> tuple:
    """Leaves with equal signatures have equal geometry under the source and target shardings.

    The signature holds
    the padded shapes, the split, the stages on both sides, the buffer
    membership (for dp-sharded leaves) and, for experts, the owning ep rank
    on both sides.
    """
    return (src.physical_shape(leaf), dst.physical_shape(leaf), leaf.layout.split,
            src.stages(leaf), dst.stages(leaf), leaf.layout.dp_shard, src.owner(leaf),
            dst.owner(leaf))


class _Cand:
    __slots__ = ("pool", "piece", "box", "start", "end")

    def __init__(self, pool: int, piece: int, box: Box):
        self.pool, self.piece, self.box = pool, piece, box
        self.start = box.offsets[0] if box.offsets else 0
        self.end = self.start + (box.sizes[0] if box.sizes else 1)


class _Index:
    """Candidates indexed on axis 0 for overlap queries (sorted starts, prefix-max ends)."""

    def __init__(self, cands: list[_Cand]):
        self.cands = sorted(cands, key=lambda c: (c.start, c.end, c.pool, c.piece))
        self.starts = [c.start for c in self.cands]
        self.max_end = []
        top = -1
        for c in self.cands:
            top = max(top, c.end)
            self.max_end.append(top)

    def overlapping(self, box: Box) -> list[_Cand]:
        if not box.sizes:
            return list(self.cands)
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        i = bisect_left(self.starts, hi) - 1
        out = []
        while i >= 0 and self.max_end[i] > lo:
            c = self.cands[i]
            if c.end > lo:
                out.append(c)
            i -= 1
        out.reverse()
        return out


class LeafGeometry:
    """Source pools and target classes of one kind of leaf, with cached covers.

    Attributes:
        pools: per source holder class, its live ranks (int64 arrays).
        member: ``member[pool, rank]``: ``rank`` is a live rank of ``pool``;
            shape ``[pools, src_world + 1]`` (the last column is a sentinel
            for "no rank").
        class_of_src: the holder class of each source rank (-1: none);
            length ``src_world + 1``.
        dst_classes: per target holder class, ``(ranks, pieces' boxes)``.

    Args:
        src, dst: the tree under the source and target configs.
        path: the tensor leaf.
        alive_mask: ``[src world + 1]`` bool, the live source ranks.
        shared: a cover memo shared between geometries; covers are keyed by
            their geometry relative to the target box, so a translated copy
            (the same picture on another tp rank) is computed once.
        tp_coord: only the classes of this split rank (tp, or etp for
            experts) on both sides; ``None`` for all.
    """

    def __init__(self, src: Sharding, dst: Sharding, path: str, alive_mask: np.ndarray,
                 shared: dict | None = None, tp_coord: int | None = None):
        leaf = src.tree[path]
        self._shared = {} if shared is None else shared
        world = src.config.world_size
        self.extent = full_box(src.physical_shape(leaf))
        src_classes = src.classes(path, tp_coord)
        self.class_of_src = np.full(world + 1, -1, dtype=np.int64)
        self.pools: list[np.ndarray] = []
        self.member = np.zeros((len(src_classes), world + 1), dtype=bool)
        self.pool_boxes: list[tuple[Box, ...]] = []
        cands = []
        for k, holders in enumerate(src_classes):
            ranks = np.asarray(holders.ranks, dtype=np.int64)
            self.class_of_src[ranks] = k
            live = ranks[alive_mask[ranks]]
            self.pools.append(live)
            self.member[k, live] = True
            boxes = tuple(p.box for p in holders.holding.pieces)
            self.pool_boxes.append(boxes)
            if len(live):
                cands.extend(_Cand(k, i, b) for i, b in enumerate(boxes))
        self.index = _Index(cands)
        self.dst_classes = [(np.asarray(c.ranks, dtype=np.int64), tuple(p.box for p in c.holding.pieces))
                            for c in dst.classes(path, tp_coord)]
        self._covers: dict = {}
        self._lb: dict = {}
        self._sender_index: _Index | None = None

    def sender_index(self, senders: np.ndarray) -> "_Index":
        """The boxes of the pools with a rank in ``senders`` (``[src world + 1]`` bool), indexed.

        Made once per geometry (a planner's senders never change).
        """
        if self._sender_index is None:
            pools = np.nonzero((self.member & senders[None, :]).any(axis=1))[0].tolist()
            self._sender_index = _Index([_Cand(k, i, b) for k in pools
                                         for i, b in enumerate(self.pool_boxes[k])])
        return self._sender_index

    # -- covers ------------------------------------------------------------
    def segments(self, k: int, prefer: int) -> tuple[Segment, ...]:
        """The segments of target class ``k``'s pieces, preferring pool ``prefer`` (-1: none)."""
        key = (k, prefer)
        hit = self._covers.get(key)
        if hit is None:
            hit = []
            for j, box in enumerate(self.dst_classes[k][1]):
                hit.extend(self._cover(j, box, prefer))
            hit = self._covers[key] = tuple(hit)
        return hit

    def _cover(self, j: int, target: Box, prefer: int) -> list[Segment]:
        """Cover ``target`` with source boxes; memoized by geometry relative to ``target``."""
        inside = intersect(target, self.extent)
        near = self.index.overlapping(inside) if inside is not None else []
        origin = target.offsets
        key = (target.sizes, _rel(self.extent, origin),
               tuple((_rel(c.box, origin), c.pool == prefer) for c in near))
        rel = self._shared.get(key)
        if rel is None:
            rel = self._shared[key] = _cover_relative(target, inside, self.extent, near, prefer)
        return [Segment(typ, Box(tuple(o + d for o, d in zip(origin, off)), sizes), j,
                        tuple((near[i].pool, near[i].piece, kind) for i, kind in alts))
                for typ, off, sizes, alts in rel]

    # -- lower bound -----------------------------------------------------------
    def unheld_volume(self, k: int, prefer: int) -> int:
        """Elements of target class ``k``'s pieces that pool ``prefer`` does not hold (FILL excluded)."""
        key = (k, prefer)
        hit = self._lb.get(key)
        if hit is None:
            hit = 0
            for box in self.dst_classes[k][1]:
                inside = intersect(box, self.extent)
                if inside is None:
                    continue
                held = (_union_volume(inside, self.pool_boxes[prefer])
                        if prefer >= 0 and len(self.pools[prefer]) else 0)
                hit += volume(inside) - held
            self._lb[key] = hit
        return hit


def tp_symmetric(src: Sharding, dst: Sharding, leaf: TensorLeaf) -> bool:
    """True if split rank ``t``'s geometry is split rank 0's shifted (same split-local frame).

    The split rank is the tp rank, or the etp rank for experts. Shifting a
    rank by the split coordinate's stride must keep every other coordinate
    its holding depends on; that fails only for an expert leaf in a dense
    flat-buffer part (ep = 1, grouped by dp-cp rank) whose etp differs from
    tp or is laid out differently.
    """
    split = leaf.layout.split
    if split is None or src.degree(leaf) != dst.degree(leaf) or src.degree(leaf) < 2 \
            or src.physical_shape(leaf) != dst.physical_shape(leaf):
        return False
    if leaf.layout.expert is not None and leaf.layout.dp_shard is not None:
        for sharding in (src, dst):
            c = sharding.config
            if not sharding.expert_part(leaf) and (c.etp != c.tp or c.stride("etp") != c.stride("tp")):
                return False
    return True


def tp_shift(leaf_shape: tuple, split, tp: int, offsets: np.ndarray, t: int) -> np.ndarray:
    """Offsets of split rank 0's boxes moved to split rank ``t`` of ``tp`` (each part by ``t * chunk``).

    Args:
        leaf_shape: the padded global shape.
        split: the leaf's split.
        tp: the split degree (tp, or etp for experts).
        offsets: ``[boxes, ndim]`` int64 box offsets of split rank 0.
        t: the split rank to move them to.
    """
    axis = split.axis
    parts = split.part_lengths(leaf_shape[axis])
    starts = np.cumsum((0,) + parts[:-1])
    chunks = np.asarray(parts) // tp
    part = np.searchsorted(starts, offsets[:, axis], side="right") - 1
    out = offsets.copy()
    out[:, axis] += t * chunks[part]
    return out


def _rel(box: Box, origin) -> tuple:
    return (tuple(o - r for o, r in zip(box.offsets, origin)), box.sizes)


def _cover_relative(target: Box, inside: Box | None, extent: Box, near: list, prefer: int):
    """Segments of ``target`` as ``(type, offsets - target offsets, sizes, ((near index, kind), ...))``."""
    out = [(SegmentType.FILL, b) for b in (subtract(target, extent) if inside != target else ())]
    alts_of = {}
    if inside is not None:
        hits = [(i, c, b) for i, c in enumerate(near) if (b := intersect(c.box, inside))]
        if prefer >= 0:
            hits.sort(key=lambda h: h[1].pool != prefer)
        remaining = [inside]
        copies = []
        for _, cand, hit in hits:
            if not remaining:
                break
            rest = []
            for box in remaining:
                seg = intersect(box, hit)
                if seg is None:
                    rest.append(box)
                    continue
                alts_of[seg] = tuple((i, _kind(seg, c.box, target)) for i, c, b in hits
                                     if contains(b, seg))
                copies.append((SegmentType.COPY, seg))
                rest.extend(subtract(box, seg))
            remaining = rest
        copies.sort(key=lambda s: s[1].offsets)
        out.extend(copies)
        out.extend((SegmentType.MISSING, b) for b in remaining)
    origin = target.offsets
    return tuple((typ, tuple(o - r for o, r in zip(b.offsets, origin)), b.sizes,
                  alts_of.get(b, ()) if typ == SegmentType.COPY else ()) for typ, b in out)


def _kind(seg: Box, src_box: Box, dst_box: Box) -> int:
    whole_src, whole_dst = seg == src_box, seg == dst_box
    if whole_src and whole_dst:
        return KIND_CODE[OpKind.KEEP]
    if whole_dst:
        return KIND_CODE[OpKind.SPLIT]
    if whole_src:
        return KIND_CODE[OpKind.MERGE]
    return KIND_CODE[OpKind.REPARTITION]


def _union_volume(target: Box, boxes) -> int:
    """Elements of ``target`` covered by the union of ``boxes``."""
    remaining, covered = [target], 0
    for other in boxes:
        rest = []
        for box in remaining:
            inter = intersect(box, other)
            if inter is None:
                rest.append(box)
            else:
                covered += volume(inter)
                rest.extend(subtract(box, inter))
        remaining = rest
    return covered

