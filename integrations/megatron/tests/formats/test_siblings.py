"""Leaves built once for sibling ranks equal each rank's own build, whatever the bound and the interleaving.

:class:`~tenplex_megatron.formats.siblings.SiblingLeaves` hands each rank the
tensor one executor call built for several ranks (or, past its bound, one
built for that rank alone). Drawn here: the model shape, the config pair, the
store's checksum block size, the bound on kept bytes, and the order in which
the sibling writers' threads ask; every rank's tensor equals
``StorePlanRunner.leaf(path, [rank])`` bit for bit, and every read happens
inside the executor, so the file-level counts of ``formats/test_streaming.py``
stay the only read accounting.
"""

from __future__ import annotations

import functools
import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.shards import materialize
from tenplex.store.execute import StorePlanRunner
from tenplex.store.reader import StoreReader
from tenplex.store.writer import save
from tenplex.transform.planner import make_plan
from tenplex_megatron.formats.siblings import SiblingLeaves, Stopped, tp_siblings

PAIRS = [("dp=1,tp=1,pp=1", "dp=1,tp=4,pp=1"), ("dp=1,tp=2,pp=1", "dp=1,tp=4,pp=2"),
         ("dp=2,tp=2,pp=1", "dp=1,tp=2,pp=2"), ("dp=1,tp=4,pp=1", "dp=2,tp=2,pp=1")]


@functools.lru_cache(maxsize=None)
def _store(root: str, src: str, hidden: int, block: int) -> str:
    spec = GPTSpec(num_layers=2, hidden=hidden, heads=8, query_groups=4, ffn=2 * hidden, vocab=96,
                   seq_len=8, dtype="bfloat16", optimizer="adam")
    tree, config = gpt_tree(spec), ParallelConfig.parse(src)
    state = random_state(tree, config, 0)
    sharding = Sharding(tree, config)
    url = f"{root}/{src.replace(',', '_').replace('=', '')}-{hidden}-{block}"
    save(url, tree, config, {r: materialize(tree, state, config, r, sharding)
                             for r in range(config.world_size)}, block=block)
    return url


def _flat(t) -> torch.Tensor:
    parts = t if isinstance(t, (list, tuple)) else [t]
    return torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("siblings"))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=st.sampled_from(PAIRS), hidden=st.sampled_from([32, 64]), block=st.sampled_from([256, 4096, 1 << 20]),
       limit=st.sampled_from([0, 2048, 16 << 10, 1 << 30]), seed=st.integers(0, 2**16))
def test_sibling_builds_equal_each_ranks_own(root, pair, hidden, block, limit, seed):
    src, dst = pair
    reader = StoreReader(_store(root, src, hidden, block))
    to = ParallelConfig.parse(dst)
    runner = StorePlanRunner(reader, make_plan(reader.tree, reader.config, to), threads=2)
    try:
        shared = SiblingLeaves(runner, to, limit=limit)
        groups = tp_siblings(to, range(to.world_size))
        assert sorted(r for g in groups for r in g) == list(range(to.world_size))
        assert all(len({to.coord(r)._replace(tp=0, etp=0) for r in g}) == 1 for g in groups)
        shared.group(groups)
        got, errors = {}, []
        rng = random.Random(seed)

        def writer(rank: int) -> None:  # a sibling's writer: its leaves in tree order, at its own pace
            try:
                for path, _ in reader.tree.tensors():
                    if runner.D.holding(path, to.coord(rank)) is not None:
                        if rng.random() < 0.3:
                            threading.Event().wait(0.001)
                        got[(path, rank)] = shared.get(path, rank)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(r,)) for r in range(to.world_size)]
        rng.shuffle(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for (path, rank), tensor in got.items():
            alone = runner.leaf(path, [rank])[rank]
            assert torch.equal(_flat(tensor), _flat(alone)), (path, rank)
        assert shared._held == sum(n for _, n in shared._kept.values()) <= max(limit, 0)
    finally:
        runner.close()


def test_a_failed_build_reaches_the_waiting_sibling_and_stop_ends_the_others(root):
    reader = StoreReader(_store(root, "dp=1,tp=1,pp=1", 64, 4096))
    to = ParallelConfig.parse("dp=1,tp=2,pp=1")
    runner = StorePlanRunner(reader, make_plan(reader.tree, reader.config, to), threads=2)
    path = "model/layers/0/mlp/fc2/weight"
    started, release = threading.Event(), threading.Event()
    real = runner.leaf

    def failing(p, ranks):
        if p == path:
            started.set()
            release.wait(5)
            raise OSError(f"injected: {p} for {ranks}")
        return real(p, ranks)

    runner.leaf = failing
    try:
        shared = SiblingLeaves(runner, to)
        shared.group([(0, 1)])
        seen = {}

        def ask(rank):
            try:
                shared.get(path, rank)
            except BaseException as exc:
                seen[rank] = exc

        first = threading.Thread(target=ask, args=(0,))
        first.start()
        assert started.wait(5)
        second = threading.Thread(target=ask, args=(1,))  # waits for rank 0's build of both
        second.start()
        release.set()
        first.join()
        second.join()
        assert all(isinstance(seen.get(r), OSError) and "injected" in str(seen[r]) for r in (0, 1)), seen
        shared.stop()
        shared.clear()  # a stopped writer's queued builds still stop after its batch is cleared
        with pytest.raises(Stopped, match="sibling file's writer failed"):
            shared.get("model/embedding/word_embeddings/weight", 1)
        shared.group([(0, 1)])  # the next batch
        runner.leaf = real
        assert shared.get("model/embedding/word_embeddings/weight", 1) is not None
    finally:
        runner.leaf = real
        runner.close()
