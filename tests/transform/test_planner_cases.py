"""Named resharding cases, several with hand-checked plans."""

import pytest
import torch

from tenplex.errors import MissingDataError, ReplicaMismatchError, ShardError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import (Box, DPShard, FlatBuffer, Layout, ParallelConfig as P, PTree,
                           Sharding, Stage, StageKind, TensorLeaf, assemble, materialize)
from tenplex.transform import Link, OpKind, execute_local, make_plan

from tests.helpers.planning import ops, reshard


SPEC = GPTSpec(num_layers=4, hidden=16, heads=8, query_groups=8, ffn=32, vocab=50, seq_len=8)
FC1 = "model/layers/0/mlp/fc1/weight"


def test_tp8_to_tp2_merges_four_shards_hand_checked():
    tree = gpt_tree(SPEC)
    plan, _ = reshard(tree, P(tp=8), P(tp=2))
    assert ops(plan, FC1, 0) == [
        (0, Box((0, 0), (4, 16)), OpKind.MERGE, Link.LOCAL),
        (1, Box((4, 0), (4, 16)), OpKind.MERGE, Link.HOST),
        (2, Box((8, 0), (4, 16)), OpKind.MERGE, Link.HOST),
        (3, Box((12, 0), (4, 16)), OpKind.MERGE, Link.HOST),
    ]
    fc1_ops = [op for op in plan.ops if op.path == FC1]
    assert sum(op.nbytes for op in fc1_ops) == 32 * 16 * 4


def test_tp1_to_tp2_splits_and_swiglu_parts_split_separately():
    tree = gpt_tree(GPTSpec(num_layers=1, hidden=16, heads=8, query_groups=8, ffn=32, swiglu=True))
    plan, out = reshard(tree, P(tp=1), P(tp=2))
    # fc1 is [gate; up] = [32 + 32, 16]; tp rank 1 holds gate rows 16:32 and up rows 48:64
    assert ops(plan, FC1, 1) == [
        (0, Box((16, 0), (16, 16)), OpKind.SPLIT, Link.HOST),
        (0, Box((48, 0), (16, 16)), OpKind.SPLIT, Link.HOST),
    ]
    assert out[1][FC1].shape == (32, 16)


def test_gqa_qkv_splits_on_whole_query_groups():
    spec = GPTSpec(num_layers=1, hidden=16, heads=8, query_groups=2, ffn=32)
    tree = gpt_tree(spec)
    qkv = "model/layers/0/attention/qkv/weight"
    # 2 groups * (8/2 + 2) heads * head_dim 2 = 24 rows; tp=2 gives one group (12 rows) each
    assert tree[qkv].shape == (24, 16)
    plan, _ = reshard(tree, P(tp=1), P(tp=2))
    assert ops(plan, qkv, 1) == [(0, Box((12, 0), (12, 16)), OpKind.SPLIT, Link.HOST)]


@pytest.mark.parametrize("a,b", [("tp=1", "tp=2"), ("tp=2", "tp=4"), ("tp=4", "tp=8"),
                                 ("tp=8", "tp=4"), ("tp=4", "tp=2"), ("tp=2", "tp=1"),
                                 ("tp=8", "tp=1"), ("tp=1", "tp=8")])
def test_tp_changes(a, b):
    reshard(gpt_tree(SPEC), P.parse(a), P.parse(b))


@pytest.mark.parametrize("a,b", [("pp=1", "pp=2"), ("pp=2", "pp=4"), ("pp=4", "pp=2"),
                                 ("pp=2", "pp=1"), ("pp=2,stages=1:3", "pp=4"),
                                 ("pp=4", "pp=2,stages=3:1"), ("pp=2,stages=1:3", "pp=2,stages=3:1")])
def test_pp_changes(a, b):
    reshard(gpt_tree(SPEC), P.parse(a), P.parse(b))


def test_uneven_stages_move_layers_hand_checked():
    tree = gpt_tree(SPEC)
    plan, _ = reshard(tree, P.parse("pp=2,stages=1:3"), P.parse("pp=4"))
    # layer 2 lives on stage 1 (rank 1) before and on stage 2 (rank 2) after
    assert ops(plan, "model/layers/2/mlp/fc1/weight", 2) == [
        (1, Box((0, 0), (32, 16)), OpKind.KEEP, Link.HOST)]
    # layer 1 stays on stage 1 = rank 1, same device
    assert ops(plan, "model/layers/1/mlp/fc1/weight", 1)[0][3] is Link.LOCAL


