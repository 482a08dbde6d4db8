"""Tied embeddings: the first and last pipeline stages' copies must be equal, byte for byte.

With ``share_embeddings_and_output_weights`` and pp > 1, megatron-core keeps
the word embedding on the first stage and a copy (``output_layer.weight``)
on the last, and all-reduces their gradients so they stay equal
(``models/common/language_module/language_module.py``). Their optimizer
state is equal too. A checkpoint whose copies differ is inconsistent; tenplex
refuses it rather than keep one copy silently.
"""

from __future__ import annotations

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.layout import StageKind

__all__ = ["check_tied", "CHUNK"]

CHUNK = 64 << 20
"""Bytes compared at a time (64 MiB)."""


def check_tied(source, chunk: int = CHUNK) -> None:
    """Compare every stored first-stage and last-stage copy of a tied leaf, ``chunk`` bytes at a time.

    ``source`` is a Megatron source with ``copies(path, tp_rank) -> {pp rank: record}``.

    Raises:
        ManifestError: naming the leaf, the tp rank, both stages and the first
            differing byte, if two copies differ.
    """
    cfg, config = source.desc.cfg, source.config
    if not cfg.tied or config.pp == 1:
        return
    last = config.pp - 1
    for path, leaf in source.tree.tensors():
        if leaf.layout.stage.kind is not StageKind.FIRST_AND_LAST:
            continue
        for t in range(config.tp if leaf.layout.split is not None else 1):
            copies = source.copies(path, t)
            if 0 in copies and last in copies:
                _compare(source, path, t, copies[0], copies[last], last, chunk)


def _compare(source, path, t, a, b, last, chunk) -> None:
    n = a.nbytes
    if b.nbytes != n:
        raise ManifestError(f"{source.where}: the tied copies of {path} (tp rank {t}) differ in size: "
                            f"{n} bytes on stage 0, {b.nbytes} on stage {last}")
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        s, e = np.array([lo], dtype=np.int64), np.array([hi], dtype=np.int64)
        x = _bytes(source.read(a, s, e))[lo:hi]
        y = _bytes(source.read(b, s, e))[lo:hi]
        if not torch.equal(x, y):
            first = lo + int(torch.nonzero(x != y)[0])
            raise ManifestError(f"{source.where}: the tied embedding's copies differ: {path} (tp rank {t}) "
                                f"on stage 0 and on stage {last} first differ at byte {first}; megatron-core "
                                "keeps them equal, so the checkpoint is inconsistent")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
