"""Experts, expert tp, virtual pipeline chunks and context parallelism: named, hand-checked cases."""

import pytest
import torch
from hypothesis import given, settings

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import Box, ParallelConfig as P, Sharding
from tenplex.transform import Link, OpKind, Placement, best_placement, make_plan

from tests.helpers.planning import ops, reshard
from tests.helpers.strategies import tree_and_configs


MOE = GPTSpec(num_layers=4, hidden=16, heads=4, query_groups=2, ffn=32, vocab=50, seq_len=8,
              swiglu=True, num_experts=4, moe_ffn=16, topk=2, shared_expert_ffn=16,
              expert_bias=True)
DIST = GPTSpec(**{**MOE.__dict__, "optimizer": "distributed_adam", "dtype": "bfloat16",
                  "bucket_numel": 3000})


def expert(g, name="fc1/weight", layer=0):
    return f"model/layers/{layer}/mlp/experts/{g}/{name}"


def keep_fc1(src, link):
    """A whole expert fc1 ``[gate; up] = [16 + 16, hidden 16]`` kept: its two parts (pieces)."""
    return [(src, Box((0, 0), (16, 16)), OpKind.KEEP, link),
            (src, Box((16, 0), (16, 16)), OpKind.KEEP, link)]


def test_ep2_to_ep1_gathers_the_other_ranks_experts():
    tree = gpt_tree(MOE)
    plan, out = reshard(tree, P(dp=2, ep=2), P(dp=2))
    # ep rank 1 (rank 1) held experts 2 and 3; with ep=1 every rank holds all four
    assert ops(plan, expert(3), 0) == keep_fc1(1, Link.HOST)
    assert ops(plan, expert(3), 1) == keep_fc1(1, Link.LOCAL)
    assert ops(plan, expert(1), 1) == keep_fc1(0, Link.HOST)
    per_expert = sum(tree[expert(0, n)].shape[0] * tree[expert(0, n)].shape[1] * 4
                     for n in ("fc1/weight", "fc2/weight"))
    per_expert += sum(tree[expert(0, n)].shape[0] * 4 for n in ("fc1/bias", "fc2/bias"))
    # each rank fetches the two experts it lacks, in each of the 4 layers, and nothing else
    assert plan.totals.moved == 2 * 2 * 4 * per_expert
    assert set(out[0]) == set(out[1]) and expert(2) in out[0]


def test_ep1_to_ep2_keeps_every_byte_in_place():
    tree = gpt_tree(GPTSpec(**{**MOE.__dict__, "optimizer": "adam"}))
    plan, out = reshard(tree, P(dp=2), P(dp=2, ep=2))
    assert plan.totals.moved == 0 and plan.totals.local == plan.totals.needed
    assert ops(plan, expert(3), 1) == keep_fc1(1, Link.LOCAL)
    assert ops(plan, expert(3), 0) == [] and expert(3) not in out[0]
    assert expert(3, layer=2) in out[1] and f"optimizer/exp_avg/{expert(2)}" in out[1]


def test_tp2_ep1_to_tp1_ep2_merges_expert_shards():
    tree = gpt_tree(MOE)
    plan, _ = reshard(tree, P(tp=2), P(dp=2, ep=2))
    # etp rank t held gate rows [8t, 8t+8) and up rows [16+8t, 16+8t+8) of every expert
    assert ops(plan, expert(0), 0) == [
        (0, Box((0, 0), (8, 16)), OpKind.MERGE, Link.LOCAL),
        (1, Box((8, 0), (8, 16)), OpKind.MERGE, Link.HOST),
        (0, Box((16, 0), (8, 16)), OpKind.MERGE, Link.LOCAL),
        (1, Box((24, 0), (8, 16)), OpKind.MERGE, Link.HOST)]
    assert ops(plan, expert(0), 1) == []              # expert 0 lives on ep rank 0 only
    assert len(ops(plan, expert(2), 1)) == 4


