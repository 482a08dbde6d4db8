"""A real-size store test: about 280 MB of GPT state with 1 MiB checksum blocks.

Tensors of 1 to 8 MB span many default (1 MiB) checksum blocks, so every
rank's range reads start and end mid-block, as in the README's demo. The
state is saved under ``dp=2,tp=2,pp=1``, and for three target configs every
rank is loaded from the saved store and from a resharded one, bit-exact
against ``materialize``; the resharded stores are verified too.
"""

from __future__ import annotations

import pytest

from tenplex.api import load_global, reshard, save, verify
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize

from .helpers import assert_rank_loads, assert_same_global

SPEC = GPTSpec(num_layers=4, hidden=512, heads=8, query_groups=4, ffn=2048, vocab=8000,
               swiglu=True, tied=True, dtype="bfloat16", optimizer="distributed_adam",
               bucket_numel=4_000_000, make_vocab_size_divisible_by=128)
SRC = P(dp=2, tp=2, pp=1)
TARGETS = [P(dp=1, tp=1, pp=4), P(dp=4, tp=1, pp=2), P(dp=1, tp=4, pp=2)]


@pytest.mark.slow
def test_real_size_save_load_reshard(tmp_path):
    tree = gpt_tree(SPEC)
    x = random_state(tree, SRC, 11)
    shards = {r: materialize(tree, x, SRC, r) for r in range(SRC.world_size)}
    manifest = save(str(tmp_path / "src"), tree, SRC, shards)
    del shards
    stored = sum(f.size for f in manifest.files.values())
    assert stored > 250e6, stored
    largest = max(rec.nbytes for rec in manifest.tensors.values())
    assert largest > 4 * (1 << 20), largest  # tensors span many 1 MiB blocks
    for target in TARGETS:
        assert_rank_loads(str(tmp_path / "src"), tree, x, target)
        dst = str(tmp_path / f"to-{target}".replace(",", "_").replace("=", ""))
        reshard(str(tmp_path / "src"), dst, target)
        assert_rank_loads(dst, tree, x, target)
        assert_same_global(tree, x, load_global(dst))
        verify(dst, progress=False)
