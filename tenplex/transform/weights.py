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
    ``shardings``: ``(Sharding(tree, src), Sharding(tree, dst))`` to reuse (and fill) their
    memos, e.g. a live change's, which its planner then reuses.
    """
    S, D = shardings_of(tree, src, dst, shardings)
    if alive is None:
        alive = np.r_[np.ones(src.world_size, dtype=bool), False]
    needed = 0
    summed: dict = {}  # (target ranks, source ranks as bytes, tiling) -> bytes
    covers: dict = {}
    kinds: dict = {}  # leaves of one kind (geometry.signature) share their terms, in elements
    symmetric: dict = {}  # split axis -> whether the live ranks are the same on every split rank
    for path, leaf in tree.tensors():
        key = signature(S, D, leaf)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = _kind_terms(S, D, path, leaf, alive, covers, symmetric)
        needed += kind[0] * leaf.itemsize
        for pair, n in kind[1].items():
            summed[pair] = summed.get(pair, 0) + n * leaf.itemsize
    return needed, _tile(summed)


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


def _tile(terms: dict) -> Terms:
    """The terms of :func:`_kind_terms` (summed over leaves) with their tilings carried out."""
    ones: dict = {}  # tiling -> ([target], [source], [bytes]) of its one-to-one terms
    many = []
    for (k, p, tiling), n in terms.items():
        ks, ps = np.frombuffer(k, dtype=np.int64), np.frombuffer(p, dtype=np.int64)
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
