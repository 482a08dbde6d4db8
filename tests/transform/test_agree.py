"""Agree before any byte moves, in one process: plan digests, and local states checked against the tree."""

import numpy as np
import pytest
import torch

import tenplex
from tenplex.errors import PlanError, ShardError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.transform import make_plan
from tenplex.transform.agree import check_same_inputs, check_same_plan
from tenplex.transform.plan import OpTable, Plan

TREE = gpt_tree(GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=4, ffn=64, vocab=100,
                        dtype="bfloat16", optimizer="distributed_adam", bucket_numel=500))


# -- Plan.digest and hash ------------------------------------------------------------------

def test_equal_plans_have_equal_digests_and_hashes():
    a = make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4))
    b = make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4))
    assert a == b and a.digest() == b.digest() and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert Plan.from_json(a.to_json()).digest() == a.digest()


@pytest.mark.parametrize("other", [
    lambda: make_plan(TREE, P(dp=2, tp=2), P(dp=4, tp=1)),
    lambda: make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4), alive={0, 1, 3}, store_fallback=True),
    lambda: make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4), alive={0, 1}, store_fallback=True),
])
def test_different_plans_have_different_digests(other):
    assert make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4)).digest() != other().digest()


def test_a_plan_cannot_change_after_it_is_built():
    plan = make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4))
    for name, column in plan.table.cols.items():
        with pytest.raises(ValueError, match="read-only"):
            column[...] = 0


def test_one_changed_op_changes_the_digest():
    plan = make_plan(TREE, P(dp=2, tp=2), P(dp=1, tp=4))
    cols = {k: v.copy() for k, v in plan.table.cols.items()}
    cols["nbytes"][len(cols["nbytes"]) // 2] += 1
    changed = OpTable(plan.table.paths, plan.table.ndims, cols)
    assert changed.digest() != plan.table.digest()
    assert OpTable.empty().digest() == OpTable.empty().digest()


def test_agreement_errors_name_what_differs():
    with pytest.raises(PlanError, match=r"dst is \{\"dp\": 1\} on process 0 but \{\"dp\": 2\} on process 2"):
        check_same_inputs("reconfigure", [{"inputs": {"dst": {"dp": 1}}}] * 2
                          + [{"inputs": {"dst": {"dp": 2}}}])
    with pytest.raises(PlanError, match=r"processes \[1\] computed a plan different"):
        check_same_plan("reconfigure", ["aa", "bb", "aa"])


# -- local states are checked, never cast ----------------------------------------------------

def _local():
    x = random_state(TREE, P(), 3)
    return materialize(TREE, x, P(), 0)


def test_a_one_process_reconfigure_keeps_the_state_bit_for_bit():
    local = _local()
    out, report = tenplex.reconfigure(local, TREE, P(), P())
    assert all(bitwise_equal(out[p], t) for p, t in local.items() if isinstance(t, torch.Tensor))
    assert report.sent == 0 and report.local > 0


def test_a_bf16_tensor_where_the_tree_says_fp32_is_refused_not_cast():
    local = _local()
    path = next(p for p, leaf in TREE.tensors() if leaf.dtype == "float32")
    local[path] = local[path].to(torch.bfloat16)
    with pytest.raises(ShardError, match=rf"process 0 \(old rank 0, new rank 0\): leaf {path}: "
                                         r"expected dtype float32, found bfloat16"):
        tenplex.reconfigure(local, TREE, P(), P())


@pytest.mark.parametrize("change, expected", [
    (lambda t: None, "missing \\(expected a bfloat16 tensor of shape"),
    (lambda t: t[:-1], "expected local shape"),
    (lambda t: t.t(), "expected local shape|expected a contiguous tensor"),
    (lambda t: t.to("meta"), "expected device cpu, found meta"),
    (lambda t: t.float().numpy(), "expected a bfloat16 tensor, found ndarray"),
])
def test_every_mismatch_of_a_local_tensor_is_refused(change, expected):
    local = _local()
    path = "model/layers/0/mlp/fc1/weight"
    changed = change(local[path])
    if changed is None:
        del local[path]
    else:
        local[path] = changed
    with pytest.raises(ShardError, match=expected):
        tenplex.reconfigure(local, TREE, P(), P())


def test_a_value_leaf_that_is_not_json_is_refused():
    local = _local()
    local["optimizer/step"] = np.int64(3)
    with pytest.raises(ShardError, match="value leaf optimizer/step: not JSON-serializable"):
        tenplex.reconfigure(local, TREE, P(), P())


def test_recover_without_a_declared_old_rank_is_refused():
    with pytest.raises(PlanError, match=r"processes \[0\] hold a local state but declare no old rank"):
        tenplex.recover(_local(), TREE, P(), P(), lost=set())
    out, _ = tenplex.recover(_local(), TREE, P(), P(), lost=set(), old_rank=0)
    assert out is not None
