"""Every rank's coordinates as arrays, and the groups of ranks that hold the same thing.

Holder classes (replica groups) are ranks that agree on the coordinates a
leaf's holding depends on: its split coordinate (``tp`` or ``etp``), its
stage and, for a data-parallel-sharded leaf, its index in the sharding group
(``dpcp``: megatron's dp-cp group; ``edp``: the expert data-parallel group).
Groups are computed once per structure and shared by every leaf of that
structure, so their cost does not grow with the number of leaves.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tenplex.ptree.config import COORD_AXES, ParallelConfig
from tenplex.ptree.grid import group_index

__all__ = ["RankTable", "Groups"]


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
               keys: tuple[str, ...]) -> "Groups":
        """Ranks on ``stages`` (and ep rank ``owner``), grouped by their ``keys`` coordinates.

        Args:
            stages: the pipeline stages that hold the leaf.
            owner: the ep rank that holds it (experts), or ``None``.
            keys: coordinate names, e.g. ``("tp",)`` or ``("etp", "pp", "edp")``.

        Returns:
            A read-only mapping ``{key values: ranks ascending}`` (:class:`Groups`); a group's
            tuple is built when first asked for (at 16384 ranks a dp-sharded leaf's stage has
            1024 groups, of which a picture of split rank 0 asks for 128).
        """
        memo_key = (stages, owner, keys)
        hit = self._memo.get(memo_key)
        if hit is None:
            mask = np.isin(self.coord["pp"], stages)
            if owner is not None:
                mask &= self.coord["ep"] == owner
            members = np.nonzero(mask)[0]
            hit = self._memo[memo_key] = Groups(members, [self.coord[k][members] for k in keys])
        return hit


class Groups(Mapping):
    """``{key values: ranks ascending}`` of :meth:`RankTable.groups`, each group built on demand.

    Args:
        members: ``[m]`` int64, the ranks grouped (ascending).
        columns: per key, ``[m]`` int64: each member's coordinate.
    """

    def __init__(self, members: np.ndarray, columns: list[np.ndarray]):
        self._members = members
        self._sizes = [int(c.max(initial=0)) + 1 for c in columns]
        combined = np.zeros(len(members), dtype=np.int64)
        for column, size in zip(columns, self._sizes):
            combined = combined * size + column
        self._order = np.argsort(combined, kind="stable")  # members of a group stay ascending
        codes = combined[self._order]
        cuts = np.flatnonzero(np.diff(codes)) + 1
        self._starts = np.r_[0, cuts].astype(np.int64) if len(codes) else np.zeros(0, np.int64)
        self._ends = np.r_[cuts, len(codes)].astype(np.int64) if len(codes) else np.zeros(0, np.int64)
        self._codes = codes[self._starts]
        self._columns = columns
        self._built: dict = {}

    def _code(self, key) -> int | None:
        if not isinstance(key, tuple) or len(key) != len(self._sizes):
            return None
        code = 0
        for value, size in zip(key, self._sizes):
            if not isinstance(value, (int, np.integer)) or not 0 <= value < size:
                return None
            code = code * size + int(value)
        return code

    def __getitem__(self, key) -> tuple[int, ...]:
        hit = self._built.get(key)
        if hit is not None:
            return hit
        code = self._code(key)
        i = -1 if code is None else int(np.searchsorted(self._codes, code))
        if i < 0 or i >= len(self._codes) or self._codes[i] != code:
            raise KeyError(key)
        hit = self._built[key] = tuple(self._members[self._order[self._starts[i]:self._ends[i]]].tolist())
        return hit

    def __iter__(self):
        for start in self._starts.tolist():
            row = self._order[start]
            yield tuple(int(c[row]) for c in self._columns)

    def __len__(self) -> int:
        return len(self._codes)
