"""Choosing the step to recover from snapshots: a coverage check on holder classes, no planning."""

import pytest

from tenplex.errors import MissingDataError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.snapshot_recover import _choose
from tenplex.transform import planner

OLD, NEW = P(dp=2, tp=2), P(dp=1, tp=2)


def _tree(optimizer):
    return gpt_tree(GPTSpec(num_layers=2, hidden=16, heads=4, query_groups=4, ffn=32, vocab=64,
                            optimizer=optimizer))


def _offers(ranks_by_step):
    """Host ``a`` holds, per step, the snapshots of these old ranks (host ``b`` holds none)."""
    return {"a": [[r, step, 0, OLD.to_json()] for step, ranks in ranks_by_step.items() for r in ranks],
            "b": []}


@pytest.fixture
def no_planning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("recovery planned the whole world to choose a step")
    monkeypatch.setattr(planner, "make_plan", refuse)


@pytest.mark.parametrize("optimizer", ["adam", "distributed_adam"])
@pytest.mark.parametrize("store_step", [None, 7, 6])
def test_the_newest_step_the_snapshots_or_a_same_step_checkpoint_cover_is_chosen(no_planning, optimizer,
                                                                                  store_step):
    # step 7: old ranks 0 and 1 (dp rank 0, both tp ranks) survive; step 6: all four do. With
    # replicated Adam step 7 is whole; with the distributed optimizer dp rank 1's shard is lost at
    # step 7, so step 7 needs a checkpoint of step 7, else step 6 is chosen
    tree = _tree(optimizer)
    hosts = ["a", "a", "a", "a"]
    chosen = _choose(lambda old: tree, NEW, hosts, _offers({7: [0, 1], 6: [0, 1, 2, 3]}), store_step,
                     store_step is not None)
    whole_at_7 = optimizer == "adam" or store_step == 7
    step, old, src_of, _ = chosen
    assert (step, old) == ((7 if whole_at_7 else 6), OLD)
    assert src_of == ([0, 1, None, None] if whole_at_7 else [0, 1, 2, 3])


def test_no_step_covered_and_no_checkpoint_chooses_nothing(monkeypatch):
    tree = _tree("distributed_adam")
    plan = planner.make_plan
    calls = []
    monkeypatch.setattr(planner, "make_plan", lambda *a, **k: calls.append(a) or plan(*a, **k))
    assert _choose(lambda old: tree, NEW, ["a", "a"], _offers({7: [0, 1]}), None, False) is None
    assert not calls
    with pytest.raises(MissingDataError):  # the planner agrees: dp rank 1's shard is lost
        plan(tree, OLD, NEW, alive={0, 1})
