"""Own-rank plans: ``make_plan(..., ranks=R, senders=S)`` is the whole plan restricted to R and S.

A process of a live change plans only the ops it receives (target in R) or
sends (source in S); these tests check, op for op, that this is exactly the
whole plan's selection, under random placements (shared hosts, moved
devices) and random survivors, and that the parts' totals add up.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.errors import ConfigError, MissingDataError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig as P
from tenplex.transform import Placement, make_plan
from tenplex.transform.placement import Device
from tenplex.transform.plan import OpTable, Plan

from tests.helpers.strategies import tree_and_configs


@st.composite
def change(draw):
    """A tree, two configs, placements on hosts of 2 devices, and the live source ranks."""
    spec, tree, a, b = draw(tree_and_configs())
    src_pl = Placement.contiguous(a.world_size, per_host=2)
    pool = list(src_pl.devices) + [Device("new", i) for i in range(b.world_size)]
    dst_pl = Placement(tuple(draw(st.permutations(pool))[: b.world_size]))
    dead = draw(st.sets(st.sampled_from(range(a.world_size)), max_size=a.world_size - 1))
    alive = sorted(set(range(a.world_size)) - dead)
    kw = dict(src_placement=src_pl, dst_placement=dst_pl, alive=alive, store_fallback=True)
    return tree, a, b, kw


def _selected(plan: Plan, ranks, senders) -> dict:
    c = plan.table.cols
    keep = np.isin(c["dst"], list(ranks)) | np.isin(c["src"], list(senders))
    return {k: c[k][keep] for k in OpTable.COLUMNS}


@settings(max_examples=60, deadline=None)
@given(change(), st.data())
def test_partial_plan_is_the_whole_plan_restricted(args, data):
    tree, a, b, kw = args
    ranks = data.draw(st.sets(st.sampled_from(range(b.world_size))))
    senders = data.draw(st.sets(st.sampled_from(range(a.world_size))))
    whole = make_plan(tree, a, b, **kw)
    part = make_plan(tree, a, b, ranks=ranks, senders=senders, **kw)
    want = _selected(whole, ranks, senders)
    for k in OpTable.COLUMNS:
        assert np.array_equal(part.table.cols[k], want[k]), k
    assert part.table.paths == whole.table.paths
    assert part.values == tuple(v for v in whole.values if v.dst_rank in ranks)
    assert part.ranks == tuple(sorted(ranks)) and part.senders == tuple(sorted(senders))
    assert Plan.from_json(part.to_json()) == part


@settings(max_examples=40, deadline=None)
@given(change())
def test_one_rank_parts_add_up_to_the_whole_plan(args):
    tree, a, b, kw = args
    whole = make_plan(tree, a, b, **kw)
    parts = [make_plan(tree, a, b, ranks=[r], **kw) for r in range(b.world_size)]
    for field in ("needed", "local", "host", "network", "store", "fill", "lower_bound",
                  "lower_bound_network"):
        assert sum(getattr(p.totals, field) for p in parts) == getattr(whole.totals, field), field
    assert max(p.totals.max_sender for p in parts) <= whole.totals.max_sender
    rows = sum(len(p.table) for p in parts)
    assert rows == len(whole.table)


def test_a_partial_plan_reports_only_its_own_missing_regions():
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=8, heads=2, query_groups=2, ffn=16, vocab=17,
                            seq_len=4))
    a, b = P(dp=1, tp=2), P(dp=1, tp=2)
    with pytest.raises(MissingDataError) as whole:
        make_plan(tree, a, b, alive=[0])
    assert make_plan(tree, a, b, alive=[0], ranks=[0]).totals.moved == 0  # rank 0 keeps its own
    with pytest.raises(MissingDataError) as part:
        make_plan(tree, a, b, alive=[0], ranks=[1])
    assert part.value.missing == whole.value.missing


def test_ranks_outside_the_configs_are_refused():
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=8, heads=2, query_groups=2, ffn=16, vocab=17,
                            seq_len=4))
    with pytest.raises(ConfigError, match="target rank 4 is not a rank of"):
        make_plan(tree, P(dp=2), P(dp=4), ranks=[4])
    with pytest.raises(ConfigError, match="source rank -1 is not a rank of"):
        make_plan(tree, P(dp=2), P(dp=4), senders=[-1])


@pytest.mark.parametrize("dst", [P(dp=1, tp=4), P(dp=4, tp=1)])
def test_every_replica_sends_its_share(dst):
    # the fail-together tests' change (dp 2, tp 2 -> dp 1, tp 4, Adam with replicas): each piece
    # has two live replicas, and the choice between them is a function of the target and the
    # leaf alone; it must still spread the bytes over both, leaf after leaf, as a least-loaded
    # deal does (a rule that sent every leaf from one replica made senders 1.6 KB / 86 KB /
    # 82 KB / 1.6 KB, and a dying peer then hung the survivors that waited on the busy ones)
    from tenplex.transform.template import LOCAL, STORE

    from tests.helpers.elastic_workers import CONFIG, REPLICATED

    plan = make_plan(REPLICATED, CONFIG, dst)
    c = plan.table.cols
    moved = (c["link"] != LOCAL) & (c["link"] != STORE)
    sent = np.bincount(c["src"][moved], weights=c["nbytes"][moved], minlength=4)
    assert sent.min() > 0 and sent.max() <= 1.15 * sent.mean(), sent.tolist()
    parts = [make_plan(REPLICATED, CONFIG, dst, senders=[r]).table.cols for r in range(4)]
    for r, part in enumerate(parts):  # each sender's own plan says the same
        mine = (part["src"] == r) & (part["link"] != LOCAL) & (part["link"] != STORE)
        assert part["nbytes"][mine].sum() == sent[r]


class _OneProcessGuard:
    """What :func:`plan_own_part` uses of a guard, for process ``rank`` of ``size`` whose peers
    gathered the same bytes (one process plays each process in turn)."""

    def __init__(self, rank: int, size: int):
        self.comm = type("Comm", (), {"rank": rank, "size": size})()

    def agreeing(self):
        import contextlib
        return contextlib.nullcontext()

    def phase(self, name):
        pass

    def gather(self, name, data):
        return [data] * self.comm.size


@pytest.mark.parametrize("src,dst", [(P(dp=2, tp=2, pp=1), P(dp=1, tp=2, pp=3)),
                                     (P(dp=1, tp=2, pp=3), P(dp=4, tp=1, pp=1))])
def test_a_small_group_plans_whole_and_a_large_one_its_part_with_the_same_ops(src, dst):
    """Each process's ops (it sends or receives them) are the same from its part (the path of large
    groups) and from the whole plan (groups of up to WHOLE_PLAN_UP_TO); the totals add up alike."""
    from tenplex.ptree.sharding import Sharding
    from tenplex.transform.parts import plan_own_part

    tree = gpt_tree(GPTSpec(num_layers=6, hidden=32, heads=4, query_groups=2, ffn=64, vocab=50,
                            swiglu=True, tied=False, optimizer="distributed_adam"))
    n = max(src.world_size, dst.world_size)
    src_of = [r if r < src.world_size else None for r in range(n)]
    dst_of = [r if r < dst.world_size else None for r in range(n)]
    kw = dict(src_placement=Placement.contiguous(src.world_size), dst_placement=Placement.contiguous(dst.world_size),
              alive=set(range(src.world_size)), store_fallback=False, src_of=src_of, dst_of=dst_of,
              shardings=(Sharding(tree, src), Sharding(tree, dst)))
    whole = make_plan(tree, src, dst, src_placement=kw["src_placement"], dst_placement=kw["dst_placement"],
                      alive=kw["alive"])
    sums = {}
    for whole_up_to in (0, n):  # 0: every group plans its part; n: this group plans whole
        totals = []
        for p in range(n):
            plan, t = plan_own_part(_OneProcessGuard(p, n), "test", tree, src, dst, whole_up_to=whole_up_to, **kw)
            mine = [[r] if r is not None else [] for r in (dst_of[p], src_of[p])]
            got, want = _selected(plan, *mine), _selected(whole, *mine)
            assert all(np.array_equal(got[k], want[k]) for k in OpTable.COLUMNS), (whole_up_to, p)
            assert (plan.ranks is None) == (whole_up_to == n)  # the whole plan, or a part
            totals.append(t)
        sums[whole_up_to] = {f: sum(getattr(t, f) for t in totals) for f in ("needed", "local", "lower_bound")}
    assert sums[0] == sums[n]



@pytest.mark.parametrize("ranks", [[2], [4], [2, 4]])
def test_tiled_leaves_deal_sources_as_their_own_rank_plans_do(ranks):
    """A tp-split leaf is planned for tp rank 0 and tiled over tp ranks only where that is exact.

    Here target ranks 0 and 4 (tp 0) run on the devices of source ranks 1 and 5 (tp 1) and rank 2
    on a new host: a tp-0 plan saw no own-device source for any of them, so it dealt the three
    one position each, where the plan of their own ranks (and an untiled whole plan) groups 0
    and 4 by the source on their devices: the parts chose other senders than the whole plan.
    """
    tree = gpt_tree(GPTSpec(num_layers=1, hidden=8, heads=2, query_groups=2, ffn=16, vocab=16,
                            seq_len=4))
    a = b = P(dp=3, tp=2)
    src_pl = Placement.contiguous(6, per_host=2)  # h0: ranks 0, 1; h1: 2, 3; h2: 4, 5
    d = src_pl.devices
    dst_pl = Placement((d[1], d[0], Device("new", 0), Device("new", 1), d[5], d[4]))
    kw = dict(src_placement=src_pl, dst_placement=dst_pl)
    whole = make_plan(tree, a, b, **kw)
    part = make_plan(tree, a, b, ranks=ranks, **kw)
    want = _selected(whole, ranks, [])
    for k in OpTable.COLUMNS:
        assert np.array_equal(part.table.cols[k], want[k]), k
