"""Renumbering and placing at scale: W by holder classes (tiled over tp ranks), blocks matched once.

``best_numbering`` and ``best_placement`` build ``W`` from per-class terms
(:mod:`tenplex.transform.weights`); these tests pin that down against the dense ``W``
(:func:`~tenplex.transform.assign.bytes_in_common`, computed rank by rank) and the
Hungarian method on it, so the fast path changes no numbering.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csgraph

from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.transform import assign
from tenplex.transform.assign import best_numbering, bytes_in_common, placement_bound, weight_blocks
from tenplex.transform.geometry import LeafGeometry

from tests.helpers.strategies import tree_and_configs


def _dense_components(weight: np.ndarray):
    """``[(targets, sources, W[targets, sources])]``: the connected components of W's nonzero
    pattern that hold a nonzero, ordered by their first target (the rule weight_blocks follows)."""
    n_t, n_s = weight.shape
    graph = np.zeros((n_t + n_s, n_t + n_s), dtype=np.int8)
    graph[:n_t, n_t:] = weight != 0
    _, label = csgraph.connected_components(graph, directed=False)
    out = []
    for c in np.unique(label):
        targets, sources = np.nonzero(label[:n_t] == c)[0], np.nonzero(label[n_t:] == c)[0]
        if weight[np.ix_(targets, sources)].any():
            out.append((targets, sources, weight[np.ix_(targets, sources)]))
    return out


def _reference_numbering(tree, a, b, src_of, alive, given):
    """best_numbering as it was first written (dense W, one Hungarian method per component)."""
    weight = bytes_in_common(tree, a, b)
    process_of = {r: p for p, r in enumerate(src_of) if r is not None}
    live = np.zeros(a.world_size, dtype=bool)
    live[[r for r in alive if r in process_of]] = True
    weight[:, ~live] = 0
    chosen = np.full(b.world_size, -1, dtype=np.int64)
    best = 0
    for targets, sources, w in _dense_components(weight):
        rows, cols = linear_sum_assignment(w, maximize=True)
        chosen[targets[rows]] = [process_of[s] for s in sources[cols].tolist()]
        best += int(w[rows, cols].sum())
    kept = sum(int(weight[new, old]) for old, new in zip(src_of, given or ())
               if old is not None and new is not None)
    if given is not None and kept >= best:
        return list(given), best
    free = [p for p in range(len(src_of)) if p not in set(chosen.tolist())]
    left = np.nonzero(chosen < 0)[0]
    chosen[left] = free[: len(left)]
    dst_of = [None] * len(src_of)
    for t, p in enumerate(chosen.tolist()):
        dst_of[p] = t
    return dst_of, best


@settings(max_examples=30, deadline=None)
@given(tree_and_configs(), st.data())
def test_weight_blocks_are_the_components_of_the_dense_weights(args, data):
    spec, tree, a, b = args
    dead = data.draw(st.sets(st.sampled_from(range(a.world_size)), max_size=a.world_size - 1))
    alive = np.zeros(a.world_size + 1, dtype=bool)
    alive[sorted(set(range(a.world_size)) - dead)] = True
    weight = bytes_in_common(tree, a, b)
    weight[:, ~alive[:-1]] = 0
    needed, blocks = weight_blocks(tree, a, b, alive)
    expected = _dense_components(weight)
    assert len(blocks) == len(expected)
    for block, (targets, sources, w) in zip(blocks, expected):
        assert np.array_equal(block.targets, targets) and np.array_equal(block.sources, sources)
        assert np.array_equal(block.weight, w)


@settings(max_examples=40, deadline=None)
@given(tree_and_configs(), st.data())
def test_best_numbering_is_the_dense_hungarian_numbering(args, data):
    # processes hold old ranks in any order (some join empty), some old ranks are dead, and the
    # given numbering is any permutation: the numbering and the bound are the dense method's
    spec, tree, a, b = args
    size = max(a.world_size, b.world_size) + data.draw(st.integers(0, 1), label="extra processes")
    holders = data.draw(st.permutations(list(range(a.world_size)) + [None] * (size - a.world_size)))
    alive = sorted(data.draw(st.sets(st.sampled_from(range(a.world_size)), min_size=1)))
    given = data.draw(st.permutations(list(range(b.world_size)) + [None] * (size - b.world_size)))
    dst_of, bound = best_numbering(tree, a, b, holders, alive, given=given)
    expected, best = _reference_numbering(tree, a, b, holders, alive, given)
    assert dst_of == expected
    live = np.zeros(a.world_size + 1, dtype=bool)
    live[[r for r in alive if r in holders]] = True
    assert bound == placement_bound(tree, a, b, live)
    # and the result keeps what the Hungarian method on the whole dense W keeps
    weight = bytes_in_common(tree, a, b)
    weight[:, ~live[:-1]] = 0
    per_process = np.array([[weight[t, r] if r is not None else 0 for r in holders]
                            for t in range(b.world_size)], dtype=np.int64).reshape(b.world_size, size)
    rows, cols = linear_sum_assignment(per_process, maximize=True)
    kept = sum(int(weight[t, r]) for r, t in zip(holders, dst_of) if r is not None and t is not None)
    assert kept == int(per_process[rows, cols].sum())


def _stage_tree():
    # 8 layers on pp 4: the two middle stages hold the same layers, so W has equal blocks
    return gpt_tree(GPTSpec(num_layers=8, hidden=16, heads=4, query_groups=4, ffn=32, vocab=64,
                            seq_len=4, optimizer="distributed_adam"))


def test_a_leaf_split_alike_on_both_sides_is_worked_out_for_tp_rank_zero_only(monkeypatch):
    # dp 2 -> 4 at tp 4, pp 2: a split leaf's terms come from tp rank 0's classes, tiled
    seen = []
    init = LeafGeometry.__init__

    def spy(self, src, dst, path, alive_mask, shared=None, tp_coord=None):
        seen.append((path, tp_coord))
        init(self, src, dst, path, alive_mask, shared, tp_coord)

    monkeypatch.setattr(LeafGeometry, "__init__", spy)
    tree, a, b = _stage_tree(), P(dp=2, tp=4, pp=2), P(dp=4, tp=4, pp=2)
    weight_blocks(tree, a, b)
    split = {p for p, leaf in tree.tensors() if leaf.layout.split is not None}
    assert seen and all(t == 0 for p, t in seen if p in split), \
        f"split leaves worked out for every tp rank: {[x for x in seen if x[0] in split][:3]}"
    assert all(t is None for p, t in seen if p not in split)


def test_equal_blocks_are_matched_once(monkeypatch):
    calls = []
    solve = assign._assign
    monkeypatch.setattr(assign, "_assign", lambda w: calls.append(w.shape) or solve(w))
    tree, a, b = _stage_tree(), P(dp=2, tp=2, pp=4), P(dp=4, tp=2, pp=4)
    blocks = weight_blocks(tree, a, b)[1]
    distinct = []
    for block in blocks:
        if not any(np.array_equal(block.weight, d) for d in distinct):
            distinct.append(block.weight)
    assert len(distinct) < len(blocks)  # the middle stages' blocks are equal
    best_numbering(tree, a, b, list(range(16)) + [None] * 16, range(16), given=list(range(32)))
    assert len(calls) == len(distinct), f"{len(calls)} Hungarian runs for {len(distinct)} distinct blocks"


def test_weight_blocks_with_a_lost_tp_group_are_tiled_and_exact(monkeypatch):
    # dp rank 1's tp group is lost whole: the live ranks are the same on every tp rank, so split
    # leaves are still worked out for tp rank 0 alone; a single lost rank breaks that symmetry
    tree, a, b = _stage_tree(), P(dp=2, tp=2, pp=2), P(dp=1, tp=2, pp=2)
    seen = []
    init = LeafGeometry.__init__

    def spy(self, src, dst, path, alive_mask, shared=None, tp_coord=None):
        seen.append(tp_coord)
        init(self, src, dst, path, alive_mask, shared, tp_coord)

    monkeypatch.setattr(LeafGeometry, "__init__", spy)
    for lost, tiled in (({a.rank(a.coord(r)._replace(dp=1)) for r in range(2)}, True), ({3}, False)):
        seen.clear()
        alive = np.ones(a.world_size + 1, dtype=bool)
        alive[sorted(lost)] = alive[-1] = False
        weight = bytes_in_common(tree, a, b)
        weight[:, ~alive[:-1]] = 0
        blocks = weight_blocks(tree, a, b, alive)[1]
        expected = _dense_components(weight)
        assert [(k.targets.tolist(), k.sources.tolist(), k.weight.tolist()) for k in blocks] == \
            [(t.tolist(), s.tolist(), w.tolist()) for t, s, w in expected]
        assert (0 in seen) is tiled, (lost, seen)
