"""Whether the live ranks hold every byte the targets need, checked without planning."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.errors import MissingDataError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.transform import make_plan
from tenplex.transform.weights import first_uncovered

from tests.helpers.strategies import tree_and_configs


def _mask(world, alive):
    mask = np.zeros(world + 1, dtype=bool)
    mask[sorted(alive)] = True
    return mask


@settings(max_examples=40, deadline=None)
@given(tree_and_configs(), st.data())
def test_first_uncovered_is_the_planners_first_missing_leaf(args, data):
    # oracle: the whole plan raises MissingDataError exactly when a leaf is uncovered, naming
    # the first such leaf first; with the store as fallback it then reads from the store
    spec, tree, a, b = args
    alive = data.draw(st.sets(st.sampled_from(range(a.world_size)), min_size=1), label="alive")
    found = first_uncovered(tree, a, b, _mask(a.world_size, alive))
    try:
        make_plan(tree, a, b, alive=alive)
        missing = None
    except MissingDataError as exc:
        missing = next(iter(exc.missing))
    assert found == missing
    stored = make_plan(tree, a, b, alive=alive, store_fallback=True).totals.store
    assert (stored > 0) == (found is not None)


def test_a_lost_tp_group_is_uncovered_only_with_a_sharded_optimizer():
    # dp 2, tp 2: losing both tp ranks of dp rank 1 loses its optimizer shard, not the model
    for optimizer, hole in (("adam", None), ("distributed_adam", "optimizer")):
        tree = gpt_tree(GPTSpec(num_layers=2, hidden=16, heads=4, query_groups=4, ffn=32, vocab=64,
                                optimizer=optimizer))
        a = P(dp=2, tp=2)
        lost = {a.rank(a.coord(0)._replace(dp=1, tp=t)) for t in range(2)}
        found = first_uncovered(tree, a, P(dp=1, tp=2), _mask(4, set(range(4)) - lost))
        assert (found is None) if hole is None else found.startswith(hole), found
