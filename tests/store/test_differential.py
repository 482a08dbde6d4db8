"""The differential property of the store, over random GPT trees, config pairs and block sizes.

For every rank ``r`` of the target config ``B``, each of these equals
``materialize(x, B, r)`` bit for bit:

- ``load(save(x, A), B, r)``;
- ``load(reshard(save(x, A), B), B, r)``.

Blocks are small (64 B to 4 KiB) and tensors up to about 1.5 MB, so reads
start and end in the middle of checksum blocks and stored tensors start
mid-block. Both read paths run: local files (``readinto``) and ``memory://``
(fsspec ``cat_ranges``, as object stores). The streaming reshard's read-ahead
(:data:`tenplex.store.execute.READ_AHEAD`, local sources) is drawn too, from one
tensor a window to the default.
"""

from __future__ import annotations

import uuid
from unittest import mock

import fsspec
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex.store.execute as execute
from tenplex.api import reshard, save
from tenplex.models import random_state
from tenplex.ptree import materialize

from .helpers import assert_rank_loads
from .sized_strategies import differential_cases


@given(case=differential_cases(), backend=st.sampled_from(["file", "memory"]),
       seed=st.integers(0, 1000), read_ahead=st.sampled_from([1, 4096, execute.READ_AHEAD]))
@settings(max_examples=30, deadline=None)
def test_load_and_reshard_equal_materialize(tmp_path_factory, case, backend, seed, read_ahead):
    tree, a, b, block_a, block_b = case
    if backend == "file":
        root = f"file://{tmp_path_factory.mktemp('diff')}"
    else:
        root = f"memory://tenplex-diff-{uuid.uuid4().hex}"
    try:
        x = random_state(tree, a, seed)
        save(f"{root}/a", tree, a, {r: materialize(tree, x, a, r) for r in range(a.world_size)},
             block=block_a)
        assert_rank_loads(f"{root}/a", tree, x, b)
        with mock.patch.object(execute, "READ_AHEAD", read_ahead):
            reshard(f"{root}/a", f"{root}/b", b, block=block_b)
        assert_rank_loads(f"{root}/b", tree, x, b)
    finally:
        if backend == "memory":
            fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)
