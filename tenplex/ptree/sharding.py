"""Which part of each leaf a rank holds under a config, and where it sits locally.

A rank's shard of a tensor leaf is one local tensor. Its relation to the
global (padded) tensor is a tuple of :class:`Piece` records, each mapping a
global box to a place in the local tensor:

- a dense shard (tp split or replica) has the tp-local shape; each piece is
  one tp part, ``view`` is the local shape and ``local`` the part's box;
- a dp-sharded shard (distributed optimizer) is 1-D: a flat range of the
  flattened tp-local shard. The range is cut into row-major contiguous boxes
  (:func:`~tenplex.ptree.region.decompose_flat`); piece ``p`` sits at flat
  ``offset`` of the local tensor, viewed as ``view``, at box ``local``.

Global boxes are in the coordinates of the *padded* global tensor; the
logical rows are a prefix of the padded axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm, prod

from tenplex.errors import ConfigError
from tenplex.ptree.config import Coord, ParallelConfig
from tenplex.ptree.region import Box, decompose_flat, flat_start, full_box, intersect
from tenplex.ptree.tree import PTree, TensorLeaf

__all__ = ["Piece", "Holding", "HolderClass", "Sharding"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A global box and its place in a rank's local tensor.

    ``local_tensor.view(-1)[offset : offset + prod(view)].view(view)[local]``
    holds ``global_tensor[global_box]``.

    Attributes:
        box: the global box (padded coordinates), in elements.
        offset: flat element offset into the local tensor.
        view: the shape to view ``prod(view)`` elements from ``offset`` as.
        local: the box within that view; same sizes as ``box``.
    """

    box: Box
    offset: int
    view: tuple[int, ...]
    local: Box


