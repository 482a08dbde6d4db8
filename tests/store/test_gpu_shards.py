"""Shards that live on a GPU: saved from the device through a bounded host buffer, read back bit for bit.

Skipped without CUDA (CI has none); run on a GPU machine. Before tenplex.store.host the
writer called ``.numpy()`` on each shard and a CUDA shard failed with ``TypeError: can't
convert cuda:0 device type tensor to numpy``.
"""

from __future__ import annotations

import pytest
import torch

from tenplex.api import load, load_global, save, verify
from tenplex.models import GPTSpec
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.store import host

from .helpers import assert_same_global, assert_same_shards, state_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPEC = GPTSpec(num_layers=2, hidden=256, heads=4, query_groups=2, ffn=512, vocab=1000, swiglu=True,
               tied=False, dtype="bfloat16", optimizer="distributed_adam", make_vocab_size_divisible_by=128)
SRC, DST = P(dp=2, tp=2, pp=1), P(dp=1, tp=1, pp=2)


def _on_gpu(shards: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in shards.items()}


def test_gpu_shards_save_bit_for_bit_in_staging_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "STAGING_BYTES", 4096)  # every tensor crosses in many pieces
    tree, st, shards = state_of(SPEC, SRC, 5)
    url = str(tmp_path / "ckpt")
    save(url, tree, SRC, {r: _on_gpu(s) for r, s in shards.items()})
    assert verify(url).tensors > 0
    assert_same_global(tree, st, load_global(url))
    for rank in range(DST.world_size):  # a rank loads at another config, then moves to its device
        got = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in load(url, DST, rank).items()}
        want = materialize(tree, st, DST, rank)
        assert_same_shards(want, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()},
                           f"rank {rank}")
