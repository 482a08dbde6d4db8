"""Fetch one region of one leaf from a shard source, whatever its layout, by range reads.

Box geometry lives in :mod:`tenplex.ptree.region`; this module only turns a
region into the byte runs of the stored tensors that hold it and reads them
through the :class:`~tenplex.store.source.ShardSource` protocol.
"""

from __future__ import annotations

import numpy as np
import torch

from tenplex.ptree.region import Box, intersect, relative, subtract, to_slices
from tenplex.ptree.shards import piece_view
from tenplex.ptree.tree import torch_dtype
from tenplex.store.blocks import box_runs
from tenplex.store.source import ShardSource

__all__ = ["read_region"]


def read_region(reader: ShardSource, path: str, box: Box) -> torch.Tensor:
    """The elements ``box`` of leaf ``path`` (global coordinates), read by range reads.

    Each holder class's stored tensor is read once, for the byte runs of the
    parts of ``box`` it holds (offsets from the stored tensor's first byte).
    Elements outside the source's padded extent (padding the source never
    had) are zero.

    Args:
        reader: any shard source (a committed store, or another format's reader).
        path: a tensor leaf of ``reader.tree``.
        box: the region, in elements of the leaf's global (padded) coordinates.

    Returns:
        A tensor of shape ``box.sizes`` and the leaf's dtype.

    Raises:
        ManifestError: the source lacks the leaf.
        CorruptShardError: a read fails its checksum.
    """
    leaf = reader.tree[path]
    out = torch.zeros(box.sizes, dtype=torch_dtype(leaf.dtype))
    remaining = [box]
    for holders in reader.sharding.classes(path):
        rec = reader.record(path, holders.ranks[0])
        for piece in holders.holding.pieces:
            parts = [(rem, intersect(rem, piece.box)) for rem in remaining]
            hits = [(rem, inter) for rem, inter in parts if inter is not None]
            if not hits:
                continue
            starts, ends = [], []
            for _, inter in hits:
                rel = relative(inter, piece.box)
                offs = tuple(l + r for l, r in zip(piece.local.offsets, rel.offsets))
                s, n = box_runs(piece.view, offs, inter.sizes, piece.offset)
                starts.append(s * leaf.itemsize)
                ends.append(s * leaf.itemsize + n * leaf.itemsize)
            local = reader.read(rec, np.concatenate(starts), np.concatenate(ends))
            next_remaining = [rem for rem, inter in parts if inter is None]
            for rem, inter in hits:
                src = piece_view(local, piece)[to_slices(relative(inter, piece.box))]
                out[to_slices(relative(inter, box))] = src
                next_remaining.extend(subtract(rem, inter))
            remaining = next_remaining
            if not remaining:
                return out
    return out