def test_etp_differs_from_tp():
    """tp=2 with etp=1, ep=2 -> tp=2 (etp=2, ep=1): whole experts are split over expert tp."""
    tree = gpt_tree(MOE)
    a, b = P(tp=2, etp=1, ep=2), P(tp=2)
    assert Sharding(tree, a).holding(expert(3, "fc2/weight"), a.coord(1)).shape == (16, 16)
    plan, _ = reshard(tree, a, b)
    cols = Box((0, 8), (16, 8))                        # etp rank 1's half of fc2's columns
    assert ops(plan, expert(3, "fc2/weight"), 1) == [(1, cols, OpKind.SPLIT, Link.LOCAL)]
    assert ops(plan, expert(0, "fc2/weight"), 1) == [(0, cols, OpKind.SPLIT, Link.HOST)]
    # dense tensors follow tp, which did not change
    qkv = "model/layers/0/attention/qkv/weight"
    assert [(s, k, link) for s, _, k, link in ops(plan, qkv, 1)] == [(1, OpKind.KEEP, Link.LOCAL)]


def test_pp2_vpp2_to_pp1():
    tree = gpt_tree(DIST)
    a = P(pp=2, vpp=2)
    # chunks: stage 0 holds layers [0] and [2], stage 1 holds [1] and [3]
    fc1 = "model/layers/{}/mlp/shared_experts/fc1/weight"
    assert [Sharding(tree, a).places(tree[fc1.format(i)]) for i in range(4)] == [
        ((0, 0),), ((1, 0),), ((0, 1),), ((1, 1),)]
    plan, _ = reshard(tree, a, P(dp=2))
    assert ops(plan, fc1.format(2), 0) == keep_fc1(0, Link.LOCAL)
    assert ops(plan, fc1.format(1), 0) == keep_fc1(1, Link.HOST)
    assert ops(plan, fc1.format(3), 1) == keep_fc1(1, Link.LOCAL)


def test_pp1_to_pp2_vpp2():
    tree = gpt_tree(DIST)
    plan, out = reshard(tree, P(dp=2), P(pp=2, vpp=2))
    # rank 1 is stage 1: layers 1 and 3, which its dp replica already held; layers 0 and 2 leave
    layers = {p.split("/")[2] for p in out[1] if p.startswith("model/layers/")}
    assert layers == {"1", "3"}
    assert all(op.link is Link.LOCAL for op in plan.ops if op.dst_rank == 1
               and op.path.startswith("model/layers/"))


def test_vpp_change_moves_layers_between_stages():
    tree = gpt_tree(DIST)
    plan, _ = reshard(tree, P(dp=2, pp=2, vpp=2), P(dp=2, pp=2))
    # layer 1: stage 1 chunk 0 (ranks 2, 3) -> stage 0 (ranks 0, 1)
    moved = ops(plan, "model/layers/1/mlp/router/weight", 0)
    assert moved == [(2, Box((0, 0), (4, 16)), OpKind.KEEP, Link.HOST)]


def test_cp2_to_dp2_with_the_distributed_optimizer_moves_nothing():
    """Megatron shards the dense distributed optimizer over dp x cp: cp=2 and dp=2 agree."""
    tree = gpt_tree(DIST)
    a, b = P(cp=2), P(dp=2)
    s = Sharding(tree, a)
    optimizer = [p for p, leaf in tree.tensors() if leaf.layout.dp_shard is not None]
    held = {p: [s.holding(p, a.coord(r)) for r in range(2)] for p in optimizer}
    # the cp ranks hold different ranges of each bucket: some tensors are cut between them
    opt = next(p for p in optimizer if None not in held[p] and "exp_avg/" in p)
    assert held[opt][0].shape != (0,) and held[opt][0].pieces != held[opt][1].pieces
    plan, out = reshard(tree, a, b)
    assert plan.totals.moved == 0 and plan.totals.local == plan.totals.needed > 0
    assert out[1][opt].shape == held[opt][1].shape
    # with ep=1 the experts' state sits in the same dense buffer, sharded over dp x cp too
    exp = f"optimizer/exp_avg/{expert(3)}"
    holdings = [s.holding(exp, a.coord(r)) for r in range(2)]
    assert sum(h.numel for h in holdings if h is not None) == 32 * 16   # no replica: one copy


