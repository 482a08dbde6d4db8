"""The in-process executor: run a Plan over shards held in one process.

Used by the offline tool and the tests. Target shards are allocated, every
op copies exactly its region (``dst_view.copy_(src_view)``) and nothing
else is read or written. Ops run on a thread pool (torch releases the GIL
inside copies), grouped by target rank so that no two threads write the
same tensor at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from tenplex.errors import PlanError, ShardError
from tenplex.ptree.region import relative, to_slices
from tenplex.ptree.shards import check_shard, piece_view
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, torch_dtype
from tenplex.transform.plan import Link, OpKind, Plan

__all__ = ["ExecStats", "execute_local", "allocate"]


@dataclass
class ExecStats:
    """What an executor did.

    Attributes:
        bytes_copied: bytes copied by ops other than FILL, by link name.
        bytes_filled: bytes of zero-filled padding.
        ops: ops run.
    """

    bytes_copied: dict[str, int] = field(default_factory=dict)
    bytes_filled: int = 0
    ops: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes_copied.values())


def allocate(tree: PTree, sharding: Sharding, rank: int) -> dict[str, torch.Tensor]:
    """Uninitialized local tensors for every tensor leaf ``rank`` holds."""
    coord = sharding.config.coord(rank)
    out = {}
    for path, leaf in tree.tensors():
        held = sharding.holding(path, coord)
        if held is not None:
            out[path] = torch.empty(held.shape, dtype=torch_dtype(leaf.dtype))
    return out


def execute_local(plan: Plan, tree: PTree, src_shards: Mapping[int, Mapping[str, Any]], *,
                  threads: int = 4, dst_ranks=None) -> tuple[dict[int, dict[str, Any]], ExecStats]:
    """Run ``plan`` in one process.

    Args:
        plan: a plan for ``tree`` from ``plan.src`` to ``plan.dst``.
        tree: the tree spec.
        src_shards: ``{src rank: local shards}``; only the ranks the plan
            reads from are needed.
        threads: worker threads.
        dst_ranks: target ranks to build (default all).

    Returns:
        ``({dst rank: local shards}, stats)``.

    Raises:
        PlanError: if the plan reads a rank or leaf ``src_shards`` lacks, or
            has STORE reads (the store executor runs those).
        ShardError: if a source shard has the wrong shape or dtype.
    """
    S, D = plan.src_sharding(tree), plan.dst_sharding(tree)
    ranks = range(plan.dst.world_size) if dst_ranks is None else sorted(dst_ranks)
    out = {r: allocate(tree, D, r) for r in ranks}
    for op in plan.values:
        if op.dst_rank in out:
            out[op.dst_rank][op.path] = (src_shards[op.src_rank][op.path]
                                         if op.src_rank >= 0 else None)
    by_rank: dict[int, list] = {r: [] for r in ranks}
    for op in plan.ops:
        if op.dst_rank in by_rank:
            by_rank[op.dst_rank].append(op)
    _check_sources(plan, tree, S, src_shards, by_rank)
    stats = ExecStats()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for part in pool.map(lambda r: _run_rank(by_rank[r], S, D, src_shards, out[r]), ranks):
            for link, n in part.bytes_copied.items():
                stats.bytes_copied[link] = stats.bytes_copied.get(link, 0) + n
            stats.bytes_filled += part.bytes_filled
            stats.ops += part.ops
    return out, stats


def _check_sources(plan, tree, S, src_shards, by_rank) -> None:
    checked = set()
    for ops in by_rank.values():
        for op in ops:
            if op.link is Link.STORE:
                raise PlanError(f"plan reads {op.path} {op.region} from a store; "
                                "use the store executor")
            if op.kind is OpKind.FILL or (op.src_rank, op.path) in checked:
                continue
            shards = src_shards.get(op.src_rank)
            if shards is None or op.path not in shards:
                raise PlanError(f"plan reads leaf {op.path} from rank {op.src_rank}, "
                                "which the given source shards lack")
            held = S.holding(op.path, plan.src.coord(op.src_rank))
            check_shard(op.path, tree[op.path], held, shards[op.path], op.src_rank)
            checked.add((op.src_rank, op.path))


def _run_rank(ops, S: Sharding, D: Sharding, src_shards, dst) -> ExecStats:
    stats = ExecStats()
    held_memo: dict = {}
    for op in ops:
        target = dst[op.path]
        tpiece = _holding(D, op.path, op.dst_rank, held_memo).pieces[op.dst_piece]
        tview = piece_view(target, tpiece)[to_slices(relative(op.region, tpiece.box))]
        if op.kind is OpKind.FILL:
            tview.zero_()
            stats.bytes_filled += op.nbytes
        else:
            spiece = _holding(S, op.path, op.src_rank, held_memo).pieces[op.src_piece]
            source = src_shards[op.src_rank][op.path]
            tview.copy_(piece_view(source, spiece)[to_slices(relative(op.region, spiece.box))])
            stats.bytes_copied[op.link.value] = stats.bytes_copied.get(op.link.value, 0) + op.nbytes
        stats.ops += 1
    return stats


def _holding(sharding: Sharding, path: str, rank: int, memo: dict):
    key = (id(sharding), path, rank)
    held = memo.get(key)
    if held is None:
        held = memo[key] = sharding.holding(path, sharding.config.coord(rank))
        if held is None:
            raise ShardError(f"rank {rank} holds no part of {path} under {sharding.config}")
    return held
