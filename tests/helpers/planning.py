"""Reshard in one process and check everything a plan promises; list a plan's ops for one target."""

from tenplex.models import random_state
from tenplex.ptree import assemble, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.transform import execute_local, make_plan
from tenplex.transform.verify import check_plan


def reshard(tree, a, b, seed: int = 3, **kw):
    """Plan and run ``a -> b`` on a random state of ``tree``; ``kw`` goes to ``make_plan``.

    Checks: every global tensor is the same bit for bit after, the plan covers
    every target element once and reads inside sources, the bytes copied are
    the plan's ``needed``, and nothing moves beyond the lower bound.

    Returns:
        ``(plan, {rank: {path: local tensor}})`` of the targets.
    """
    state = random_state(tree, a, seed)
    src = {r: materialize(tree, state, a, r) for r in range(a.world_size)}
    plan = make_plan(tree, a, b, **kw)
    out, stats = execute_local(plan, tree, src)
    after = assemble(tree, b, out)
    for path, _ in tree.tensors():
        assert bitwise_equal(after[path], state[path]), path
    check_plan(plan, tree)
    assert stats.total == plan.totals.needed
    assert plan.totals.moved == plan.totals.lower_bound
    return plan, out


def ops(plan, path, rank):
    """``[(src_rank, region, kind, link)]`` of target ``rank``'s ops on leaf ``path``."""
    return [(op.src_rank, op.region, op.kind, op.link) for op in plan.ops
            if op.path == path and op.dst_rank == rank]
