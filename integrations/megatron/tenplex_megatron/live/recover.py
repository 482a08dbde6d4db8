"""Recovery of a megatron-core job after lost ranks: from replicas, with the last checkpoint as fallback.

Survivors and replacement processes call :func:`rebuild_after_failure` together, in a new
default group (:class:`~tenplex_megatron.live.group.Membership`); survivors
may also go on alone (``replaced=()``), at any config that fits them. What a
survivor holds comes from it: dp replicas of the model (and of the optimizer
without the distributed optimizer), the tied embedding's copy on the other
stage. What no survivor holds (a lost dp rank's shard of the distributed
optimizer) comes from the last committed checkpoint (:func:`save_checkpoint`):

- if that checkpoint is of the survivors' step, only the lost regions are
  read from it (``tenplex.recover``), and training goes on exactly;
- otherwise mixing steps would corrupt the state, so every rank loads the
  checkpoint whole and training goes back to its step (and data position).

A survivor exports its state as soon as the failure surfaces, then leaves the
broken group (:meth:`Membership.leave`, so that peers blocked on it fail
now rather than at the group's timeout), then learns which ranks are lost
(from its scheduler), then calls :func:`rebuild_after_failure`.

The survivors' states must be of one step: a failure must not let some
ranks finish ``optimizer.step()`` while others did not. A collective over
the whole job right before ``optimizer.step()`` ensures it (the demo's
training step has one). With the distributed optimizer, a failure during
``optimizer.step()``'s parameter all-gather leaves parameters half-updated:
pass ``state=None`` on every survivor then, so the checkpoint is used.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection

from tenplex.errors import ConfigError, ShardError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.live.change import Changed, Parts, _resume
from tenplex_megatron.live.group import Membership, destroy_parallel_state
from tenplex_megatron.live.spec import LiveSpec
from tenplex_megatron.live.state import export_state

__all__ = ["Recovered", "rebuild_after_failure", "save_checkpoint"]


@dataclass
class Recovered(Changed):
    """:class:`Changed`, and where the state came from.

    Attributes:
        rolled_back_to: the checkpoint's step if training went back to it, else ``None``.
    """

    rolled_back_to: int | None = None


def save_checkpoint(parts: Parts, url: str, *, spec: LiveSpec, consumed_samples: int) -> None:
    """Every rank writes its own shards to a checkpoint at ``url`` (rank 0 commits the manifest).

    The checkpoint holds the live tree at the current config, so :func:`rebuild_after_failure`
    can read exactly a lost rank's regions from it.
    """
    import tenplex

    from tenplex_megatron.live.state import current_config

    config, _ = current_config()
    tree = spec.tree(config)
    tenplex.save_distributed(export_state(*parts, spec=spec, consumed_samples=consumed_samples, tree=tree),
                             tree, config, url)


def rebuild_after_failure(state: dict | None, build: Callable[[ParallelConfig], tuple], *, spec: LiveSpec,
                          config: ParallelConfig, lost: set[int], seed: int, membership: Membership,
                          name: str, store: str | None = None, new: ParallelConfig | None = None,
                          replaced: Collection[int] | None = None) -> Recovered:
    """Rebuild the job at ``new`` (default ``config``) after losing the ranks ``lost`` of ``config``.

    The processes of the recovery group are the survivors and the
    replacements (``replaced``). Lost processes without a replacement leave
    holes that are closed: every other process's number drops by the number
    of such processes below it (``membership.process`` is the new number
    afterwards), so survivors alone go on at any ``new`` that fits them, and
    later groups (``change``) form over the new numbers.

    Args:
        state: a survivor's :func:`~tenplex_megatron.live.state.export_state`, taken
            when the failure surfaced (before :meth:`Membership.leave`; it is local and
            needs the old ``parallel_state``), or ``None`` on a replacement (or a
            survivor whose state is unusable).
        build: as :func:`~tenplex_megatron.live.change.change`.
        spec: the job's :class:`LiveSpec`.
        config: the config the job ran at (process ``p`` held rank ``p``).
        lost: the ranks of ``config`` that are gone.
        seed: the run's seed.
        membership: this process's membership; survivors and replacements meet
            in the group ``name``.
        store: the last committed checkpoint (:func:`save_checkpoint`), or ``None``.
        new: the config to go on at (default ``config``).
        replaced: the lost ranks that have a replacement process (a process
            whose ``membership.process`` is that rank and that passes
            ``state=None``); default: every lost rank. ``replaced=()``: the
            survivors go on alone.

    Returns:
        :class:`Recovered` (``parts`` ``None`` on a process without a new rank).

    Raises:
        ConfigError: ``replaced`` names a rank that is not lost, or this process
            is lost and not replaced.
        MissingDataError: a region neither a survivor nor ``store`` holds, on every
            process alike, before anything moves.
        ShardError: the survivors hold states of different steps and there is no ``store``.
    """
    import tenplex

    start = time.perf_counter()
    new = new or config
    tree = spec.tree(config, new)
    old_process, size = _renumber(membership, config, new, set(lost), replaced)
    destroy_parallel_state()
    if not membership.form(size, name=name):
        return Recovered(None, None, None, time.perf_counter() - start, None)
    held = state is not None and old_process < config.world_size and old_process not in lost
    alive = {r for r in _gather(old_process if held else None) if r is not None}
    steps = {s for s in _gather(state["optimizer/step"] if held else None) if s is not None}
    needs_store = _needs_store(tree, config, new, alive, store)
    rolled_back, mixed = None, len(steps) > 1
    if mixed and store is None:
        raise ShardError(f"the survivors hold states of different steps {sorted(steps)} and there is no "
                         "checkpoint to go back to (see 'one step' in tenplex_megatron.live.recover)")
    if mixed or (needs_store and _stored_step(store) not in steps):
        rolled_back = _stored_step(store)
        state = tenplex.load(store, new, membership.process) if membership.process < new.world_size else None
        report = None
    else:
        state, report = _from_replicas(state if held else None, tree, config, new,
                                       set(range(config.world_size)) - alive, store,
                                       old_process if held else None)
    if new.world_size < size:
        membership.form(new.world_size, name=f"{name}/go-on")
    if state is None:
        return Recovered(None, None, report, time.perf_counter() - start, rolled_back)
    done = _resume(state, build, spec, new, seed, tree, report, start)
    return Recovered(done.parts, done.imported, report, done.seconds, rolled_back)


def _renumber(membership: Membership, config: ParallelConfig, new: ParallelConfig, lost: set,
              replaced) -> tuple[int, int]:
    """Close the holes of lost processes without a replacement; ``(old process, group size)``.

    Raises:
        ConfigError: ``replaced`` is not a subset of ``lost``, or this process is lost and not replaced.
    """
    replaced = set(lost if replaced is None else replaced)
    if not replaced <= lost:
        raise ConfigError(f"rebuild_after_failure: replaced {sorted(replaced)} names ranks that are not lost {sorted(lost)}")
    gone = lost - replaced
    old = membership.process
    if old in gone:
        raise ConfigError(f"rebuild_after_failure: process {old} is lost and not replaced (replaced {sorted(replaced)}), "
                          "so it cannot take part")
    membership.process = old - sum(1 for g in gone if g < old)
    return old, max(config.world_size - len(gone), new.world_size)


def _needs_store(tree, config, new, alive, store) -> bool:
    """Whether the survivors (old ranks ``alive``) miss bytes of the new state, which the
    checkpoint must then fill; checked on holder classes, without planning the whole world
    (:func:`~tenplex.transform.weights.first_uncovered`): ``tenplex.recover`` plans each
    process's own part.

    Raises:
        MissingDataError: bytes are missing and there is no ``store``; on every process alike,
            naming every missing region (the planner's message: only this error path plans).
    """
    import numpy as np

    from tenplex.errors import MissingDataError
    from tenplex.transform.planner import make_plan
    from tenplex.transform.weights import first_uncovered

    mask = np.zeros(config.world_size + 1, dtype=bool)
    mask[sorted(alive)] = True
    hole = first_uncovered(tree, config, new, mask)
    if hole is None:
        return False
    if store is None:
        make_plan(tree, config, new, alive=alive)  # raises the planner's MissingDataError
        raise MissingDataError(f"rebuild_after_failure: no survivor holds part of {hole} and there is "
                               "no checkpoint", {hole: []})
    return True


def _from_replicas(state, tree, config, new, lost, store, old_rank):
    """``tenplex.recover`` returning ``(state, report)``: the one place the live API calls it."""
    import tenplex

    return tenplex.recover(state, tree, config, new, lost=lost, store=store,
                           old_rank=old_rank, step_path="optimizer/step")


def _gather(value: Any) -> list:
    """Every process's JSON ``value``, in group order."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, json.dumps(value))
    return [json.loads(v) for v in out]


def _stored_step(store: str) -> int:
    from tenplex.store.reader import StoreReader

    return int(StoreReader(store).manifest.values["optimizer/step"])
