"""Place the new ranks on devices so that as many bytes as possible are already there.

Choosing which device each new rank runs on is an assignment problem: with
``W[t, s]`` the bytes target rank ``t`` needs that source rank ``s``
holds, putting ``t`` on ``s``'s device keeps ``W[t, s]`` bytes in place.

At scale ``W`` is never dense (:func:`sparse_weights`): ranks fall into
holder classes (replicas), and each leaf adds one block per (target class,
live source pool) pair that shares bytes, the same for every layer of a
stage. :func:`best_placement` then solves the maximum-weight matching on
the connected components of ``W``'s nonzero pattern, one dense Hungarian
method (SciPy's ``linear_sum_assignment``) per component: a target and a
device of different components share no byte, so pairing them keeps
nothing, and the optimum is the sum of the components' optima. Changing dp
at fixed tp and pp makes one component per (tp, pp) slice (128 targets x 64
devices for Llama-3.1-405B at 16384 ranks). Ranks left over go to the
remaining free devices, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import intersect, volume
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.geometry import LeafGeometry, signature
from tenplex.transform.placement import Device, Placement

__all__ = ["bytes_in_common", "best_placement", "placement_bound", "sparse_weights",
           "weight_blocks", "Block", "best_numbering", "import_solvers"]


def import_solvers() -> None:
    """Import the scipy solvers that placement and renumbering use (``scipy.optimize``,
    ``scipy.sparse.csgraph``): 0.3 to 0.5 s the first time on 2 cores. A live job calls it at
    start so that its first renumbered change does not pay it (``Membership`` does)."""
    import scipy.optimize  # noqa: F401
    import scipy.sparse.csgraph  # noqa: F401


def bytes_in_common(tree: PTree, src: ParallelConfig, dst: ParallelConfig) -> np.ndarray:
    """``W[d, s]``: bytes of target rank ``d``'s shards that source rank ``s`` holds (int64).

    Computed per holder class and spread over the classes' ranks, so its cost
    is leaves x classes, not leaves x ranks.
    """
    S, D = Sharding(tree, src), Sharding(tree, dst)
    weight = np.zeros((dst.world_size, src.world_size), dtype=np.int64)
    for path, leaf in tree.tensors():
        for dst_holders in D.classes(path):
            for src_holders in S.classes(path):
                n = 0
                for dst_piece in dst_holders.holding.pieces:
                    for src_piece in src_holders.holding.pieces:
                        inter = intersect(dst_piece.box, src_piece.box)
                        if inter is not None:
                            n += volume(inter)
                if n:
                    weight[np.ix_(dst_holders.ranks, src_holders.ranks)] += n * leaf.itemsize
    return weight


def best_placement(tree: PTree, src: ParallelConfig, dst: ParallelConfig, src_placement: Placement,
                   devices: Sequence[Device] | None = None) -> Placement:
    """A placement of ``dst``'s ranks that maximizes the bytes already on their devices.

    Optimal: it keeps as many bytes in place as the Hungarian method on the dense ``W``
    (property-tested), at a cost that follows ``W``'s components (:func:`weight_blocks`):
    Llama-3.1-405B at 16384 ranks is placed in seconds (``bench/plan_scale.py``).

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        src_placement: where the old ranks run.
        devices: the devices the new ranks may use: any subset of the old ranks' devices
            (the survivors; an old rank whose device is not given holds nothing usable), with or
            without new ones; default the old ranks' devices (plus ``new:i`` ones if the new
            world is larger).

    Returns:
        The placement; pass it to :func:`make_plan` as ``dst_placement``.

    Raises:
        ConfigError: fewer devices than new ranks, or a device given twice.
    """
    pool = list(devices) if devices is not None else list(src_placement.devices)
    if devices is None and len(pool) < dst.world_size:
        pool += [Device("new", i) for i in range(dst.world_size - len(pool))]
    if len(pool) < dst.world_size:
        raise ConfigError(f"{dst} needs {dst.world_size} devices; {len(pool)} are available")
    if len(set(pool)) != len(pool):
        raise ConfigError("best_placement: a device is given twice")
    index = {d: i for i, d in enumerate(src_placement.devices)}
    device_of = np.full(src.world_size, -1, dtype=np.int64)  # source rank -> pool index
    for j, d in enumerate(pool):
        if d in index:
            device_of[index[d]] = j
    alive = np.r_[device_of >= 0, False]
    chosen = np.full(dst.world_size, -1, dtype=np.int64)
    for block in weight_blocks(tree, src, dst, alive)[1]:
        rows, cols = _assign(block.weight)
        chosen[block.targets[rows]] = device_of[block.sources[cols]]
    free = np.setdiff1d(np.arange(len(pool)), chosen[chosen >= 0])
    left = np.nonzero(chosen < 0)[0]
    chosen[left] = free[: len(left)]
    return Placement(tuple(pool[j] for j in chosen.tolist()))


@dataclass(frozen=True, eq=False)
class Block:
    """One connected component of ``W``'s nonzero pattern, dense.

    Attributes:
        targets: ``[m]`` int64 target ranks, ascending.
        sources: ``[n]`` int64 live source ranks, ascending.
        weight: ``[m, n]`` int64, ``W[targets, sources]`` in bytes.
    """

    targets: np.ndarray
    sources: np.ndarray
    weight: np.ndarray


def weight_blocks(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                  alive: np.ndarray | None = None) -> tuple[int, list[Block]]:
    """``(needed, blocks)``: the bytes the targets need, and ``W`` as its connected components.

    ``W[t, s]`` (:func:`bytes_in_common`, live sources only) is zero outside the blocks.
    It is summed from block terms (:func:`_terms`) and never made whole: the components
    are found on a graph with one star per term (a few edges per rank), and each block is
    filled from its own terms.
    """
    from scipy.sparse import coo_matrix, csgraph

    needed, terms = _terms(tree, src, dst, alive)
    n_t, n_s = dst.world_size, src.world_size
    if not terms:
        return needed, []
    heads, tails = [], []
    for k, p, _ in terms:  # a star over the term's ranks: targets 0..n_t-1, sources n_t..
        nodes = np.concatenate([k, p + n_t])
        heads.append(np.full(len(nodes) - 1, nodes[0]))
        tails.append(nodes[1:])
    head, tail = np.concatenate(heads), np.concatenate(tails)
    graph = coo_matrix((np.ones(len(head), dtype=np.int8), (head, tail)), shape=(n_t + n_s,) * 2)
    _, label = csgraph.connected_components(graph, directed=False)
    by_component: dict = {}
    for k, p, n in terms:
        by_component.setdefault(int(label[k[0]]), []).append((k, p, n))
    blocks = []
    for c in sorted(by_component):
        targets = np.nonzero(label[:n_t] == c)[0]
        sources = np.nonzero(label[n_t:] == c)[0]
        weight = np.zeros((len(targets), len(sources)), dtype=np.int64)
        for k, p, n in by_component[c]:
            weight[np.ix_(np.searchsorted(targets, k), np.searchsorted(sources, p))] += n
        blocks.append(Block(targets, sources, weight))
    return needed, blocks


def _assign(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The maximum-weight matching of one dense block: ``(rows, columns)`` (the Hungarian method)."""
    from scipy.optimize import linear_sum_assignment  # scipy (~0.5 s to import) only when placing

    return linear_sum_assignment(block, maximize=True)


