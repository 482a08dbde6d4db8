"""Reads that start and end mid-block, at real sizes, with the default 1 MiB checksum blocks.

- ``tenplex.load`` of an fp32 [4096, 512] tensor (8 MiB: eight blocks) split
  on either axis, loaded at ``dp=1,tp=4,pp=1``: each rank's range read starts
  and ends mid-block.
- ``tenplex reshard`` (the CLI) of a GPT tree with bf16 weights and
  distributed-Adam state, hidden 512 (tensors of 0.1-8 MB), on the failing pair
  ``dp=2,tp=2,pp=1 -> dp=1,tp=1,pp=4``: every target rank loads bit-exact and
  the global tensors equal the source's.

Both failed on 79566e5 (``RuntimeError: shape '[...]' is invalid for input of
size ...`` from the store reader).
"""

from __future__ import annotations

import pytest
import torch

from tenplex.api import load, load_global, save
from tenplex.cli.main import main
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import Layout, ParallelConfig, PTree, Split, Stage, TensorLeaf, materialize

from .helpers import assert_rank_loads, assert_same_global, assert_same_shards

GPT = GPTSpec(num_layers=4, hidden=512, heads=8, query_groups=4, ffn=512, vocab=8000,
              make_vocab_size_divisible_by=128, dtype="bfloat16", optimizer="distributed_adam",
              bucket_numel=1 << 20)
"""About 100 MB stored. The vocabulary pads to 8192 rows at tp=2 and to 8064 at tp=1, so the
target reads the embedding's stored shards (bf16 weights 4 MiB, fp32 optimizer state about 4 MiB a dp shard)
only in part: reads that end mid-block in tensors of several 1 MiB blocks."""


@pytest.mark.parametrize("axis", [1, 0])
def test_a_tensor_spanning_checksum_blocks_loads_exactly(tmp_path, axis):
    tree = PTree({"w": TensorLeaf((4096, 512), "float32", Layout(Stage.of_layer(0), Split(axis)))},
                 num_layers=1)
    a, b = ParallelConfig(), ParallelConfig.parse("dp=1,tp=4,pp=1")
    x = {"w": torch.randn(4096, 512, generator=torch.Generator().manual_seed(axis))}
    save(str(tmp_path / "ck"), tree, a, {0: materialize(tree, x, a, 0)})
    for rank in range(b.world_size):
        assert_same_shards(materialize(tree, x, b, rank), load(str(tmp_path / "ck"), b, rank),
                           f"rank {rank}")


def test_cli_reshard_of_the_failing_gpt_pair(tmp_path, capsys):
    tree = gpt_tree(GPT)
    a, b = ParallelConfig.parse("dp=2,tp=2,pp=1"), ParallelConfig.parse("dp=1,tp=1,pp=4")
    x = random_state(tree, a, 9)
    manifest = save(str(tmp_path / "src"), tree, a, {r: materialize(tree, x, a, r) for r in range(4)})
    block = 1 << 20
    assert {f.block for f in manifest.files.values()} == {block}
    assert sum(rec.nbytes > block for rec in manifest.tensors.values()) >= 4  # span several blocks
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", str(b)]) == 0, \
        capsys.readouterr().err
    assert_same_global(tree, x, load_global(str(tmp_path / "dst")))
    assert_rank_loads(str(tmp_path / "dst"), tree, x, b)
    assert main(["verify", str(tmp_path / "dst")]) == 0
