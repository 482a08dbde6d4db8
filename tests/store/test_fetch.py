"""read_region and the store executor read any ShardSource, and rely only on the bytes they ask for.

``PoisonSource`` is a :class:`~tenplex.store.source.ShardSource` held in
memory whose ``read`` fills only the requested byte runs (offsets from the
stored tensor's first byte) and poisons every other byte; results built
from it are exact only if the runs the executor computes are exactly right.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.api import save
from tenplex.models import random_state
from tenplex.ptree import Box, Layout, ParallelConfig as P, PTree, Sharding, Split, TensorLeaf
from tenplex.ptree import materialize
from tenplex.ptree.region import to_slices
from tenplex.ptree.shards import bitwise_equal
from tenplex.store import StoreReader
from tenplex.store.execute import StorePlanRunner
from tenplex.store.fetch import read_region
from tenplex.store.source import ShardSource
from tenplex.transform import make_plan

from .helpers import assert_same_shards
from .sized_strategies import blocks, configs_for, sized_gpt_specs


class PoisonSource:
    """Local shards of every holder class, in memory; unrequested bytes read as 0xA5."""

    def __init__(self, tree: PTree, config: P, state: dict):
        self.tree, self.config, self.meta, self.bytes_read = tree, config, {}, 0
        self.sharding = Sharding(tree, config)
        self.shards = {r: materialize(tree, state, config, r, self.sharding)
                       for r in range(config.world_size)}
        self.reads: list[tuple] = []

    def record(self, path: str, rank: int):
        for holders in self.sharding.classes(path):
            if rank in holders.ranks:
                return (path, holders.ranks[0])
        raise KeyError((path, rank))

    def read(self, record, starts=None, ends=None) -> torch.Tensor:
        path, rank = record
        local = self.shards[rank][path].contiguous()
        raw = local.reshape(-1).view(torch.uint8)
        if starts is None:
            starts, ends = np.array([0]), np.array([raw.numel()])
        out = torch.full_like(raw, 0xA5)
        for a, b in zip(starts.tolist(), ends.tolist()):
            assert 0 <= a <= b <= raw.numel(), (path, a, b)
            out[a:b] = raw[a:b]
            self.bytes_read += b - a
        self.reads.append((record, len(starts)))
        return out.view(local.dtype).reshape(local.shape)

    def value(self, path: str, key: str):
        return None


@st.composite
def cases(draw):
    from tenplex.models import gpt_tree
    tree = gpt_tree(draw(sized_gpt_specs()))
    configs = configs_for(tree, max_world=4)
    return tree, draw(st.sampled_from(configs)), draw(st.sampled_from(configs)), draw(st.integers(0, 99))


def test_poison_source_is_a_shard_source():
    tree = PTree({"w": TensorLeaf((8, 4), "float32", Layout(split=Split(0)))}, num_layers=1)
    assert isinstance(PoisonSource(tree, P(tp=2), {"w": torch.zeros(8, 4)}), ShardSource)


@given(cases())
@settings(max_examples=15, deadline=None)
def test_store_executor_reads_only_what_it_needs(case):
    tree, a, b, seed = case
    x = random_state(tree, a, seed)
    source = PoisonSource(tree, a, x)
    runner = StorePlanRunner(source, make_plan(tree, a, b))
    try:
        for rank in range(b.world_size):
            got = {}
            for path, _ in tree.tensors():
                for t in runner.leaf(path, [rank]).values():
                    shape = runner.D.holding(path, b.coord(rank)).shape
                    got[path] = torch.cat([p.reshape(-1) for p in t]).view(shape) \
                        if isinstance(t, list) else t
            want = {p: v for p, v in materialize(tree, x, b, rank).items()
                    if isinstance(v, torch.Tensor)}
            assert_same_shards(want, got, f"rank {rank} of {b}")
    finally:
        runner.close()


@st.composite
def region_cases(draw):
    tree, a, _, seed = draw(cases())
    path, leaf = draw(st.sampled_from(list(tree.tensors())))
    shape = Sharding(tree, a).physical_shape(leaf)
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, max(0, n - 1)))
        offsets.append(lo)
        sizes.append(draw(st.integers(min(1, n - lo), n - lo)))
    return tree, a, seed, path, Box(tuple(offsets), tuple(sizes)), draw(blocks)


@given(region_cases())
@settings(max_examples=25, deadline=None)
def test_read_region_from_a_store_and_from_any_source(tmp_path_factory, case):
    tree, a, seed, path, box, block = case
    x = random_state(tree, a, seed)
    source = PoisonSource(tree, a, x)
    padded = torch.zeros(Sharding(tree, a).physical_shape(tree[path]), dtype=x[path].dtype)
    padded[to_slices(Box((0,) * x[path].dim(), tuple(x[path].shape)))] = x[path]
    want = padded[to_slices(box)]
    assert bitwise_equal(read_region(source, path, box), want)
    root = tmp_path_factory.mktemp("region")
    save(str(root / "ck"), tree, a, source.shards, block=block)
    reader = StoreReader(str(root / "ck"))
    assert bitwise_equal(read_region(reader, path, box), want)
    assert reader.bytes_read <= sum(f.size for f in reader.manifest.files.values())


def test_scalar_and_empty_tensors_round_trip(tmp_path):
    from tenplex.api import load
    tree = PTree({"scalar": TensorLeaf((), "bfloat16"), "empty": TensorLeaf((0, 3), "float32"),
                  "w": TensorLeaf((5, 3), "int64", Layout(split=Split(1)))}, num_layers=1)
    x = {"scalar": torch.tensor(1.5, dtype=torch.bfloat16), "empty": torch.zeros(0, 3),
         "w": torch.arange(15).reshape(5, 3)}
    a, b = P(tp=3), P(tp=1, dp=2)
    save(str(tmp_path / "ck"), tree, a, {r: materialize(tree, x, a, r) for r in range(3)}, block=7)
    for rank in range(b.world_size):
        assert_same_shards(materialize(tree, x, b, rank), load(str(tmp_path / "ck"), b, rank))
