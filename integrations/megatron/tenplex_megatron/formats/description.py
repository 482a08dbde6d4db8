"""What a Megatron checkpoint holds, read from its metadata: the record both formats share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree

from tenplex_megatron.model.config import MegatronConfig

__all__ = ["Description"]


@dataclass
class Description:
    """A Megatron checkpoint in tenplex terms, without its tensor data.

    Attributes:
        cfg: the model config.
        config: the parallel config its files are laid out for (dp = 1:
            Megatron files hold dp rank 0's copy, or buffers gathered over dp).
        tree: the tree (with optimizer leaves when the checkpoint has Adam state).
        values: ``{path: JSON value}`` of the value leaves read so far; RNG
            states (tensors) are read on demand by the source, so here
            ``megatron/rng_state`` lists only the stored coordinates.
        meta: format details carried along (``{"megatron": {...}}``): the
            format, the model config, the optimizer kind and the
            distributed optimizer's buffer dtypes.
        notes: remarks for the user (e.g. a dropped RNG state), one line each.
        sharding: ``Sharding(tree, config)`` as the reader built it (handed to the source, so
            an operation builds the geometry once).
    """

    cfg: MegatronConfig
    config: ParallelConfig
    tree: PTree
    values: dict[str, Any]
    meta: dict
    notes: list[str] = field(default_factory=list)
    sharding: Sharding | None = field(default=None, compare=False, repr=False)