def test_cp_and_expert_dp_replicas_serve_a_lost_rank():
    tree = gpt_tree(GPTSpec(**{**MOE.__dict__, "optimizer": "adam"}))
    # cp=2: rank 1 is rank 0's replica for every weight
    plan, _ = reshard(tree, P(cp=2), P(cp=2), alive={0})
    assert {op.src_rank for op in plan.ops if op.kind is not OpKind.FILL} == {0}
    # dp=4, ep=2: expert 3 lives on ep rank 1 = ranks 1 and 3 (edp replicas)
    a = P(dp=4, ep=2)
    assert Sharding(tree, a).ranks_holding(expert(3)) == (1, 3)
    plan, _ = reshard(tree, a, a, alive={0, 1, 2})
    assert ops(plan, expert(3), 3) == keep_fc1(1, Link.HOST)


def test_best_placement_with_experts_and_cp():
    tree = gpt_tree(DIST)
    config = P(dp=2, cp=2, ep=2, etp=1, tp=2)
    shuffled = Placement(tuple(reversed(Placement.contiguous(8).devices)))
    best = best_placement(tree, config, config, shuffled)
    plan = make_plan(tree, config, config, src_placement=shuffled, dst_placement=best)
    assert plan.totals.moved == 0


@pytest.mark.parametrize("spec,target,message", [
    (MOE, P(dp=3, ep=3), r"ep=3 does not divide num_moe_experts=4 \(model/layers/0/mlp/experts/0"),
    (MOE, P(dp=2, pp=2, vpp=2), None),
    (MOE, P(pp=2, vpp=4), r"vpp=4 does not divide the 2 layers of stage 0"),
    (MOE, P(pp=3), r"pp=3 does not divide num_layers=4"),
    (MOE, P(tp=4), r"tp=4 does not divide num_query_groups=2"),
    (GPTSpec(**{**MOE.__dict__, "moe_ffn": 12}), P(dp=8, etp=8),
     r"etp=8 does not divide moe_ffn_hidden_size=12"),
    (DIST, P(cp=2, etp=2), r"with ep=1 the experts' distributed-optimizer state is sharded over "
                           r"dp-cp groups .* use etp=1 or etp=tp"),
])
def test_impossible_targets_name_their_constraint(spec, target, message):
    tree = gpt_tree(spec)
    if message is None:
        make_plan(tree, P(dp=2), target)       # a possible target, for contrast
        return
    with pytest.raises(ConfigError, match=message):
        make_plan(tree, P(dp=2), target)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dp=2, ep=4), r"etp\*ep\*pp=4 does not divide the world size 2"),
    (dict(dp=2, vpp=2), r"vpp=2 needs pp > 1"),
    (dict(dp=2, pp=2, ep=2, order=("tp", "pp", "ep", "dp")), r"pp last in order or edp == dp"),
    (dict(dp=2, cp=2, order=("tp", "dp", "pp")), None),
])
def test_impossible_configs_name_their_constraint(kwargs, message):
    if message is None:                         # cp missing from order: placed after tp
        assert P(**kwargs).order == ("tp", "cp", "dp", "pp")
        return
    with pytest.raises(ConfigError, match=message):
        P(**kwargs)


@settings(max_examples=25)
@given(tree_and_configs(optimizer="distributed_adam", moe=True))
def test_moe_distributed_optimizer_reshard_is_bit_exact(args):
    """Expert parts, per-chunk buffers and dp x cp sharding, for any pair of MoE configs."""
    spec, tree, a, b = args
    plan, out = reshard(tree, a, b)
    # the expert bias buffer is replicated and not optimized
    if spec.expert_bias:
        bias = "model/layers/0/mlp/router/expert_bias"
        held = [r for r in range(b.world_size) if bias in out[r]]
        assert len(held) == len(Sharding(tree, b).ranks_holding(bias))
        assert all(torch.equal(out[held[0]][bias], out[r][bias]) for r in held)