PAPER = [((4, 2, 1), (8, 2, 1)), ((4, 2, 1), (4, 4, 1)), ((4, 2, 1), (4, 2, 2))]


@pytest.mark.parametrize("mpd_a,mpd_b", PAPER + [(b, a) for a, b in PAPER])
def test_paper_changes(mpd_a, mpd_b):
    (ta, pa, da), (tb, pb, db) = mpd_a, mpd_b
    reshard(gpt_tree(SPEC), P(dp=da, tp=ta, pp=pa), P(dp=db, tp=tb, pp=pb))


def _held_bytes(tree, config, ranks):
    s = Sharding(tree, config)
    total = 0
    for r in ranks:
        for path, leaf in tree.tensors():
            held = s.holding(path, config.coord(r))
            if held is not None:
                total += held.numel * leaf.itemsize
    return total


def test_paper_dp_doubling_byte_accounting():
    """(M,P,D) (4,2,1) -> (4,2,2): ranks 0-3 keep stage 0, the rest receive copies."""
    tree = gpt_tree(SPEC)
    a, b = P(dp=1, tp=4, pp=2), P(dp=2, tp=4, pp=2)
    plan, _ = reshard(tree, a, b)
    stage0 = _held_bytes(tree, a, range(0, 4))
    stage1 = _held_bytes(tree, a, range(4, 8))
    # the tied embedding (vocab 50 padded to 128 * tp = 512 rows, hidden 16, fp32) also
    # lives on stage 1, so target ranks 4-7 find their embedding shards on their own devices
    embedding = 512 * 16 * 4
    t = plan.totals
    assert t.local == stage0 + embedding     # ranks 0-3 sit on the stage-0 devices
    assert t.host == stage0 - embedding      # ranks 4-7 (host h0) copy the rest of stage 0
    assert t.network == 2 * stage1           # ranks 8-15 (host h1) fetch both stage-1 replicas
    assert t.needed == 2 * stage0 + 2 * stage1


def _dist_opt_tree():
    members = ("w0", "w1", "w2")
    shapes = {"w0": (10,), "w1": (7,), "w2": (5,)}
    leaves = {f"optimizer/exp_avg/{m}": TensorLeaf(shapes[m], "float32",
                                                   Layout(Stage(StageKind.ALL), dp_shard=DPShard("grad", m)))
              for m in members}
    return PTree(leaves, 1, (FlatBuffer("grad", members),))


def test_distributed_optimizer_ranges_hand_checked():
    tree = _dist_opt_tree()
    two, three = Sharding(tree, P(dp=2)), Sharding(tree, P(dp=3))
    w1 = tree["optimizer/exp_avg/w1"]
    # dp=2: 22 elements, 11 each: rank 0 = w0[0:10] + w1[0:1], rank 1 = w1[1:7] + w2[0:5]
    assert two.dp_range(w1, 0, 0) == (0, 1) and two.dp_range(w1, 1, 0) == (1, 7)
    # dp=3: padded to 24, 8 each: w1 = rank 1 [0:6], rank 2 [6:7]
    assert three.dp_range(w1, 1, 0) == (0, 6) and three.dp_range(w1, 2, 0) == (6, 7)
    assert three.dp_range(tree["optimizer/exp_avg/w0"], 2, 0) is None
    plan, out = reshard(tree, P(dp=2), P(dp=3))
    assert ops(plan, "optimizer/exp_avg/w1", 1) == [
        (0, Box((0,), (1,)), OpKind.MERGE, Link.HOST),
        (1, Box((1,), (5,)), OpKind.REPARTITION, Link.LOCAL),
    ]
    assert out[1]["optimizer/exp_avg/w1"].shape == (6,)


@pytest.mark.parametrize("a,b", [(P(dp=2), P(dp=3)), (P(dp=4), P(dp=3)), (P(dp=3), P(dp=4)),
                                 (P(dp=4, tp=2), P(dp=3, tp=2)), (P(dp=2, tp=2), P(dp=3, tp=1, pp=2))])
