"""Random global state for a tree, for tests, benchmarks and examples."""

from __future__ import annotations

from typing import Any

import torch

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, torch_dtype

__all__ = ["random_state"]


def random_state(tree: PTree, config: ParallelConfig, seed: int = 0) -> dict[str, Any]:
    """Global state with random tensors and distinct values for every leaf.

    Floating tensors are standard normal in their dtype; integer tensors are
    uniform in ``[0, 100)``. Value leaves get the seed and, for scoped
    leaves, one value per key of ``config``.

    Args:
        tree: the tree spec.
        config: the config whose keys scoped value leaves get.
        seed: the random seed.

    Returns:
        ``{path: tensor or value}`` as :func:`tenplex.ptree.shards.materialize` takes.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for path, leaf in tree.leaves.items():
        if isinstance(leaf, TensorLeaf):
            dtype = torch_dtype(leaf.dtype)
            if dtype.is_floating_point:
                state[path] = torch.randn(leaf.shape, generator=gen).to(dtype)
            else:
                state[path] = torch.randint(0, 100, leaf.shape, generator=gen).to(dtype)
        elif leaf.scope is Scope.GLOBAL:
            state[path] = {"seed": seed, "leaf": path}
        else:
            keys = sorted({leaf.key(config, r) for r in range(config.world_size)})
            state[path] = {k: f"{path}@{k}#{seed}" for k in keys}
    return state
