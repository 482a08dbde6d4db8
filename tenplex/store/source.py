"""The source protocol: what the store executor reads a plan's source shards from.

:class:`~tenplex.store.execute.StorePlanRunner` (and :func:`~tenplex.store.fetch.read_region`)
read source shards through this protocol only. A committed tenplex store
(:class:`~tenplex.store.reader.StoreReader`) implements it; so can a reader of
another checkpoint format (e.g. a Megatron one), which then feeds the planner
and the store executor directly, one stored tensor at a time, without a
conversion into an intermediate store.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol, runtime_checkable

import numpy as np
import torch

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree

__all__ = ["ShardSource"]


@runtime_checkable
class ShardSource(Protocol):
    """Source shards of a tree laid out for one config, readable by byte ranges.

    Attributes:
        tree: the tree spec.
        config: the config the source shards are laid out for.
        sharding: ``Sharding(tree, config)``.
        meta: free-form JSON carried along (e.g. Megatron args).
        bytes_read: bytes fetched from storage so far.
    """

    tree: PTree
    config: ParallelConfig
    sharding: Sharding
    meta: dict
    bytes_read: int

    def record(self, path: str, rank: int) -> Hashable:
        """A handle of the stored local tensor that holds leaf ``path`` for source ``rank``.

        Ranks of one holder class (replicas) may share a handle. Raises a
        :class:`~tenplex.errors.StoreError` subclass if no stored tensor holds it.
        """

    def read(self, record: Hashable, starts: np.ndarray | None = None,
             ends: np.ndarray | None = None) -> torch.Tensor:
        """The local tensor of ``record`` with at least bytes ``[starts[i], ends[i])`` filled.

        Offsets are in bytes from the local tensor's first byte (int64
        arrays of equal length); ``None`` means the whole tensor. Other bytes
        are undefined. The result has the local shape and the leaf's dtype.
        """

    def value(self, path: str, key: str) -> Any:
        """The value of value leaf ``path`` for ``key`` (``""`` for a global value), or None."""