def _terms(tree: PTree, src: ParallelConfig, dst: ParallelConfig, alive: np.ndarray | None):
    """``(needed, [(target ranks, source ranks, bytes)])``: ``W`` as a sum of constant blocks.

    Per leaf, every (target holder class, live source pool) pair that shares bytes is one
    block term; terms with the same ranks are merged across leaves (all layers of a stage
    share them), so the cost is kinds of leaves x classes. Rank arrays are int64, ascending.
    """
    S, D = Sharding(tree, src), Sharding(tree, dst)
    if alive is None:
        alive = np.r_[np.ones(src.world_size, dtype=bool), False]
    needed = 0
    terms: dict = {}
    covers: dict = {}
    kinds: dict = {}  # leaves of one kind (geometry.signature) share their terms, in elements
    for path, leaf in tree.tensors():
        key = signature(S, D, leaf)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = _leaf_terms(LeafGeometry(S, D, path, alive, covers))
        needed += kind[0] * leaf.itemsize
        for pair, n in kind[1].items():
            terms[pair] = terms.get(pair, 0) + n * leaf.itemsize
    return needed, [(np.frombuffer(k, dtype=np.int64), np.frombuffer(p, dtype=np.int64), n)
                    for (k, p), n in terms.items()]


def sparse_weights(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                   alive: np.ndarray | None = None):
    """``(needed, W)``: the bytes the targets need (FILL excluded), and ``W`` as a sparse matrix.

    ``W`` (``[dst world, src world]``, int64 bytes, SciPy CSR) is what :func:`bytes_in_common`
    gives, restricted to the live sources, summed from the block terms. For inspection and
    tests; placing and bounding use :func:`weight_blocks`.

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        alive: ``[src world + 1]`` bool, the live source ranks (last entry False); default all.
    """
    from scipy import sparse

    needed, terms = _terms(tree, src, dst, alive)
    rows, cols, data = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for k, p, n in terms:
        rows.append(np.repeat(k, len(p)))
        cols.append(np.tile(p, len(k)))
        data.append(np.full(len(k) * len(p), n, dtype=np.int64))
    w = sparse.coo_matrix((np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(dst.world_size, src.world_size)).tocsr()
    w.sum_duplicates()
    return needed, w


def placement_bound(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                    alive: np.ndarray | None = None) -> int:
    """Bytes that no placement of ``dst``'s ranks on ``src``'s devices can avoid moving.

    The rule: ``Σ need − min(Σ_t max_s W[t, s], Σ_s max_t W[t, s])``, with
    ``W`` from :func:`weight_blocks` (live sources only). A placement puts
    each target on at most one source's device and each device hosts at most
    one target, so the bytes it keeps are the weight of a matching in ``W``,
    which is at most the sum of the row maxima and at most the sum of the
    column maxima.

    Why both sums: the per-target rule alone, ``Σ_t (need_t − max_s W[t, s])``
    (row maxima only), is 0 when growing dp (8192 -> 16384 ranks of
    Llama-3.1-405B): every new rank finds all it needs on one old device, but
    two new ranks cannot share that device. The column maxima count that
    (each old device keeps bytes for one new rank), and the bound stays
    placement-free and valid. Shrinking is bound by the row maxima.

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        alive: ``[src world + 1]`` bool, the live source ranks (last entry
            False); default all.

    Returns:
        The bound, in bytes.
    """
    needed, blocks = weight_blocks(tree, src, dst, alive)
    by_target = sum(int(b.weight.max(axis=1).sum()) for b in blocks)
    by_source = sum(int(b.weight.max(axis=0).sum()) for b in blocks)
    return needed - min(by_target, by_source)


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


def best_numbering(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                   src_of: Sequence[int | None], alive: Sequence[int],
                   given: Sequence[int | None] | None = None) -> tuple[list, int]:
    """The new rank of each process that keeps the most bytes in place, and the placement bound.

    A live change's processes are its devices: process ``p`` holds old rank ``src_of[p]``
    (``None``: it joins empty). Each new rank goes to the process that :func:`best_placement`'s
    matching gives it (per component of ``W``, the Hungarian method); the rest go to the
    free processes in order. A ``given`` numbering that keeps as many bytes in place is
    returned as it is (the optimum is often not unique: no process is renumbered for
    nothing). Every process computes the same numbering from the same inputs.

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        src_of: per process, the old rank it holds, or ``None``.
        alive: the old ranks that can serve data.
        given: per process, the new rank it would hold without renumbering (or ``None``).

    Returns:
        ``(dst_of, bound)``: per process its new rank or ``None``, and the placement-free bound
        (:func:`placement_bound`) in bytes.

    Raises:
        ConfigError: fewer processes than new ranks.
    """
    if len(src_of) < dst.world_size:
        raise ConfigError(f"{dst} needs {dst.world_size} processes; the group has {len(src_of)}")
    process_of = np.full(src.world_size, -1, dtype=np.int64)
    for p, r in enumerate(src_of):
        if r is not None:
            process_of[r] = p
    live = np.zeros(src.world_size + 1, dtype=bool)
    live[[r for r in alive if process_of[r] >= 0]] = True
    needed, blocks = weight_blocks(tree, src, dst, live)
    chosen = np.full(dst.world_size, -1, dtype=np.int64)
    best = 0
    for block in blocks:
        rows, cols = _assign(block.weight)
        chosen[block.targets[rows]] = process_of[block.sources[cols]]
        best += int(block.weight[rows, cols].sum())
    by_target = sum(int(b.weight.max(axis=1).sum()) for b in blocks)
    by_source = sum(int(b.weight.max(axis=0).sum()) for b in blocks)
    bound = needed - min(by_target, by_source)
    if given is not None and _kept(blocks, src_of, given, live) >= best:
        return list(given), bound
    free = np.setdiff1d(np.arange(len(src_of)), chosen[chosen >= 0])
    left = np.nonzero(chosen < 0)[0]
    chosen[left] = free[: len(left)]
    dst_of: list = [None] * len(src_of)
    for t, p in enumerate(chosen.tolist()):
        dst_of[p] = t
    return dst_of, bound


def _kept(blocks: list, src_of: Sequence[int | None], dst_of: Sequence[int | None],
          live: np.ndarray) -> int:
    """Bytes kept in place when process ``p`` goes from old rank ``src_of[p]`` to ``dst_of[p]``."""
    where = {}
    for b, block in enumerate(blocks):
        cols = {int(s): j for j, s in enumerate(block.sources.tolist())}
        for i, t in enumerate(block.targets.tolist()):
            where[t] = (b, i, cols)
    kept = 0
    for old, new in zip(src_of, dst_of):
        if old is None or new is None or not live[old] or new not in where:
            continue
        b, i, cols = where[new]
        if old in cols:
            kept += int(blocks[b].weight[i, cols[old]])
    return kept
