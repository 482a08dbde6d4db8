"""Every rank's coordinates as arrays, and the groups of ranks that hold the same thing.

Holder classes (replica groups) are ranks that agree on the coordinates a
leaf's holding depends on: its split coordinate (``tp`` or ``etp``), its
stage and, for a data-parallel-sharded leaf, its index in the sharding group
(``dpcp``: megatron's dp-cp group; ``edp``: the expert data-parallel group).
Groups are computed once per structure and shared by every leaf of that
structure, so their cost does not grow with the number of leaves.
"""

from __future__ import annotations

import numpy as np

from tenplex.ptree.config import COORD_AXES, ParallelConfig
from tenplex.ptree.grid import group_index

__all__ = ["RankTable"]


class RankTable:
    """Coordinate arrays (``[world]`` int64 each) of one config's ranks.

    Attributes:
        coord: ``{axis: array}`` for every :data:`COORD_AXES` axis, plus
            ``"dpcp"``: each rank's index in megatron's dp-cp group.
    """

    def __init__(self, config: ParallelConfig):
        ranks = np.arange(config.world_size, dtype=np.int64)
        sizes = config.sizes()
        self.coord = {axis: (ranks // config.stride(axis)) % sizes[axis] for axis in COORD_AXES}
        self.coord["dpcp"] = group_index(self.coord, ("cp", "dp"), config.grid_order, sizes)
        self._memo: dict = {}

    def groups(self, stages: tuple[int, ...], owner: int | None,
               keys: tuple[str, ...]) -> dict[tuple, tuple[int, ...]]:
        """Ranks on ``stages`` (and ep rank ``owner``), grouped by their ``keys`` coordinates.

        Args:
            stages: the pipeline stages that hold the leaf.
            owner: the ep rank that holds it (experts), or ``None``.
            keys: coordinate names, e.g. ``("tp",)`` or ``("etp", "pp", "edp")``.

        Returns:
            ``{key values: ranks ascending}``.
        """
        memo_key = (stages, owner, keys)
        hit = self._memo.get(memo_key)
        if hit is not None:
            return hit
        mask = np.isin(self.coord["pp"], stages)
        if owner is not None:
            mask &= self.coord["ep"] == owner
        members = np.nonzero(mask)[0]
        if not keys:
            hit = {(): tuple(members.tolist())}
        else:
            columns = [self.coord[k][members] for k in keys]
            combined = np.zeros(len(members), dtype=np.int64)
            for column in columns:
                combined = combined * (int(column.max(initial=0)) + 1) + column
            order = np.argsort(combined, kind="stable")
            cuts = np.nonzero(np.diff(combined[order]))[0] + 1
            hit = {}
            for part in np.split(order, cuts):
                if len(part):
                    key = tuple(int(c[part[0]]) for c in columns)
                    hit[key] = tuple(members[part].tolist())
        self._memo[memo_key] = hit
        return hit
