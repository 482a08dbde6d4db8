"""Which part of each leaf a rank holds under a config, and where it sits locally.

A rank's shard of a tensor leaf is one local tensor. Its relation to the
global (padded) tensor is a tuple of :class:`Piece` records, each mapping a
global box to a place in the local tensor:

- a dense shard (tp split or replica) has the tp-local shape (etp-local for
  an expert); each piece is one tp part, ``view`` is the local shape and
  ``local`` the part's box;
- a dp-sharded shard (distributed optimizer) is 1-D: a flat range of the
  flattened tp-local shard. The range is cut into row-major contiguous boxes
  (:func:`~tenplex.ptree.region.decompose_flat`); piece ``p`` sits at flat
  ``offset`` of the local tensor, viewed as ``view``, at box ``local``.

Global boxes are in the coordinates of the *padded* global tensor; the
logical rows are a prefix of the padded axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tenplex.ptree.buffer import BufferLayout, layout_buffer
from tenplex.ptree.config import Coord, ParallelConfig
from tenplex.ptree.layout import StageKind
from tenplex.ptree.ranks import RankTable
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

    A dense leaf lives on the dense grid: its split is over ``tp``, its
    replicas are the dp and cp ranks (and the tp ranks, if unsplit). An
    expert leaf (``layout.expert``) lives on the expert grid: the ep rank that
    owns its expert holds it, its split is over ``etp``, its replicas are the
    expert-dp ranks. A dp-sharded leaf (``layout.dp_shard``) holds a range of
    its :class:`~tenplex.ptree.buffer.FlatBuffer` instance, chosen by the
    rank's index in the dp-cp group (dense part) or the expert-dp group
    (expert part; see :mod:`tenplex.ptree.buffer`).

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
        self._chunk_of: list | None = None
        self._memo: dict = {}
        self._coords: dict = {}
        self._ranks: RankTable | None = None

    # -- shapes, stages and experts -----------------------------------------------
    def degree(self, leaf: TensorLeaf) -> int:
        """The split degree of ``leaf``: ``etp`` for experts, else ``tp``."""
        return self.config.etp if leaf.layout.expert is not None else self.config.tp

    def split_axis(self, leaf: TensorLeaf) -> str:
        """The coordinate a split of ``leaf`` follows: ``"etp"`` for experts, else ``"tp"``."""
        return "etp" if leaf.layout.expert is not None else "tp"

    def owner(self, leaf: TensorLeaf) -> int | None:
        """The ep rank holding expert leaf ``leaf``; ``None`` for a dense leaf."""
        expert = leaf.layout.expert
        return None if expert is None else expert.owner(self.config.ep)

    def expert_part(self, leaf: TensorLeaf) -> bool:
        """True if ``leaf``'s flat buffer range is in an expert part (an expert leaf, ep > 1)."""
        return leaf.layout.expert is not None and self.config.ep > 1

    def physical_shape(self, leaf: TensorLeaf) -> tuple[int, ...]:
        """The padded global shape of ``leaf`` under this config."""
        pad = leaf.layout.padding
        if pad is None:
            return leaf.shape
        shape = list(leaf.shape)
        shape[pad.axis] = pad.padded(shape[pad.axis], self.degree(leaf))
        return tuple(shape)

    def places(self, leaf: TensorLeaf) -> tuple[tuple[int, int], ...]:
        """``(stage, virtual chunk)`` of every copy of ``leaf``, by ascending stage.

        A layer's tensors are where the layer is; first-stage tensors are in
        chunk 0 of stage 0 and last-stage tensors in the last chunk of the
        last stage (megatron's ``pre_process`` / ``post_process`` chunks);
        ``StageKind.ALL`` copies are in chunk 0 of every stage.
        """
        stage = leaf.layout.stage
        hit = self._memo.get(stage)
        if hit is None:
            hit = self._memo[stage] = self._places(stage)
        return hit

    def _places(self, stage) -> tuple[tuple[int, int], ...]:
        pp, last = self.config.pp, self.config.vpp - 1
        if stage.kind is StageKind.LAYER:
            return (self._layer_place(stage.layer),)
        if stage.kind is StageKind.FIRST:
            return ((0, 0),)
        if stage.kind is StageKind.LAST:
            return ((pp - 1, last),)
        if stage.kind is StageKind.FIRST_AND_LAST:
            return ((0, 0),) if pp == 1 else ((0, 0), (pp - 1, last))
        return tuple((s, 0) for s in range(pp))

    def stages(self, leaf: TensorLeaf) -> tuple[int, ...]:
        """The pipeline stages that hold ``leaf``."""
        return tuple(s for s, _ in self.places(leaf))

    def _layer_place(self, layer: int) -> tuple[int, int]:
        if self._chunk_of is None:
            n, cfg = self.tree.num_layers, self.config
            table = []
            for s in range(cfg.pp):
                for v in range(cfg.vpp):
                    table += [(layer, (s, v)) for layer in cfg.chunk_layers(s, v, n)]
            self._chunk_of = [place for _, place in sorted(table)]
        return self._chunk_of[layer]

    # -- tensor parallelism -----------------------------------------------
    def tp_local(self, leaf: TensorLeaf, t: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
        """Local shape and dense pieces of split rank ``t`` (a tp rank, or an etp rank for experts)."""
        shape = self.physical_shape(leaf)
        split = leaf.layout.split
        degree = self.degree(leaf)
        key = ("tp", shape, split, degree, t)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if split is None:
            result = (shape, (Piece(full_box(shape), 0, shape, full_box(shape)),))
        else:
            result = _split_pieces(shape, split, degree, t)
        self._memo[key] = result
        return result

    # -- data parallelism (flat buffers) -------------------------------------
    def buffer_layout(self, name: str, stage: int, chunk: int = 0, expert_part: bool = False,
                      ep_rank: int = 0) -> BufferLayout:
        """The instance of buffer ``name`` on (``stage``, ``chunk``) for one tp rank.

        Args:
            name: the buffer.
            stage, chunk: the pipeline stage and virtual chunk.
            expert_part: the expert part (experts, ep > 1) instead of the dense part.
            ep_rank: for the expert part, the ep rank whose experts it holds.

        Returns:
            The instance's members (starts in elements) and buckets.
        """
        key = ("buffer", name, stage, chunk, expert_part, ep_rank)
        hit = self._memo.get(key)
        if hit is None:
            buf = self.tree.buffer(name)
            info = self._member_info(name)
            own = set(buf.own_bucket)
            entries = [(m, info[m][0], m in own and info[m][2])
                       for m in buf.members if m in info and (stage, chunk) in info[m][1]
                       and info[m][3] == expert_part and (not expert_part or info[m][4] == ep_rank)]
            group = self.config.edp if expert_part else self.config.dp * self.config.cp
            hit = self._memo[key] = layout_buffer(entries, group, buf.align, buf.pad_multiple,
                                                  buf.bucket_size(stage, chunk))
        return hit

    def buffer_ranges(self, name: str, stage: int) -> tuple[dict, tuple[tuple[int, int], ...]]:
        """``({key: (start, numel)}, ((bucket_start, padded_len), ...))`` of the dense part, chunk 0."""
        layout = self.buffer_layout(name, stage)
        return ({k: (s, n) for k, (s, n, _) in layout.members.items()},
                tuple((b.start, b.padded) for b in layout.buckets))

    def _member_info(self, name: str) -> dict:
        """``{key: (tp-local numel, places, on several stages, expert part, owner)}``."""
        key = ("members", name)
        hit = self._memo.get(key)
        if hit is None:
            hit = {}
            for _, leaf in self.tree.tensors():
                shard = leaf.layout.dp_shard
                if shard is not None and shard.buffer == name and shard.key not in hit:
                    places = self.places(leaf)
                    hit[shard.key] = (prod(self.tp_local(leaf, 0)[0]), places,
                                      len({s for s, _ in places}) > 1, self.expert_part(leaf),
                                      self.owner(leaf) if self.expert_part(leaf) else 0)
            self._memo[key] = hit
        return hit

    def _leaf_buffer(self, leaf: TensorLeaf, stage: int) -> BufferLayout:
        chunk = dict(self.places(leaf))[stage]
        part = self.expert_part(leaf)
        return self.buffer_layout(leaf.layout.dp_shard.buffer, stage, chunk, part,
                                  self.owner(leaf) if part else 0)

    def dp_range(self, leaf: TensorLeaf, d: int, stage: int) -> tuple[int, int] | None:
        """The flat range ``[lo, hi)`` of the tp-local shard that group index ``d`` holds on ``stage``.

        ``d`` is the rank's index in the dp-cp group, or in the expert-dp
        group for an expert part; ``None`` if it holds nothing of ``leaf``.
        """
        return self._leaf_buffer(leaf, stage).shard(leaf.layout.dp_shard.key, d)

    def flat_pieces(self, leaf: TensorLeaf, t: int, lo: int, hi: int) -> tuple[Piece, ...]:
        """Pieces of the flat range ``[lo, hi)`` of split rank ``t``'s local shard."""
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
    def _full_coord(self, coord: Coord) -> Coord:
        full = self._coords.get(coord)
        if full is None:
            full = self._coords[coord] = self.config.coord(self.config.rank(coord))
        return full

    def holding(self, path: str, coord: Coord) -> Holding | None:
        """What the rank at ``coord`` holds of tensor leaf ``path``, or ``None``.

        Only ``coord``'s dense fields are read; its expert fields are derived.
        """
        leaf = self.tree[path]
        c = self._full_coord(coord)
        if c.pp not in self.stages(leaf):
            return None
        owner = self.owner(leaf)
        if owner is not None and c.ep != owner:
            return None
        t = c.tp if owner is None else c.etp
        local_shape, dense = self.tp_local(leaf, t)
        if leaf.layout.dp_shard is None:
            return Holding(local_shape, dense)
        d = c.edp if self.expert_part(leaf) else self.config.dp_cp_rank(c)
        rng = self.dp_range(leaf, d, c.pp)
        if rng is None:
            return None
        return Holding((rng[1] - rng[0],), self.flat_pieces(leaf, t, *rng))

    def classes(self, path: str, tp_coord: int | None = None) -> tuple[HolderClass, ...]:
        """The holder classes of tensor leaf ``path``: replicas grouped, in rank order.

        Ranks whose holdings are equal are one class: every dp and cp rank
        (expert-dp rank for experts) unless dp-sharded, every stage of a
        multi-stage leaf unless dp-sharded, and every tp (etp) rank when the
        leaf is not split.

        Args:
            path: a tensor leaf.
            tp_coord: only the classes of this split rank (tp, or etp for
                experts) for a split leaf.
        """
        key = ("classes", path, tp_coord)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        leaf = self.tree[path]
        if self._ranks is None:
            self._ranks = RankTable(self.config)
        stages, owner = self.stages(leaf), self.owner(leaf)
        axis = (self.split_axis(leaf),) if leaf.layout.split is not None else ()
        ts = (tp_coord,) if axis and tp_coord is not None else range(self.degree(leaf)) \
            if axis else (None,)
        out = []
        if leaf.layout.dp_shard is None:
            groups = self._ranks.groups(stages, owner, axis)
            for t in ts:
                ranks = groups.get(() if t is None else (t,), ())
                if ranks:
                    out.append(HolderClass(Holding(*self.tp_local(leaf, t or 0)), ranks))
        else:
            d_axis = "edp" if self.expert_part(leaf) else "dpcp"
            groups = self._ranks.groups(stages, owner, axis + ("pp", d_axis))
            for s in stages:
                buffer = self._leaf_buffer(leaf, s)
                for d in buffer.holders(leaf.layout.dp_shard.key):
                    rng = buffer.shard(leaf.layout.dp_shard.key, d)
                    for t in ts if rng is not None else ():
                        ranks = groups.get((s, d) if t is None else (t, s, d), ())
                        if ranks:
                            held = Holding((rng[1] - rng[0],), self.flat_pieces(leaf, t or 0, *rng))
                            out.append(HolderClass(held, ranks))
        result = tuple(sorted(out, key=lambda c: c.ranks[0]))
        self._memo[key] = result
        return result

    def ranks_holding(self, path: str) -> tuple[int, ...]:
        """Every rank that holds some part of ``path``, ascending."""
        return tuple(sorted(r for c in self.classes(path) for r in c.ranks))


def _split_pieces(shape: tuple[int, ...], split, degree: int, t: int):
    """Local shape and pieces of split rank ``t`` of ``degree`` (each part cut in ``degree`` chunks)."""
    axis = split.axis
    parts = split.part_lengths(shape[axis])
    local_len = sum(p // degree for p in parts)
    local_shape = shape[:axis] + (local_len,) + shape[axis + 1:]
    pieces = []
    global_start = local_start = 0
    for length in parts:
        chunk = length // degree
        g = [0] * len(shape)
        sizes = list(shape)
        g[axis], sizes[axis] = global_start + t * chunk, chunk
        local = [0] * len(shape)
        local[axis] = local_start
        if chunk:
            pieces.append(Piece(Box(tuple(g), tuple(sizes)), 0, local_shape,
                                Box(tuple(local), tuple(sizes))))
        global_start += length
        local_start += chunk
    return local_shape, tuple(pieces)
