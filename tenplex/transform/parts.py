"""Each process plans its own part of a live change; the processes agree on the plan's inputs.

Every source choice of the planner is a function of the target, the leaf
and the live ranks alone (:func:`~tenplex.transform.planner.deal`), so the
ops that touch a process are the same whether it plans them alone or plans
the whole world. :func:`plan_own_part` plans, in two steps, what the
executor (:func:`~tenplex.transform.distributed.execute_distributed`) reads
of the plan on this process:

1. the ops this process receives (its new rank is their target) and sends
   (its old rank is their source): its **peers** are the other ends;
2. the ops that touch this process or one of its peers. The executor sizes
   the chunks of the stream between two processes from both ends' numbers of
   streams and store reads (:func:`~tenplex.transform.streams.chunk_shares`),
   which these ops give exactly, so both ends size it alike.

The cost grows with what this process and its peers hold, never with the
world. One gather then carries a digest of the plan's inputs
(:func:`inputs_digest`), which must be the same everywhere, and the regions
of this process's targets that no live rank holds, so that a
:class:`~tenplex.errors.MissingDataError` is raised on every process alike,
listing every process's regions.

A group of up to :data:`WHOLE_PLAN_UP_TO` processes plans the whole world in
one call instead: there a part's two calls cost more than one. Where the
caller's own gather already compared the arguments, the tree's digest and
:func:`planner_version` (``agreed=``, as :func:`tenplex.reconfigure` does),
such a group gathers nothing more: every process plans the same world from
the same inputs and raises the same errors.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
import xxhash

from tenplex.errors import MissingDataError, PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.agree import tree_digest
from tenplex.transform.guard import TransferGuard
from tenplex.transform.placement import Placement
from tenplex.transform.plan import FILL_CODE, LINK_CODE, PLAN_SCHEMA, Link, Plan, Totals
from tenplex.transform.planner import RULES, make_plan, missing_message

__all__ = ["inputs_digest", "peers_of", "plan_own_part", "planner_version", "WHOLE_PLAN_UP_TO"]

WHOLE_PLAN_UP_TO = 8
"""Groups of up to this many processes plan the whole world instead of their part: one planner
call where a part takes two, and in a small world the calls cost the same (``bench/reconfigure.py``,
4 processes: the whole plan 7.7 ms, a process's own ops 9 ms, then its peers' 9 ms). The executor
reads the same ops from either. The environment variable ``TENPLEX_WHOLE_PLAN_UP_TO`` overrides
it (the tests set 0 to run small groups by parts)."""

_STORE = LINK_CODE[Link.STORE]


def planner_version() -> list:
    """The planner's schema, rules and numpy's version (its choices are computed with numpy):
    processes that agree on it and on a plan's inputs compute the same plan."""
    return [PLAN_SCHEMA, RULES, np.__version__]


def inputs_digest(tree: PTree, src: ParallelConfig, dst: ParallelConfig, src_placement: Placement,
                  dst_placement: Placement, alive: Sequence[int], store_fallback: bool,
                  tree_hex: str | None = None) -> str:
    """xxh3-128 hex digest of everything a plan depends on (and of :func:`planner_version`).

    Two processes with equal digests compute equal plans, and equal parts of them: what
    comparing :meth:`Plan.digest` checked, without planning the whole world. ``tree_hex``:
    :func:`~tenplex.transform.agree.tree_digest` of ``tree`` where the caller holds it.
    """
    head = {"planner": planner_version(), "tree": tree_hex or tree_digest(tree),
            "src": src.to_json(), "dst": dst.to_json(), "src_placement": src_placement.to_json(),
            "dst_placement": dst_placement.to_json(), "alive": sorted(int(r) for r in alive),
            "store_fallback": bool(store_fallback)}
    return xxhash.xxh3_128_hexdigest(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())


def peers_of(plan: Plan, src_of: Sequence[int | None], dst_of: Sequence[int | None],
             me: int) -> set[int]:
    """The processes other than ``me`` that ``me`` sends to or receives from under ``plan``
    (a plan that holds at least the ops ``me`` sends and receives)."""
    proc_src = {r: p for p, r in enumerate(src_of) if r is not None}
    proc_dst = {r: p for p, r in enumerate(dst_of) if r is not None}
    c = plan.table.cols
    moving = (c["kind"] != FILL_CODE) & (c["link"] != _STORE) & (c["src"] >= 0)
    peers: set = set()
    if src_of[me] is not None:
        peers |= {proc_dst[d] for d in np.unique(c["dst"][moving & (c["src"] == src_of[me])]).tolist()}
    if dst_of[me] is not None:
        peers |= {proc_src[s] for s in np.unique(c["src"][moving & (c["dst"] == dst_of[me])]).tolist()}
    return peers - {me}


