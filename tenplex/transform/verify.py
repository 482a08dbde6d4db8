"""Check a plan against its tree: exact coverage and reads inside source regions.

These checks are independent of how the planner works: they rebuild every
target rank's holdings from the tree and count, element by element, how
often each op writes there.
"""

from __future__ import annotations

import torch

from tenplex.errors import PlanError
from tenplex.ptree.region import contains, relative, to_slices, volume
from tenplex.ptree.shards import piece_view
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.plan import STORE_RANK, Link, OpKind, Plan

__all__ = ["check_plan"]


def check_plan(plan: Plan, tree: PTree) -> None:
    """Raise PlanError unless ``plan`` is sound for ``tree``.

    Checks that:

    - every element of every target rank's shard is written exactly once;
    - every copy reads only inside a piece its live source rank holds;
    - ``nbytes`` of each op matches its region, and the totals add up.

    Cost: one int8 counter per target element (tests and small trees).

    Raises:
        PlanError: naming the leaf, rank and region at fault.
    """
    S, D = plan.src_sharding(tree), plan.dst_sharding(tree)
    alive = set(plan.alive)
    counters: dict = {}
    totals = {"needed": 0, "fill": 0}
    for op in plan.ops:
        leaf = tree[op.path]
        held = D.holding(op.path, plan.dst.coord(op.dst_rank))
        if held is None or not 0 <= op.dst_piece < len(held.pieces):
            raise PlanError(f"op {op.path} -> rank {op.dst_rank}: target holds no piece {op.dst_piece}")
        tpiece = held.pieces[op.dst_piece]
        if not contains(tpiece.box, op.region):
            raise PlanError(f"op {op.path} -> rank {op.dst_rank}: region {op.region} lies outside "
                            f"target piece {tpiece.box}")
        n = volume(op.region)
        if op.nbytes != n * leaf.itemsize:
            raise PlanError(f"op {op.path} {op.region}: nbytes {op.nbytes}, expected {n * leaf.itemsize}")
        if op.kind is OpKind.FILL:
            totals["fill"] += op.nbytes
        else:
            totals["needed"] += op.nbytes
            if op.link is not Link.STORE:
                _check_source(op, S, plan, alive)
            elif op.src_rank != STORE_RANK:
                raise PlanError(f"op {op.path}: a store read names rank {op.src_rank}")
        key = (op.dst_rank, op.path)
        if key not in counters:
            counters[key] = torch.zeros(held.shape, dtype=torch.int8)
        view = piece_view(counters[key], tpiece)[to_slices(relative(op.region, tpiece.box))]
        view += 1
    for rank in range(plan.dst.world_size):
        coord = plan.dst.coord(rank)
        for path, _ in tree.tensors():
            held = D.holding(path, coord)
            if held is None:
                continue
            count = counters.get((rank, path))
            if count is None or not bool((count == 1).all()):
                bad = "never" if count is None or int(count.max()) == 0 else (
                    "twice or more" if int(count.max()) > 1 else "never")
                raise PlanError(f"plan: rank {rank}, leaf {path}: some elements are written {bad}")
    if totals["needed"] != plan.totals.needed or totals["fill"] != plan.totals.fill:
        raise PlanError(f"plan totals {plan.totals} do not match its ops {totals}")


def _check_source(op, S: Sharding, plan: Plan, alive: set) -> None:
    if op.src_rank not in alive:
        raise PlanError(f"op {op.path}: reads from rank {op.src_rank}, which is not alive")
    held = S.holding(op.path, plan.src.coord(op.src_rank))
    if held is None or not 0 <= op.src_piece < len(held.pieces):
        raise PlanError(f"op {op.path}: source rank {op.src_rank} holds no piece {op.src_piece}")
    if not contains(held.pieces[op.src_piece].box, op.region):
        raise PlanError(f"op {op.path}: region {op.region} lies outside source rank "
                        f"{op.src_rank}'s piece {held.pieces[op.src_piece].box}")