def test_distributed_optimizer_dp_changes_cross_parameter_boundaries(a, b):
    spec = GPTSpec(num_layers=2, hidden=16, heads=4, query_groups=2, ffn=32, vocab=50,
                   swiglu=True, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=700)
    tree = gpt_tree(spec)
    s = Sharding(tree, a)
    crossing = [p for p, leaf in tree.tensors() if leaf.layout.dp_shard is not None
                and len({d for d in range(a.dp) if s.holding(p, a.coord(a.rank(
                    a.coord(0)._replace(dp=d, pp=s.stages(leaf)[0])))) is not None}) > 1]
    assert crossing, "some parameter's range must span two dp ranks"
    reshard(tree, a, b)


def test_lost_rank_without_replica_is_reported():
    tree = gpt_tree(SPEC)
    with pytest.raises(MissingDataError) as err:
        make_plan(tree, P(tp=2), P(tp=1), alive={0})
    assert FC1 in err.value.missing
    assert err.value.missing[FC1] == [Box((16, 0), (16, 16))]
    assert str(err.value).startswith("24 leaves have regions that no live source holds: "
                                     "model/layers/0/attention/qkv/weight [24:48, 0:16]; ")


def test_lost_rank_with_replica_reads_the_replica():
    tree = gpt_tree(SPEC)
    plan, _ = reshard(tree, P(dp=2, tp=2), P(dp=2, tp=2), alive={0, 1, 3})
    # tp-split leaves of tp rank 0 come from its surviving replica, rank 0; tp-replicated
    # leaves (norms, biases) are spread over every live rank
    assert {op.src_rank for op in plan.ops if op.dst_rank == 2 and op.path == FC1} == {0}
    assert {op.src_rank for op in plan.ops if op.dst_rank == 2} == {0, 1, 3}
    assert plan.totals.moved == _held_bytes(tree, P(dp=2, tp=2), [2])


def test_shards_that_do_not_match_the_tree_are_rejected():
    tree = gpt_tree(SPEC)
    a = P(tp=2)
    state = random_state(tree, a, 0)
    src = {r: materialize(tree, state, a, r) for r in range(2)}
    src[1][FC1] = src[1][FC1].to(torch.bfloat16)
    plan = make_plan(tree, a, P(tp=1))
    with pytest.raises(ShardError, match=f"rank 1, leaf {FC1}: expected dtype float32, found bfloat16"):
        execute_local(plan, tree, src)
    src[1][FC1] = torch.zeros(3, 16)
    with pytest.raises(ShardError, match=r"expected local shape \[16, 16\], found \[3, 16\]"):
        assemble(tree, a, src)
    state["model/final_norm/weight"] = torch.zeros(3)
    with pytest.raises(ShardError, match="model/final_norm/weight: expected \\[16\\] float32"):
        materialize(tree, state, a, 0)


def test_replica_mismatch_names_leaf_and_ranks():
    tree = gpt_tree(SPEC)
    a = P(dp=2)
    state = random_state(tree, a, 0)
    src = {r: materialize(tree, state, a, r) for r in range(2)}
    src[1][FC1][3, 4] += 1
    with pytest.raises(ReplicaMismatchError, match=f"leaf {FC1}: replicas on ranks 0 and 1 differ in 1 elements"):
        assemble(tree, a, src)


def test_tied_embedding_replicas_agree_and_padding_is_reported():
    spec = GPTSpec(num_layers=2, hidden=16, heads=8, query_groups=8, ffn=32, vocab=50,
                   make_vocab_size_divisible_by=16, tied=True)
    tree = gpt_tree(spec)
    emb = "model/embedding/word_embeddings/weight"
    plan, out = reshard(tree, P(tp=1, pp=2), P(tp=4, pp=2))
    # padded vocab: 64 at tp=1 (multiple 16), 64 at tp=4 (multiple 64): nothing created or dropped
    assert plan.padding == ()
    # the last stage's tied copy equals the first stage's
    assert torch.equal(out[0][emb], out[4][emb])
    plan, _ = reshard(tree, P(tp=1), P(tp=8))
    (change,) = plan.padding
    assert (change.logical, change.src_padded, change.dst_padded, change.created) == (50, 64, 128, 64)
    assert plan.totals.fill == 64 * 16 * 4
