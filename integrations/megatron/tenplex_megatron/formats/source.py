"""The shard source both Megatron readers share: records resolved to stored bytes, values on demand.

A :class:`MegatronSource` implements :class:`tenplex.store.source.ShardSource`
over a Megatron checkpoint's own files, so the planner and the store
executor read them directly, one stored tensor at a time, by byte ranges.
Subclasses say where each rank's local tensor lies (:meth:`locate`) and
how a value leaf is read (:meth:`read_value`).
"""

from __future__ import annotations

import threading
from typing import Any, Hashable

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.formats.description import Description

__all__ = ["MegatronSource", "empty_extra_state", "extra_state_note"]


def empty_extra_state(obj: Any) -> bool:
    """Whether a module's ``_extra_state`` holds nothing: ``None`` (megatron-core's own linears) or an
    empty tensor (TransformerEngine's ``get_extra_state`` without FP8), bare or in a one-item list
    (a ``ShardedObject``'s). ``obj`` may be a tensor or a legacy reader's tensor reference."""
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if obj is None:
        return True
    shape = getattr(obj, "shape", None)
    return shape is not None and (0 in tuple(shape) if len(tuple(shape)) else False)


def extra_state_note(count: int, first: str) -> str:
    """The note for dropped non-empty extra states (TransformerEngine's FP8 scaling metadata)."""
    return (f"extra_state: {count} TransformerEngine extra states hold FP8 scaling metadata (first: {first}); "
            "it is kept per tensor-parallel shard, so it is not carried to another layout: the output "
            "has empty extra states, and TE rebuilds its FP8 scales from the amax of the next steps")


class MegatronSource:
    """Source shards of a Megatron checkpoint, read from its files (a ``ShardSource``).

    Args:
        desc: the checkpoint's description.

    Attributes:
        tree, config, sharding, meta: as the protocol says.
        desc: the description.
        bytes_read: bytes read from the checkpoint's files so far (thread-safe).
    """

    def __init__(self, desc: Description):
        self.desc = desc
        self.tree, self.config, self.meta = desc.tree, desc.config, desc.meta
        self.sharding = desc.sharding or Sharding(self.tree, self.config)
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._first: dict[str, dict[int, int]] = {}
        self._values: dict[tuple[str, str], Any] = {}

    # -- the ShardSource protocol ---------------------------------------------
    def record(self, path: str, rank: int) -> Hashable:
        """The stored tensor holding ``path`` for ``rank`` (its replica class's first rank's).

        Raises:
            ManifestError: if no stored tensor holds it.
        """
        firsts = self._first.get(path)
        if firsts is None:
            firsts = {r: c.ranks[0] for c in self.sharding.classes(path) for r in c.ranks}
            self._first[path] = firsts
        if rank not in firsts:
            raise ManifestError(f"{self.where}: no stored tensor holds leaf {path} for rank {rank}")
        return self.locate(path, self.config.coord(firsts[rank]))

    def read(self, record, starts: np.ndarray | None = None, ends: np.ndarray | None = None
             ) -> torch.Tensor:
        """The local tensor of ``record``, with at least the byte runs ``[starts, ends)`` read."""
        tensor, n = self.fetch(record, starts, ends)
        self.count(n)
        return tensor

    def value(self, path: str, key: str) -> Any:
        """The JSON value of value leaf ``path`` for ``key`` (``""`` for a global one), or None."""
        cached = self._values.get((path, key))
        if cached is None:
            cached = self._values[(path, key)] = self.read_value(path, key)
        return cached

    # -- for subclasses ---------------------------------------------------------
    @property
    def where(self) -> str:
        return str(self.meta.get("megatron", {}).get("root", "checkpoint"))

    def count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def locate(self, path: str, coord) -> Hashable:
        """The record of ``path``'s local tensor at ``coord`` (a source :class:`Coord`)."""
        raise NotImplementedError

    def fetch(self, record, starts, ends) -> tuple[torch.Tensor, int]:
        """``record``'s local tensor with the runs read, and the bytes read."""
        return record.read(starts, ends)

    def copies(self, path: str, tp_rank: int) -> dict:
        """``{pp rank: record}`` of every stored copy of ``path`` at ``tp_rank`` (tied leaves)."""
        return {}

    def read_value(self, path: str, key: str) -> Any:
        stored = self.desc.values.get(path)
        return stored if key == "" else None
