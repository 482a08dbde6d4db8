"""Value leaves in a store: checked before a commit, gathered from every rank's shards."""

from __future__ import annotations

from typing import Any, Mapping

from tenplex.errors import ShardError
from tenplex.store.bounded_json import check_writable
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree, Scope

__all__ = ["check_values", "gather_values", "VALUE_DEPTH"]

VALUE_DEPTH = 2
"""Levels above a value in the manifest (``{"values": {path: value}}``); a scoped value adds one."""


def check_values(tree: PTree, values: Mapping[str, Any]) -> dict:
    """``values`` of every value leaf, checked: present, ``{key: value}`` when scoped, JSON-able.

    Raises:
        ShardError: naming the leaf.
    """
    out = {}
    for path, leaf in tree.values():
        if path not in values:
            raise ShardError(f"value leaf {path} has no value")
        value = values[path]
        if leaf.scope is not Scope.GLOBAL and not isinstance(value, Mapping):
            raise ShardError(f"value leaf {path}: expected {{key: value}} for scope {leaf.scope.value}")
        check_writable(value, f"value leaf {path}", ShardError, depth_used=VALUE_DEPTH)
        out[path] = value
    return out


def gather_values(tree: PTree, config: ParallelConfig, shards_by_rank: Mapping[int, Mapping]) -> dict:
    """Value leaves of every rank's shards as stored values (one per key)."""
    out: dict = {}
    for path, leaf in tree.values():
        if leaf.scope is Scope.GLOBAL:
            out[path] = shards_by_rank[min(shards_by_rank)][path]
        else:
            out[path] = {leaf.key(config, r): shards[path] for r, shards in sorted(shards_by_rank.items())}
    return out
