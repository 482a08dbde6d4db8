"""Placing new ranks on devices to keep the most bytes in place (an assignment problem)."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.transform import Placement, best_placement, bytes_in_common, make_plan
from tenplex.transform.assign import placement_bound, sparse_weights
from tenplex.transform.placement import Device

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


def _kept(weight, src_pl, placement) -> int:
    """Bytes ``placement`` keeps in place: sum of W[t, source rank on t's device]."""
    index = {d: i for i, d in enumerate(src_pl.devices)}
    return int(sum(weight[t, index[d]] for t, d in enumerate(placement.devices) if d in index))


@settings(max_examples=60, deadline=None)
@given(tree_and_configs(), st.data())
def test_structured_placement_keeps_as_much_as_the_hungarian_method(args, data):
    # oracle: scipy's Hungarian method on the dense W over the given devices (survivors + new)
    spec, tree, a, b = args
    src_pl = Placement.contiguous(a.world_size, per_host=2)
    kept_old = data.draw(st.lists(st.sampled_from(src_pl.devices), unique=True,
                                  max_size=a.world_size), label="surviving old devices")
    new = data.draw(st.integers(max(0, b.world_size - len(kept_old)), b.world_size + 1))
    pool = kept_old + [Device("new", i) for i in range(new)]
    best = best_placement(tree, a, b, src_pl, devices=pool)
    assert len(set(best.devices)) == b.world_size and set(best.devices) <= set(pool)
    weight = bytes_in_common(tree, a, b)
    index = {d: i for i, d in enumerate(src_pl.devices)}
    dense = np.array([[weight[t, index[d]] if d in index else 0 for d in pool]
                      for t in range(b.world_size)], dtype=np.int64).reshape(b.world_size, len(pool))
    rows, cols = linear_sum_assignment(dense, maximize=True)
    assert _kept(weight, src_pl, best) == int(dense[rows, cols].sum())


@settings(max_examples=40, deadline=None)
@given(tree_and_configs(), st.data())
def test_sparse_weights_are_the_dense_weights_of_the_live_sources(args, data):
    spec, tree, a, b = args
    dead = data.draw(st.sets(st.sampled_from(range(a.world_size)), max_size=a.world_size - 1))
    alive = np.zeros(a.world_size + 1, dtype=bool)
    alive[sorted(set(range(a.world_size)) - dead)] = True
    needed, sparse = sparse_weights(tree, a, b, alive)
    dense = bytes_in_common(tree, a, b)
    dense[:, ~alive[:-1]] = 0
    assert np.array_equal(sparse.toarray(), dense)
    assert needed == make_plan(tree, a, b).totals.needed


def test_placement_at_two_thousand_ranks_builds_no_dense_weights():
    # dp 16 -> 32 at tp 8, pp 8 (1024 -> 2048 ranks): the dense W alone is 2048 x 1024 int64
    # (16 MB) and the Hungarian method's matrix 2048 x 2048 (32 MB); by components it needs
    # a sparse W (270 K entries, ~26 MB at its peak while built) and 64 blocks of 32 x 16
    import scipy.optimize
    import scipy.sparse.csgraph  # noqa: F401 (imported before measuring)

    tree = gpt_tree(GPTSpec(num_layers=8, hidden=64, heads=8, query_groups=8, ffn=128, vocab=512,
                            optimizer="distributed_adam"))
    a, b = P(dp=16, tp=8, pp=8), P(dp=32, tp=8, pp=8)
    src_pl = Placement.contiguous(a.world_size)
    tracemalloc.start()
    try:
        best = best_placement(tree, a, b, src_pl)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"best_placement allocated {peak / 2**20:.1f} MB"
    plan = make_plan(tree, a, b, src_placement=src_pl, dst_placement=best)
    assert plan.totals.moved == placement_bound(tree, a, b)  # optimal: it meets the bound


@settings(max_examples=40, deadline=None)
@given(tree_and_configs())
def test_no_placement_moves_less_than_the_placement_bound(args):
    # the bound is valid (the best placement cannot beat it) and tighter than the per-target rule
    spec, tree, a, b = args
    src_pl = Placement.contiguous(a.world_size)
    bound = placement_bound(tree, a, b)
    best = make_plan(tree, a, b, src_placement=src_pl,
                     dst_placement=best_placement(tree, a, b, src_pl)).totals
    assert 0 <= bound <= best.moved
    weight = bytes_in_common(tree, a, b)
    assert bound >= best.needed - int(weight.max(axis=1).sum())


def test_growing_dp_is_bound_by_what_the_old_devices_can_keep():
    # dp 2 -> 4: every new rank finds all it needs on one old device (the per-target rule gives 0),
    # but only 4 old devices keep bytes for 8 new ranks; the best placement meets the bound
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=16, heads=4, query_groups=4, ffn=32, vocab=64,
                            optimizer="distributed_adam"))
    a, b = P(dp=2, tp=2), P(dp=4, tp=2)
    weight = bytes_in_common(tree, a, b)
    src_pl = Placement.contiguous(a.world_size)
    best = make_plan(tree, a, b, src_placement=src_pl,
                     dst_placement=best_placement(tree, a, b, src_pl)).totals
    assert best.needed - int(weight.max(axis=1).sum()) == 0
    assert placement_bound(tree, a, b) == best.moved > 0


def test_best_numbering_keeps_the_given_numbering_where_it_keeps_as_many_bytes():
    # dp 2, tp 2 -> dp 4 with replicated Adam: process p keeping new rank p is optimal, and so is
    # another matching the Hungarian method may return; renumbering (on by default in
    # reconfigure) must not move processes for nothing
    from tenplex.transform.assign import best_numbering

    tree = gpt_tree(GPTSpec(num_layers=2, hidden=8, heads=2, query_groups=2, ffn=16, vocab=17,
                            seq_len=4, optimizer="adam"))
    a, b = P(dp=2, tp=2), P(dp=4)
    src_of = contiguous = [0, 1, 2, 3]

    def moved(dst_of):
        where = Placement(tuple(Device("h", dst_of.index(t)) for t in range(b.world_size)))
        return make_plan(tree, a, b, src_placement=Placement(tuple(Device("h", p) for p in range(4))),
                         dst_placement=where).totals.moved

    other, bound = best_numbering(tree, a, b, src_of, range(4))
    kept, same_bound = best_numbering(tree, a, b, src_of, range(4), given=contiguous)
    assert kept == contiguous and same_bound == bound
    assert moved(kept) == moved(other) == bound
    # where renumbering keeps more, the given numbering is not kept
    c = P(dp=4, tp=1)
    wider = gpt_tree(GPTSpec(num_layers=2, hidden=8, heads=2, query_groups=2, ffn=16, vocab=17,
                             seq_len=4, optimizer="distributed_adam"))
    assert best_numbering(wider, c, P(dp=2), src_of, range(4), given=[0, 1, None, None])[0] \
        != [0, 1, None, None]


def test_contiguous_placement_refuses_a_host_of_no_devices():
    """``tenplex plan --per-host 0`` ended in a ZeroDivisionError from the placement's arithmetic."""
    for kwargs, name in [(dict(per_host=0), "per_host"), (dict(per_host=-2), "per_host"),
                         (dict(first=-1), "first"), (dict(per_host=2.5), "per_host")]:
        with pytest.raises(ConfigError, match=f"Placement.contiguous: {name}: expected an integer"):
            Placement.contiguous(8, **kwargs)
    assert len(Placement.contiguous(np.int64(4), per_host=np.int64(2)).devices) == 4
