"""Target ranks' local tensors, built from any shard source through the planner and the store executor.

The Megatron writers use one :class:`TargetBuilder` each: it plans the move
from the source's config to the target's, and builds one target rank's
leaves at a time (leaves in parallel), so a writer holds what it is writing
and no more. The source is any :class:`tenplex.store.source.ShardSource`:
a tenplex store, or a Megatron checkpoint read in place.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import torch

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.transform.planner import make_plan

from tenplex_megatron.config import MegatronConfig

__all__ = ["TargetBuilder", "megatron_meta"]


def megatron_meta(source) -> tuple[MegatronConfig, dict]:
    """The model config and Megatron meta a source carries.

    Raises:
        ManifestError: if the source is not a Megatron model.
    """
    meta = (source.meta or {}).get("megatron")
    if not meta or "config" not in meta:
        raise ManifestError("the source is not a Megatron model (no megatron config in its meta); "
                            "write it with --format tenplex")
    return MegatronConfig.from_json(meta["config"]), meta


def _whole(t, shape) -> torch.Tensor:
    """A tensor with its own minimal storage (``torch.save`` writes a view's whole storage)."""
    if isinstance(t, (list, tuple)):
        return torch.cat([p.reshape(-1) for p in t]).view(shape)
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


class TargetBuilder:
    """Plans ``source -> to`` and builds target ranks' local tensors.

    Args:
        source: the shard source.
        to: the target config.
        threads: leaves built (and stored tensors read) at once.

    Attributes:
        plan: the plan.
        values: the target's value leaves (:func:`tenplex.store.execute.target_values`).
        bytes_written: bytes of tensors handed out so far.

    Raises:
        ConfigError: ``to`` cannot hold the tree.
    """

    def __init__(self, source, to: ParallelConfig, threads: int = 8):
        self.source, self.to, self.threads = source, to, max(1, threads)
        self.tree = source.tree
        self.plan = make_plan(self.tree, source.config, to)
        self.runner = StorePlanRunner(source, self.plan, self.threads)
        self.values = target_values(self.tree, self.plan, source)
        self._pool = ThreadPoolExecutor(self.threads)

    def close(self) -> None:
        self.runner.close()
        self._pool.shutdown()

    def __enter__(self) -> "TargetBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def paths(self, rank: int, prefix: str = "") -> list[str]:
        """The tensor leaves under ``prefix`` that target ``rank`` holds, in tree order."""
        coord = self.to.coord(rank)
        return [p for p, _ in self.tree.tensors()
                if p.startswith(prefix) and self.runner.D.holding(p, coord) is not None]

    def leaf(self, path: str, rank: int) -> torch.Tensor:
        """Target ``rank``'s local tensor of ``path`` (its own storage)."""
        got = self.runner.leaf(path, [rank])
        if rank not in got:
            raise ManifestError(f"target rank {rank} holds no part of {path}")
        return _whole(got[rank], self.runner.D.holding(path, self.to.coord(rank)).shape)

    def stream(self, rank: int, paths: Iterable[str], ahead: int | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(path, local tensor)`` for ``paths`` in order; up to ``ahead`` leaves built in advance."""
        paths = list(paths)
        ahead = self.threads if ahead is None else max(1, ahead)
        futures = {}
        for i, path in enumerate(paths):
            for j in range(i, min(len(paths), i + ahead)):
                if j not in futures:
                    futures[j] = self._pool.submit(self.leaf, paths[j], rank)
            yield path, futures.pop(i).result()

    def rank(self, rank: int, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every local tensor of target ``rank`` under ``prefix``."""
        return dict(self.stream(rank, self.paths(rank, prefix)))