@dataclass(frozen=True, slots=True)
class Holding:
    """What one rank holds of one leaf: its local tensor's shape and pieces."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class HolderClass:
    """Ranks that hold the same pieces of a leaf (replicas of one another).

    Attributes:
        holding: what each of them holds.
        ranks: the ranks, ascending.
    """

    holding: Holding
    ranks: tuple[int, ...]


class Sharding:
    """The geometry of a tree under one config; results are memoized per instance.

    Args:
        tree: the tree spec.
        config: the parallel config; validated against the tree.

    Raises:
        ConfigError: if ``config`` cannot hold ``tree``.
    """

    def __init__(self, tree: PTree, config: ParallelConfig):
        tree.validate(config)
        self.tree = tree
        self.config = config
        self._stage_of = {}
        self._memo: dict = {}
        self._buffers: dict = {}

    # -- shapes and stages -------------------------------------------------
    def physical_shape(self, leaf: TensorLeaf) -> tuple[int, ...]:
        """The padded global shape of ``leaf`` under this config."""
        pad = leaf.layout.padding
        if pad is None:
            return leaf.shape
        shape = list(leaf.shape)
        shape[pad.axis] = pad.padded(shape[pad.axis], self.config.tp)
        return tuple(shape)

    def stages(self, leaf: TensorLeaf) -> tuple[int, ...]:
        """The pipeline stages that hold ``leaf``."""
        return leaf.layout.stage.stages(self.config.pp, self._stage_of_layer)

    def _stage_of_layer(self, layer: int) -> int:
        stage = self._stage_of.get(layer)
        if stage is None:
            stage = self._stage_of[layer] = self.config.stage_of_layer(layer, self.tree.num_layers)
        return stage

    # -- tensor parallelism -----------------------------------------------
    def tp_local(self, leaf: TensorLeaf, t: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
        """Local shape and dense pieces of tp rank ``t``."""
        shape = self.physical_shape(leaf)
        split = leaf.layout.split
        key = ("tp", shape, split, t)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if split is None:
            result = (shape, (Piece(full_box(shape), 0, shape, full_box(shape)),))
        else:
            result = self._split_pieces(shape, split, t)
        self._memo[key] = result
        return result

    def _split_pieces(self, shape, split, t):
        tp, axis = self.config.tp, split.axis
        parts = split.part_lengths(shape[axis])
        local_len = sum(p // tp for p in parts)
        local_shape = shape[:axis] + (local_len,) + shape[axis + 1:]
        pieces = []
        global_start = local_start = 0
        for length in parts:
            chunk = length // tp
            g = [0] * len(shape)
            sizes = list(shape)
            g[axis], sizes[axis] = global_start + t * chunk, chunk
            l = [0] * len(shape)
            l[axis] = local_start
            if chunk:
                pieces.append(Piece(Box(tuple(g), tuple(sizes)), 0, local_shape,
                                    Box(tuple(l), tuple(sizes))))
            global_start += length
            local_start += chunk
        return local_shape, tuple(pieces)

    # -- data parallelism (flat buffers) -------------------------------------
    def buffer_ranges(self, name: str, stage: int) -> tuple[dict, tuple[tuple[int, int], ...]]:
        """Member ranges and buckets of buffer ``name`` on ``stage``.

        Returns:
            ``({key: (start, numel)}, ((bucket_start, bucket_len), ...))`` in
            elements of the flat buffer of one (tp, pp) coordinate.
        """
        key = (name, stage)
        hit = self._buffers.get(key)
        if hit is not None:
            return hit
        buf = self.tree.buffer(name)
        sizes = self._member_numels(name)
        members: dict = {}
        buckets = []
        pad = lcm(self.config.dp, buf.pad_multiple)
        start = bucket_start = 0
        for member in buf.members:
            if member not in sizes or stage not in sizes[member][1]:
                continue
            start = -(-start // buf.align) * buf.align
            numel = sizes[member][0]
            members[member] = (start, numel)
            start += numel
            if buf.bucket_numel is not None and start - bucket_start >= buf.bucket_numel:
                end = bucket_start + -(-(start - bucket_start) // pad) * pad
                buckets.append((bucket_start, end - bucket_start))
                start = bucket_start = end
        if start > bucket_start or not buckets:
            end = bucket_start + -(-(start - bucket_start) // pad) * pad
            buckets.append((bucket_start, end - bucket_start))
        result = (members, tuple(buckets))
        self._buffers[key] = result
        return result

    def _member_numels(self, name: str) -> dict:
        key = ("numels", name)
        hit = self._memo.get(key)
        if hit is None:
            hit = {}
            for _, leaf in self.tree.tensors():
                shard = leaf.layout.dp_shard
                if shard is not None and shard.buffer == name and shard.key not in hit:
                    local_shape, _ = self.tp_local(leaf, 0)
                    hit[shard.key] = (prod(local_shape), self.stages(leaf))
            self._memo[key] = hit
        return hit

    def dp_range(self, leaf: TensorLeaf, d: int, stage: int) -> tuple[int, int] | None:
        """The flat range ``[lo, hi)`` of the tp-local shard that dp rank ``d`` holds."""
        shard = leaf.layout.dp_shard
        members, buckets = self.buffer_ranges(shard.buffer, stage)
        start, numel = members[shard.key]
        for bucket_start, length in buckets:
            if bucket_start <= start < bucket_start + length or (numel == 0 and start == bucket_start):
                per = length // self.config.dp
                lo = max(start, bucket_start + d * per)
                hi = min(start + numel, bucket_start + (d + 1) * per)
                return (lo - start, hi - start) if hi > lo else None
        raise ConfigError(f"buffer {shard.buffer!r}: member {shard.key!r} lies in no bucket")

    def _dp_holders(self, leaf: TensorLeaf, stage: int) -> range:
        """The dp ranks whose range of the member's bucket may overlap the member."""
        shard = leaf.layout.dp_shard
        members, buckets = self.buffer_ranges(shard.buffer, stage)
        start, numel = members[shard.key]
        for bucket_start, length in buckets:
            if bucket_start <= start < bucket_start + length:
                per = length // self.config.dp
                first = (start - bucket_start) // per
                last = (start + max(numel, 1) - 1 - bucket_start) // per
                return range(first, min(last, self.config.dp - 1) + 1)
        return range(0)

    def flat_pieces(self, leaf: TensorLeaf, t: int, lo: int, hi: int) -> tuple[Piece, ...]:
        """Pieces of the flat range ``[lo, hi)`` of tp rank ``t``'s local shard."""
        local_shape, dense = self.tp_local(leaf, t)
        key = ("flat", local_shape, dense, lo, hi)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pieces = []
        for box in decompose_flat(lo, hi, local_shape):
            offset = flat_start(box, local_shape) - lo
            for part in dense:
                sub = intersect(box, part.local)
                if sub is None:
                    continue
                global_box = Box(tuple(g + s - l for g, s, l in
                                       zip(part.box.offsets, sub.offsets, part.local.offsets)),
                                 sub.sizes)
                local = Box(tuple(s - b for s, b in zip(sub.offsets, box.offsets)), sub.sizes)
                pieces.append(Piece(global_box, offset, box.sizes, local))
        result = tuple(pieces)
        self._memo[key] = result
        return result

    # -- per rank ------------------------------------------------------------
    def holding(self, path: str, coord: Coord) -> Holding | None:
        """What the rank at ``coord`` holds of tensor leaf ``path``, or ``None``."""
        leaf = self.tree[path]
        if coord.pp not in self.stages(leaf):
            return None
        local_shape, dense = self.tp_local(leaf, coord.tp)
        if leaf.layout.dp_shard is None:
            return Holding(local_shape, dense)
        rng = self.dp_range(leaf, coord.dp, coord.pp)
        if rng is None:
            return None
        return Holding((rng[1] - rng[0],), self.flat_pieces(leaf, coord.tp, *rng))

    def classes(self, path: str, tp_coord: int | None = None) -> tuple[HolderClass, ...]:
        """The holder classes of tensor leaf ``path``: replicas grouped, in rank order.

        Ranks whose holdings are equal are one class: every dp rank (unless
        dp-sharded), every stage of a multi-stage leaf (unless dp-sharded),
        and every tp rank when the leaf is not tp-split.

        Args:
            path: a tensor leaf.
            tp_coord: only the classes of this tp rank (for a tp-split leaf).
        """
        key = ("classes", path, tp_coord)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        leaf = self.tree[path]
        cfg = self.config
        stages = self.stages(leaf)
        sd, st, sp = cfg.stride("dp"), cfg.stride("tp"), cfg.stride("pp")
        tps = range(cfg.tp) if leaf.layout.split is not None else (None,)
        if tp_coord is not None and leaf.layout.split is not None:
            tps = (tp_coord,)
        ranges = {}
        if leaf.layout.dp_shard is not None:
            ranges = {(d, s): self.dp_range(leaf, d, s)
                      for s in stages for d in self._dp_holders(leaf, s)}
        out = []
        for t in tps:
            members = range(cfg.tp) if t is None else (t,)
            if leaf.layout.dp_shard is None:
                ranks = sorted(d * sd + m * st + s * sp for s in stages for d in range(cfg.dp)
                               for m in members)
                out.append(HolderClass(Holding(*self.tp_local(leaf, t or 0)), tuple(ranks)))
                continue
            for (d, s), rng in ranges.items():
                if rng is not None:
                    held = Holding((rng[1] - rng[0],), self.flat_pieces(leaf, t or 0, *rng))
                    ranks = sorted(d * sd + m * st + s * sp for m in members)
                    out.append(HolderClass(held, tuple(ranks)))
        result = tuple(sorted(out, key=lambda c: c.ranks[0]))
        self._memo[key] = result
        return result

    def ranks_holding(self, path: str) -> tuple[int, ...]:
        """Every rank that holds some part of ``path``, ascending."""
        return tuple(sorted(r for c in self.classes(path) for r in c.ranks))