def plan_own_part(guard: TransferGuard, what: str, tree: PTree, src: ParallelConfig,
                  dst: ParallelConfig, *, src_placement: Placement, dst_placement: Placement,
                  alive: set, store_fallback: bool, src_of: Sequence[int | None],
                  dst_of: Sequence[int | None], shardings: tuple[Sharding, Sharding],
                  whole_up_to: int | None = None, agreed: str | None = None) -> tuple[Plan, Totals]:
    """This process's part of the plan, agreed with every process of ``guard``.

    Args:
        guard: the transition's guard (entered; its comm is the group).
        what: the operation's name, for messages.
        tree, src, dst, src_placement, dst_placement, alive, store_fallback:
            as :func:`~tenplex.transform.planner.make_plan`.
        src_of, dst_of: per process, its old and new rank (or ``None``).
        shardings: ``(Sharding(tree, src), Sharding(tree, dst))``.
        whole_up_to: a group of at most this many processes plans the whole world
            (default ``TENPLEX_WHOLE_PLAN_UP_TO`` from the environment, else
            :data:`WHOLE_PLAN_UP_TO`).
        agreed: the tree's digest, where the caller's gather has already checked that every
            process was called with the same arguments and tree and runs the same
            :func:`planner_version` (and the placements and live ranks follow from what that
            gather gave every process alike). A group that plans the whole world then
            gathers nothing more: every process plans the same ops from the same inputs, and
            raises the same MissingDataError. ``None``: agree on the inputs' digest here.

    Returns:
        ``(plan, totals)``: the partial plan (every op that touches this
        process or one of its peers, in the whole plan's order), or the whole
        plan in a small group, and the totals of this process's own target (zero
        if it has none; in a small group, the whole plan's on process 0 and zero
        elsewhere); summed over the processes they are the whole plan's (but
        ``max_sender``).

    Raises:
        PlanError: the processes' input digests differ; on every process.
        MissingDataError: some process's target needs a region no live rank
            (and no store) holds; on every process, listing them all.
        ConfigError: ``dst`` cannot hold the tree (on every process alike).
    """
    me = guard.comm.rank
    if whole_up_to is None:
        whole_up_to = int(os.environ.get("TENPLEX_WHOLE_PLAN_UP_TO", WHOLE_PLAN_UP_TO))
    whole = guard.comm.size <= whole_up_to
    if whole and agreed is not None:  # every process plans the same world from agreed inputs
        with guard.agreeing():  # a ConfigError or MissingDataError is raised everywhere alike
            plan = make_plan(tree, src, dst, src_placement=src_placement, dst_placement=dst_placement,
                             alive=alive, store_fallback=store_fallback, src_sharding=shardings[0],
                             dst_sharding=shardings[1])
        guard.phase("agree")
        return plan, plan.totals if me == 0 else Totals()
    digest = inputs_digest(tree, src, dst, src_placement, dst_placement, alive, store_fallback, agreed)
    common = dict(src_placement=src_placement, dst_placement=dst_placement, alive=alive,
                  store_fallback=store_fallback, src_sharding=shardings[0], dst_sharding=shardings[1])
    missing: dict = {}
    plan, totals = None, Totals()
    with guard.agreeing():  # a ConfigError (dst cannot hold the tree) is raised everywhere alike
        try:
            if whole:
                plan = make_plan(tree, src, dst, **common)
                totals = plan.totals if me == 0 else Totals()
            else:
                own = make_plan(tree, src, dst, ranks=_ranks([dst_of[me]]), senders=_ranks([src_of[me]]),
                                **common)
                totals = own.totals
                group = sorted(peers_of(own, src_of, dst_of, me) | {me})
                plan = make_plan(tree, src, dst, ranks=_ranks(dst_of[p] for p in group),
                                 senders=_ranks(src_of[p] for p in group), **common)
        except MissingDataError as exc:  # only some processes see it: raised after the gather
            missing = {p: [[list(b.offsets), list(b.sizes)] for b in boxes]
                       for p, boxes in exc.missing.items()}
    return _agreed(guard, what, tree, digest, missing, plan, totals)


def _agreed(guard: TransferGuard, what: str, tree: PTree, digest: str, missing: dict, plan, totals):
    """``(plan, totals)`` once every process's inputs digest is the same; else PlanError, or the
    MissingDataError of every process's missing regions, on every process alike."""
    guard.phase("agree")
    blob = {"digest": digest, "missing": missing}
    everyone = [json.loads(b) for b in guard.gather("agree", json.dumps(blob).encode())]
    with guard.agreeing():  # every process holds `everyone`: the same error everywhere
        differ = [p for p, e in enumerate(everyone) if e["digest"] != everyone[0]["digest"]]
        if differ:
            raise PlanError(f"{what}: processes {differ} planned from inputs different from process "
                            f"0's (digest {everyone[differ[0]]['digest']} against "
                            f"{everyone[0]['digest']}); the arguments agree, so the processes run "
                            "different versions of tenplex or of its dependencies")
        _raise_missing(everyone, tree)
    return plan, totals


def _ranks(ranks) -> list[int]:
    return sorted({r for r in ranks if r is not None})


def _raise_missing(everyone: list[dict], tree: PTree) -> None:
    """Raise every process's missing regions as one MissingDataError, leaves in tree order."""
    merged: dict = {}
    for e in everyone:
        for path, boxes in e["missing"].items():
            have = merged.setdefault(path, [])
            for off, size in boxes:
                box = Box(tuple(off), tuple(size))
                if box not in have:
                    have.append(box)
    if merged:
        merged = {p: merged[p] for p, _ in tree.tensors() if p in merged}
        raise MissingDataError(missing_message(merged), merged)
