"""Placing new ranks on devices to keep the most bytes in place (an assignment problem)."""

from hypothesis import given

from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.transform import Placement, best_placement, make_plan

from tests.helpers.strategies import tree_and_configs


def test_same_config_on_shuffled_devices_moves_nothing():
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=16, heads=4, query_groups=4, ffn=32, vocab=50))
    config = P(dp=2, tp=2, pp=2)
    shuffled = Placement(tuple(reversed(Placement.contiguous(8).devices)))
    naive = make_plan(tree, config, config, src_placement=shuffled)
    assert naive.totals.moved > 0          # rank r sits where old rank 7 - r was
    best = best_placement(tree, config, config, shuffled)
    plan = make_plan(tree, config, config, src_placement=shuffled, dst_placement=best)
    assert plan.totals.moved == 0 and plan.totals.local == plan.totals.needed


@given(tree_and_configs())
def test_best_placement_never_moves_more_than_the_default(args):
    spec, tree, a, b = args
    src = Placement.contiguous(a.world_size)
    best = best_placement(tree, a, b, src)
    assert len(set(best.devices)) == b.world_size
    default = make_plan(tree, a, b, src_placement=src).totals.moved
    assert make_plan(tree, a, b, src_placement=src, dst_placement=best).totals.moved <= default
