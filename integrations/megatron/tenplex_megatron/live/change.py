"""One call that moves a running megatron-core job to another (dp, tp, pp).

:func:`change` runs, on every process of the job:

1. :func:`~tenplex_megatron.live.state.export_state` (processes holding an old rank);
2. teardown of megatron-core's ``parallel_state``;
3. ``tenplex.reconfigure`` over the transition group (old and new ranks);
4. ``parallel_state`` at the new config, and the caller's ``build(config)``
   for fresh model chunks, optimizer and scheduler;
5. :func:`~tenplex_megatron.live.state.import_state`.

With a :class:`~tenplex_megatron.live.group.Membership` the world may grow
(the default group is re-formed once, before the transfer, already in the
renumbered order; joiners start empty) or shrink (re-formed after it, leavers
are parked).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.live.group import Membership, destroy_parallel_state, init_parallel_state
from tenplex_megatron.live.spec import LiveSpec
from tenplex_megatron.live.state import Imported, export_state, import_state

__all__ = ["Parts", "Changed", "change", "transfer"]


class Parts(NamedTuple):
    """What ``build(config)`` returns: megatron-core model chunks, optimizer and LR scheduler."""

    model: list
    optimizer: Any
    scheduler: Any


@dataclass
class Changed:
    """The result of :func:`change` on one process.

    Attributes:
        parts: the new model, optimizer and scheduler, or ``None`` if this
            process holds no rank of the new config.
        imported: the data position and step, or ``None`` likewise.
        report: the transfer's ``ReconfigureReport`` (bytes moved against the
            planner's lower bound and, renumbered, the placement-free bound; ``dst_of``: the
            new rank of each process of the transition group), the same on every process of
            the job with a ``membership`` (parked ones too), else ``None`` on a process
            outside the transfer.
        seconds: wall time of the whole change on this process, in seconds.
    """

    parts: Parts | None
    imported: Imported | None
    report: Any
    seconds: float


def transfer(state, tree, old: ParallelConfig, new: ParallelConfig, **kwargs):
    """``tenplex.reconfigure`` returning ``(state, report)``: the one place the live API calls it."""
    import tenplex

    return tenplex.reconfigure(state, tree, old, new, **kwargs)


def change(parts: Parts | None, build: Callable[[ParallelConfig], tuple], *, spec: LiveSpec,
           old: ParallelConfig, new: ParallelConfig, consumed_samples: int | None, seed: int,
           membership: Membership | None = None, comm: Callable[[], Any] | None = None,
           renumber: bool = True) -> Changed:
    """Move the job from ``old`` to ``new``; every process of the job calls it.

    Args:
        parts: this process's model chunks, optimizer and scheduler at ``old``,
            or ``None`` if it holds no old rank. Drop your own references to
            them after the call.
        build: ``build(config) -> (model_chunks, optimizer, scheduler)``, called
            after ``parallel_state`` is up at ``config``.
        spec: the job's :class:`LiveSpec`.
        old, new: the configs.
        consumed_samples: the data position (``None`` where ``parts`` is ``None``).
        seed: the run's seed, for ``parallel_state``'s RNG streams at new coordinates.
        membership: re-forms the default group when the world size changes;
            without it, the default group must already be the new world.
        comm: makes the transfer's communicator (a ``tenplex.transform.comm.Comm``),
            called once the transition group is formed; default torch.distributed's.
        renumber: with a ``membership``, give the new ranks to the processes that keep the
            most bytes in place (``tenplex.reconfigure``'s renumbering) and form the new group
            in that order (:meth:`Membership.form`); ``False`` keeps the contiguous numbering.
            Without a membership the default group stays as it is, so nothing is renumbered.

    Returns:
        :class:`Changed`.

    Raises:
        ConfigError: a config cannot hold the model, or the world size changes
            without a ``membership``.
        TransferError: a peer failed during the transfer (state before it untouched).
    """
    import torch.distributed as dist

    start = time.perf_counter()
    tree = spec.tree(old, new)
    if membership is None and dist.get_world_size() != new.world_size:
        raise ConfigError(f"change to {new} ({new.world_size} ranks) over a default group of "
                          f"{dist.get_world_size()} processes: pass a Membership to change the world size")
    state = None
    if parts is not None:
        state = export_state(*parts, spec=spec, consumed_samples=consumed_samples, tree=tree)
        destroy_parallel_state()
        parts = None
    report = None
    if membership is None:
        state, report = transfer(state, tree, old, new, renumber=False,
                                 **({"comm": comm()} if comm else {}))
    else:
        state, report = _moved(state, tree, old, new, membership, comm, renumber)
    if state is None:
        return Changed(None, None, report, time.perf_counter() - start)
    return _resume(state, build, spec, new, seed, tree, report, start)


def _moved(state, tree, old: ParallelConfig, new: ParallelConfig, membership: Membership,
           comm, renumber: bool):
    """The transfer over the transition group, with the new group formed in the new order.

    The transition group is the current group when shrinking (or at one size), else the
    current group's processes in their order followed by the lowest parked ones; transition
    rank ``r < old.world_size`` holds old rank ``r``. Growing, the transition group is the new
    group: its numbering is computed first, from what every process knows (the tree, the
    configs and which process holds which old rank: :func:`_grown`), and the group is formed
    once, in that order. Otherwise the new group is formed after the transfer, in the order
    the transfer's renumbering chose. Returns ``(state, report)``, as :func:`transfer` on a
    process of the transition group, else ``(None, None)``.
    """
    members = list(membership.members) or list(range(old.world_size))
    if new.world_size > old.world_size:
        return _grown(state, tree, old, new, membership, comm, renumber, members)
    out, report = None, None
    if membership.rank is not None:
        out, report = transfer(state, tree, old, new, renumber=renumber,
                               **({"comm": comm()} if comm else {}))
    if report is None and membership.generation is None:
        return None, None  # not joined yet: it learns the groups from the store when needed
    report = _shared(membership, report)
    dst_of = report.dst_of
    order = [None] * new.world_size
    for rank, process in enumerate(members):
        if rank < len(dst_of) and dst_of[rank] is not None:
            order[dst_of[rank]] = process
    if order != members:
        membership.form(new.world_size, order=order)
    return out, report


def _grown(state, tree, old: ParallelConfig, new: ParallelConfig, membership: Membership, comm,
           renumber: bool, members: list):
    """A growing change: the new group formed once, in the numbering that keeps the most bytes.

    Transition process ``t`` (``members`` and then the lowest parked processes) holds old rank
    ``t`` if ``t < old.world_size``; :func:`~tenplex.transform.assign.best_numbering` gives
    each its new rank, as ``tenplex.reconfigure``'s renumbering would (the same inputs: all
    old ranks live, the contiguous numbering kept where it keeps as many bytes). The group is
    formed in that order and the transfer runs with ``src_of`` and ``dst_of`` given, both
    from the numbering alone (a process that has not joined before, which does not know the
    old group, takes the order from process 0's announcement and computes the same
    ``src_of``). The report's ``dst_of`` and ``placement_bound`` are the numbering's, over the
    transition processes, as a renumbering transfer reports them.
    """
    import dataclasses

    from tenplex.transform.assign import best_numbering

    extra = [p for p in range(new.world_size + len(members)) if p not in members]
    members = members + extra[: new.world_size - old.world_size]
    numbering, bound = list(range(new.world_size)), None
    if renumber:
        numbering, bound = best_numbering(
            tree, old, new, [t if t < old.world_size else None for t in range(new.world_size)],
            range(old.world_size), given=numbering)
    order = [None] * new.world_size
    src_of = [None] * new.world_size  # per rank of the new group, the old rank its process holds
    for t, rank in enumerate(numbering):
        order[rank] = members[t]
        src_of[rank] = t if t < old.world_size else None
    if not membership.form(new.world_size, order=order):
        # parked: the report comes from the store, once this process knows the groups
        return (None, None) if membership.generation is None else (None, _shared(membership, None))
    out, report = transfer(state, tree, old, new, src_of=src_of, dst_of=list(range(new.world_size)),
                           renumber=False, **({"comm": comm()} if comm else {}))
    report = dataclasses.replace(report, dst_of=numbering, placement_bound=bound)
    return out, _shared(membership, report)


def _shared(membership: Membership, report):
    """The transfer's report on every process of the job, parked ones too.

    Processes of the transition group hold it (it is the same on all of them); the others read
    it from the store, where the group's rank 0 writes it under the group's generation.
    """
    import dataclasses

    from tenplex.elastic import ReconfigureReport

    key = f"tenplex/change/{membership.generation}/report"
    if report is not None:
        if membership.rank == 0:
            membership.store.set(key, json.dumps(dataclasses.asdict(report)))
        return report
    membership.store.wait([key], membership.timeout)
    return ReconfigureReport(**json.loads(membership.store.get(key)))


def _resume(state, build, spec, config, seed, tree, report, start) -> Changed:
    init_parallel_state(config, seed)
    parts = Parts(*build(config))
    imported = import_state(state, *parts, spec=spec, tree=tree)
    return Changed(parts, imported, report, time.perf_counter() - start)
