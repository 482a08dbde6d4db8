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
from tenplex.transform.placement import Device, Placement
from tenplex.transform.weights import terms as _terms

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
    blocks = weight_blocks(tree, src, dst, alive)[1]
    for block, (rows, cols) in zip(blocks, _matchings(blocks)):
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
                  alive: np.ndarray | None = None, shardings=None) -> tuple[int, list[Block]]:
    """``(needed, blocks)``: the bytes the targets need, and ``W`` as its connected components.

    ``W[t, s]`` (:func:`bytes_in_common`, live sources only) is zero outside the blocks.
    It is summed from block terms (:func:`~tenplex.transform.weights.terms`) and never made whole: the components
    are found on a graph with one star per term (a few edges per rank), and each block is
    filled from its own terms, the one-target, one-source terms (a dp-sharded optimizer's
    overlaps, most of the terms) all at once. ``shardings``: as
    :func:`~tenplex.transform.weights.terms`.
    """
    from scipy.sparse import coo_matrix, csgraph

    needed, terms = _terms(tree, src, dst, alive, shardings)
    n_t, n_s = dst.world_size, src.world_size
    if not terms.many and not len(terms.one_t):
        return needed, []
    heads, tails = [terms.one_t], [terms.one_s + n_t]
    for k, p, _ in terms.many:  # a star over the term's ranks: targets 0..n_t-1, sources n_t..
        nodes = np.concatenate([k, p + n_t])
        heads.append(np.full(len(nodes) - 1, nodes[0]))
        tails.append(nodes[1:])
    head, tail = np.concatenate(heads), np.concatenate(tails)
    graph = coo_matrix((np.ones(len(head), dtype=np.int8), (head, tail)), shape=(n_t + n_s,) * 2)
    _, label = csgraph.connected_components(graph, directed=False)
    firsts = np.array([k[0] for k, _, _ in terms.many], dtype=np.int64)
    used = np.unique(np.concatenate([label[terms.one_t], label[firsts]]))
    members = _members(label, n_t, used)
    blocks = [Block(targets, sources, np.zeros((len(targets), len(sources)), dtype=np.int64))
              for targets, sources in members]
    at = np.full(label.max() + 1, -1, dtype=np.int64)
    at[used] = np.arange(len(used))
    pos = np.zeros(n_t + n_s, dtype=np.int64)  # each rank's row (target) or column (source)
    for targets, sources in members:
        pos[targets] = np.arange(len(targets))
        pos[sources + n_t] = np.arange(len(sources))
    for k, p, n in terms.many:
        blocks[at[label[k[0]]]].weight[np.ix_(pos[k], pos[p + n_t])] += n
    which = at[label[terms.one_t]]
    order = np.argsort(which, kind="stable")
    cuts = np.searchsorted(which[order], np.arange(len(blocks) + 1))
    for b, block in enumerate(blocks):
        sel = order[cuts[b]:cuts[b + 1]]
        np.add.at(block.weight, (pos[terms.one_t[sel]], pos[terms.one_s[sel] + n_t]),
                  terms.one_n[sel])
    return needed, blocks


def _members(label: np.ndarray, n_t: int, used: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per component in ``used`` (ascending labels), its target and source ranks, ascending."""
    out = []
    for side, offset in ((label[:n_t], 0), (label[n_t:], 0)):
        order = np.argsort(side, kind="stable")
        cuts = np.searchsorted(side[order], np.stack([used, used + 1]))
        out.append([order[a:b] + offset for a, b in zip(cuts[0].tolist(), cuts[1].tolist())])
    return list(zip(out[0], out[1]))


def _assign(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The maximum-weight matching of one dense block: ``(rows, columns)`` (the Hungarian method)."""
    from scipy.optimize import linear_sum_assignment  # scipy (~0.5 s to import) only when placing

    return linear_sum_assignment(block, maximize=True)


def _matchings(blocks: list[Block]) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`_assign` of each block; a block equal to an earlier one reuses its matching.

    Equal blocks are common (every pipeline stage with the same layers gives the same block),
    and the Hungarian method is a function of the matrix, so this changes no result: the
    14 middle stages of Llama-3.1-405B at pp 16 are solved once.
    """
    seen: dict = {}
    out = []
    for block in blocks:
        w = block.weight
        key = (w.shape, w.sum(axis=1).tobytes())  # cheap; equality is checked below
        hit = seen.get(key)
        if hit is None or not np.array_equal(hit[0], w):
            hit = seen[key] = (w, _assign(w))
        out.append(hit[1])
    return out


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
    rows, cols, data = [terms.one_t], [terms.one_s], [terms.one_n]
    for k, p, n in terms.many:
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


def best_numbering(tree: PTree, src: ParallelConfig, dst: ParallelConfig,
                   src_of: Sequence[int | None], alive: Sequence[int],
                   given: Sequence[int | None] | None = None, shardings=None) -> tuple[list, int]:
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
        shardings: ``(Sharding(tree, src), Sharding(tree, dst))`` to reuse and fill (a live
            change's, which its planner reuses); default new ones.

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
    needed, blocks = weight_blocks(tree, src, dst, live, shardings)
    chosen = np.full(dst.world_size, -1, dtype=np.int64)
    best = 0
    for block, (rows, cols) in zip(blocks, _matchings(blocks)):
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
    pairs = [(old, new) for old, new in zip(src_of, dst_of) if old is not None and new is not None]
    if not pairs or not blocks:
        return 0
    old, new = (np.array(x, dtype=np.int64) for x in zip(*pairs))
    n_t = max(int(new.max()), max(int(b.targets[-1]) for b in blocks)) + 1
    n_s = len(live)
    row, col = np.full((2, n_t), -1, dtype=np.int64), np.full((2, n_s), -1, dtype=np.int64)
    for b, block in enumerate(blocks):  # each target and live source is in one block at most
        row[0, block.targets], row[1, block.targets] = b, np.arange(len(block.targets))
        col[0, block.sources], col[1, block.sources] = b, np.arange(len(block.sources))
    keep = live[old] & (row[0, new] >= 0) & (row[0, new] == col[0, old])
    old, new = old[keep], new[keep]
    return sum(int(block.weight[row[1, new[row[0, new] == b]], col[1, old[row[0, new] == b]]].sum())
               for b, block in enumerate(blocks))
