"""Place the new ranks on devices so that as many bytes as possible are already there.

Choosing which device each new rank runs on is an assignment problem: with
``W[d, s]`` the bytes target rank ``d`` needs that source rank ``s``
holds, putting ``d`` on ``s``'s device keeps ``W[d, s]`` bytes in place.
The maximum-weight matching is solved with SciPy's
``linear_sum_assignment`` (the Hungarian method). Ranks left over go to the
remaining free devices, in order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import intersect, volume
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.placement import Device, Placement

__all__ = ["bytes_in_common", "best_placement"]


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

    Args:
        tree: the tree spec.
        src, dst: the old and new configs.
        src_placement: where the old ranks run.
        devices: the devices the new ranks may use; default the old ranks'
            devices (plus ``new:i`` ones if the new world is larger).

    Returns:
        The placement; pass it to :func:`make_plan` as ``dst_placement``.

    Raises:
        ConfigError: fewer devices than new ranks.
    """
    pool = list(devices) if devices is not None else list(src_placement.devices)
    if devices is None and len(pool) < dst.world_size:
        pool += [Device("new", i) for i in range(dst.world_size - len(pool))]
    if len(pool) < dst.world_size:
        raise ConfigError(f"{dst} needs {dst.world_size} devices; {len(pool)} are available")
    weight = bytes_in_common(tree, src, dst)
    index = {d: i for i, d in enumerate(src_placement.devices)}
    columns = [index.get(d) for d in pool]
    matrix = np.zeros((dst.world_size, len(pool)), dtype=np.int64)
    for j, s in enumerate(columns):
        if s is not None:
            matrix[:, j] = weight[:, s]
    from scipy.optimize import linear_sum_assignment  # scipy (~0.5 s to import) only when placing

    rows, cols = linear_sum_assignment(matrix, maximize=True)
    chosen: list = [None] * dst.world_size
    for r, c in zip(rows.tolist(), cols.tolist()):
        chosen[r] = pool[c]
    return Placement(tuple(chosen))
