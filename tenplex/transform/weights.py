"""``W`` (bytes each target rank needs that each source rank holds) as a sum of constant blocks.

Ranks fall into holder classes (replicas); per leaf, each (target holder class, live source
pool) pair that shares bytes adds one constant block to ``W``. :func:`terms` lists those
blocks, merged across leaves, at a cost of kinds of leaves x classes, never ranks x ranks;
:mod:`tenplex.transform.assign` places ranks and numbers processes from them.
:func:`first_uncovered` checks on the same classes that the live ranks hold every byte
the targets need, without planning (recovery chooses a step with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.ranks import RankTable
from tenplex.ptree.region import intersect, subtract, volume
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.geometry import LeafGeometry, signature, tp_symmetric

__all__ = ["Terms", "terms", "first_uncovered"]


@dataclass(frozen=True, eq=False)
class Terms:
    """``W`` as a sum of constant blocks: ``W[k, p] += n`` for every term.

    Attributes:
        one_t, one_s, one_n: ``[m]`` int64: the one-target, one-source terms (target rank,
            source rank, bytes); a pair may repeat (they add up).
        many: the other terms, ``[(target ranks, source ranks, bytes)]``, ranks int64 ascending.
    """

    one_t: np.ndarray
    one_s: np.ndarray
    one_n: np.ndarray
    many: list


def terms(tree: PTree, src: ParallelConfig, dst: ParallelConfig, alive: np.ndarray | None,
          shardings: tuple[Sharding, Sharding] | None = None):
    """``(needed, terms)``: the bytes the targets need, and ``W`` as a sum of constant blocks.

    Per leaf, every (target holder class, live source pool) pair that shares bytes is one
    block term; terms with the same ranks are merged across leaves (all layers of a stage
    share them), so the cost is kinds of leaves x classes. A leaf split the same way on both
    sides (:func:`~tenplex.transform.geometry.tp_symmetric`, with live ranks symmetric too)
    is worked out for split rank 0 only, as the planner's templates are: its terms are
    merged at split rank 0 and tiled over the other split ranks at the end, as arrays.
    A leaf that is another stage's leaf moved by whole stages (:class:`_StageShift`) shares
    that leaf's kind: its terms are kept relative to stage 0 and moved to its stage at the end.
    ``shardings``: ``(Sharding(tree, src), Sharding(tree, dst))`` to reuse (and fill) their
    memos, e.g. a live change's, which its planner then reuses.
    """
    S, D = shardings_of(tree, src, dst, shardings)
    if alive is None:
        alive = np.r_[np.ones(src.world_size, dtype=bool), False]
    needed = 0
    summed: dict = {}  # (target ranks, source ranks as bytes (stage-relative), tiling, stage) -> bytes
    covers: dict = {}
    kinds: dict = {}  # leaves of one kind share their terms, in elements, ranks stage-relative
    symmetric: dict = {}  # split axis -> whether the live ranks are the same on every split rank
    stages = _StageShift(S, D, alive)
    for path, leaf in tree.tensors():
        key, stage = stages.key(leaf)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = stages.relative(
                _kind_terms(S, D, path, leaf, alive, covers, symmetric), stage)
        needed += kind[0] * leaf.itemsize
        for (k, p, tiling), n in kind[1].items():
            pair = (k, p, tiling, stage)
            summed[pair] = summed.get(pair, 0) + n * leaf.itemsize
    return needed, _tile(summed, stages.strides)


def shardings_of(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                 shardings: tuple[Sharding, Sharding] | None) -> tuple[Sharding, Sharding]:
    """``shardings`` if given (checked to be ``tree``'s under ``src`` and ``dst``), else new ones.

    Raises:
        ConfigError: a given sharding is of another tree or config.
    """
    if shardings is None:
        return Sharding(tree, src), Sharding(tree, dst)
    for sharding, config, side in zip(shardings, (src, dst), ("source", "target")):
        if sharding.tree is not tree or sharding.config != config:
            raise ConfigError(f"the {side} sharding is of {sharding.config}, expected {config} "
                              "(and the same tree)")
    return shardings


def _kind_terms(S: Sharding, D: Sharding, path: str, leaf, alive: np.ndarray, covers: dict,
                symmetric: dict) -> tuple[int, dict]:
    """``(elements needed, {(target ranks, source ranks as bytes, tiling): elements})`` of one
    kind of leaf, worked out for split rank 0 only where that is exact.

    The tiling is ``(degree, target stride, source stride)``: the term stands for ``degree``
    terms, the ``t``-th with its ranks moved by ``t`` strides; ``(1, 0, 0)`` for itself.
    """
    tiling = _tiling(S, D, leaf, alive, symmetric)
    if tiling is None:
        needed, terms = _leaf_terms(LeafGeometry(S, D, path, alive, covers))
        return needed, {(k, p, (1, 0, 0)): n for (k, p), n in terms.items()}
    needed, terms = _leaf_terms(LeafGeometry(S, D, path, alive, covers, tp_coord=0))
    return needed * tiling[0], {(k, p, tiling): n for (k, p), n in terms.items()}


def _tiling(S: Sharding, D: Sharding, leaf, alive: np.ndarray, symmetric: dict):
    """``(degree, target stride, source stride)`` if split rank ``t``'s picture of ``leaf``,
    live ranks included, is split rank 0's moved by ``t`` strides; else ``None``.

    ``symmetric`` memoizes, per split axis, whether the live ranks are symmetric.
    """
    if not tp_symmetric(S, D, leaf):
        return None
    axis, degree = S.split_axis(leaf), S.degree(leaf)
    if axis not in symmetric:
        symmetric[axis] = _alive_symmetric(S.config, axis, alive)
    return (degree, D.config.stride(axis), S.config.stride(axis)) if symmetric[axis] else None


def first_uncovered(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                    alive: np.ndarray, shardings: tuple[Sharding, Sharding] | None = None) -> str | None:
    """The first tensor leaf (tree order) with a region some target rank needs (FILL excluded)
    that no live source rank holds, or ``None``: every byte can come from a live rank.

    The planner's :class:`~tenplex.errors.MissingDataError` (or its STORE reads, with
    ``store_fallback``) comes exactly where this finds a leaf, but nothing is planned: the
    check runs per kind of leaf and target holder class (split rank 0 alone where the
    picture is tiled), and stops at the first hole.

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        alive: ``[src world + 1]`` bool, the live source ranks (last entry False).
        shardings: as :func:`terms`.
    """
    S, D = shardings_of(tree, src, dst, shardings)
    kinds: dict = {}
    symmetric: dict = {}
    for path, leaf in tree.tensors():
        key = signature(S, D, leaf)
        whole = kinds.get(key)
        if whole is None:
            tp_coord = None if _tiling(S, D, leaf, alive, symmetric) is None else 0
            whole = kinds[key] = _covered(LeafGeometry(S, D, path, alive, None, tp_coord))
        if not whole:
            return path
    return None


def _covered(g: LeafGeometry) -> bool:
    """Whether the live pools of ``g`` hold every box its target classes need."""
    for _, boxes in g.dst_classes:
        for box in boxes:
            inside = intersect(box, g.extent)
            if inside is None or not volume(inside):
                continue
            remaining = [inside]
            for c in g.index.overlapping(inside):
                rest = []
                for part in remaining:
                    inter = intersect(part, c.box)
                    rest.extend((part,) if inter is None else subtract(part, inter))
                remaining = rest
                if not remaining:
                    break
            if any(volume(b) for b in remaining):
                return False
    return True


def _tile(terms: dict, strides: tuple[int, int]) -> Terms:
    """The terms of :func:`_kind_terms` (summed over leaves) moved to their stages (``strides``:
    the target's and the source's pp strides) and with their tilings carried out."""
    ones: dict = {}  # tiling -> ([target], [source], [bytes]) of its one-to-one terms
    many = []
    for (k, p, tiling, stage), n in terms.items():
        ks = np.frombuffer(k, dtype=np.int64) + stage * strides[0]
        ps = np.frombuffer(p, dtype=np.int64) + stage * strides[1]
        if len(ks) == 1 and len(ps) == 1:
            one = ones.setdefault(tiling, ([], [], []))
            one[0].append(ks[0])
            one[1].append(ps[0])
            one[2].append(n)
            continue
        degree, dst_stride, src_stride = tiling
        many.extend((ks + t * dst_stride, ps + t * src_stride, n) for t in range(degree))
    out = [[np.zeros(0, np.int64)] for _ in range(3)]
    for (degree, dst_stride, src_stride), (ts, ss, ns) in ones.items():
        shift = np.arange(degree, dtype=np.int64)[:, None]
        out[0].append((np.array(ts, dtype=np.int64)[None, :] + shift * dst_stride).ravel())
        out[1].append((np.array(ss, dtype=np.int64)[None, :] + shift * src_stride).ravel())
        out[2].append(np.tile(np.array(ns, dtype=np.int64), degree))
    return Terms(*(np.concatenate(x) for x in out), many)


def _alive_symmetric(config: ParallelConfig, axis: str, alive: np.ndarray) -> bool:
    """Whether source rank ``r`` is live exactly when the rank at split coordinate 0 beside it is."""
    live = alive[:-1]
    if live.all():
        return True
    coord = RankTable(config).coord[axis]
    base = np.arange(config.world_size) - coord * config.stride(axis)
    return bool(np.array_equal(live, live[base]))


def _leaf_terms(g) -> tuple[int, dict]:
    """``(elements needed, {(target class ranks, pool ranks) as bytes: elements held})`` of a leaf."""
    needed = 0
    terms: dict = {}
    for ranks, boxes in g.dst_classes:
        held: dict = {}
        for box in boxes:
            inside = intersect(box, g.extent)
            if inside is None:
                continue
            needed += volume(inside) * len(ranks)
            for c in g.index.overlapping(inside):
                inter = intersect(inside, c.box)
                if inter is not None:
                    held[c.pool] = held.get(c.pool, 0) + volume(inter)
        for pool, n in held.items():
            key = (ranks.tobytes(), g.pools[pool].tobytes())
            terms[key] = terms.get(key, 0) + n
    return needed, terms


class _StageShift:
    """Leaves on different pipeline stages that are one picture moved by whole stages.

    A leaf on one (stage, virtual chunk), the same on both sides, whose
    shapes, split, owners and place in its stage's flat buffer (the buffer
    instances' members and buckets, on both sides) equal another's on another
    stage, where the live source ranks of both stages agree rank for rank, holds
    what that one holds with every rank moved by the stage difference times
    the pp stride (``rank = ... + pp * stride("pp")`` on each side). Such leaves
    share one kind, whose terms are kept relative to stage 0 (Llama-3.1-405B
    at pp 16: the 14 middle stages' layers are worked out once, not 14 times).
    Any other leaf is its own stage-0 kind (:func:`~tenplex.transform.geometry.signature`).
    """

    def __init__(self, S: Sharding, D: Sharding, alive: np.ndarray):
        self.S, self.D = S, D
        same = S.config.pp == D.config.pp and S.config.vpp == D.config.vpp
        self.strides = (D.config.stride("pp"), S.config.stride("pp")) if same else (0, 0)
        self._alive = self._alive_classes(S.config, alive) if same else None
        self._layouts: dict = {}

    @staticmethod
    def _alive_classes(config: ParallelConfig, alive: np.ndarray) -> list[int]:
        """Per stage, a number equal for stages whose live ranks agree rank for rank."""
        live = alive[:-1]
        pp = RankTable(config).coord["pp"]
        seen: dict = {}
        return [seen.setdefault(live[pp == s].tobytes(), len(seen)) for s in range(config.pp)]

    def key(self, leaf) -> tuple[tuple, int]:
        """``(kind key, stage)``: the stage the kind's terms are moved to (0 for a leaf of its own)."""
        places = self.S.places(leaf)
        if self._alive is None or len(places) != 1 or self.D.places(leaf) != places:
            return ("own", signature(self.S, self.D, leaf)), 0
        (stage, chunk), = places
        shape = (self.S.physical_shape(leaf), self.D.physical_shape(leaf), leaf.layout.split,
                 leaf.layout.expert is not None, self.S.degree(leaf), self.D.degree(leaf),
                 self.S.owner(leaf), self.D.owner(leaf), chunk, self._alive[stage])
        if leaf.layout.dp_shard is None:
            return ("moved", shape, None), stage
        return ("moved", shape, self._member(self.S, leaf, stage, chunk),
                self._member(self.D, leaf, stage, chunk)), stage

    def _member(self, sharding: Sharding, leaf, stage: int, chunk: int) -> tuple:
        """The leaf's place in its flat buffer instance, with the instance's layout, stage-free."""
        part = sharding.expert_part(leaf)
        name = leaf.layout.dp_shard.buffer
        layout = sharding.buffer_layout(name, stage, chunk, part, sharding.owner(leaf) if part else 0)
        hit = self._layouts.get(id(layout))
        if hit is None:
            members = tuple(layout.members.values())
            order = {k: i for i, k in enumerate(layout.members)}
            shape = (name, members, layout.buckets, layout.group_size)
            hit = self._layouts[id(layout)] = (layout, shape, order)  # the layout: its id stays taken
        return hit[1], hit[2][leaf.layout.dp_shard.key]

    def relative(self, kind: tuple[int, dict], stage: int) -> tuple[int, dict]:
        """A kind's terms with their ranks moved from ``stage`` to stage 0."""
        if not stage:
            return kind
        dk, dp = stage * self.strides[0], stage * self.strides[1]
        return kind[0], {((np.frombuffer(k, dtype=np.int64) - dk).tobytes(),
                          (np.frombuffer(p, dtype=np.int64) - dp).tobytes(), tiling): n
                         for (k, p, tiling), n in kind[1].items()}
