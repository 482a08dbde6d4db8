"""rebuild_after_failure decides whether the checkpoint is needed without planning the whole world."""

import importlib

import pytest

import live_workers as w
from tenplex.errors import MissingDataError
from tenplex.ptree.config import ParallelConfig
from tenplex.transform import planner
from tenplex_megatron.demo.job import live_spec

recover = importlib.import_module("tenplex_megatron.live.recover")
OLD = NEW = ParallelConfig.parse("dp=2,tp=2,pp=1")


def _tree(distributed):
    return live_spec(w.MODEL, w.options(distributed)).tree(OLD, NEW)


@pytest.mark.parametrize("distributed", [True, False])
def test_survivors_of_one_dp_rank_need_the_checkpoint_only_with_the_distributed_optimizer(
        monkeypatch, distributed):
    # old ranks 0 and 1 (dp rank 0) survive: the model is replicated, the distributed optimizer's
    # dp rank 1 shard is not
    tree = _tree(distributed)
    monkeypatch.setattr(planner, "make_plan", lambda *a, **k: pytest.fail("planned the whole world"))
    assert recover._needs_store(tree, OLD, NEW, {0, 1}, "memory://ckpt") is distributed
    assert recover._needs_store(tree, OLD, NEW, {0, 1, 2, 3}, None) is False


def test_missing_data_without_a_checkpoint_raises_the_planners_error():
    tree = _tree(True)
    with pytest.raises(MissingDataError) as expected:
        planner.make_plan(tree, OLD, NEW, alive={0, 1})
    with pytest.raises(MissingDataError) as got:
        recover._needs_store(tree, OLD, NEW, {0, 1}, None)
    assert str(got.value) == str(expected.value) and got.value.missing == expected.value.missing
