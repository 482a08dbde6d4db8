"""Target ranks' local tensors, built from any shard source through the planner and the store executor.

The Megatron writers use one :class:`TargetBuilder` each: it plans the move
from the source's config to the target's, and builds one target rank's
leaves at a time (leaves in parallel), so a writer holds what it is writing
and no more. The source is any :class:`tenplex.store.source.ShardSource`:
a tenplex store, or a Megatron checkpoint read in place.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Iterator

import torch

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import Scope
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.transform.planner import make_plan

from tenplex_megatron.formats.common import TargetValues
from tenplex_megatron.formats.siblings import SiblingLeaves, Stopped
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.vocab import check_target_vocab
from tenplex_megatron.model.layouts import check_attention_tp
from tenplex_megatron.torchfiles.jsonable import from_jsonable
from tenplex_megatron.torchfiles.ptfile import TensorRef

__all__ = ["TargetBuilder", "PartValues", "part_values", "megatron_meta", "BUDGET"]

RNG = "megatron/rng_state"

BUDGET = 64 << 20
"""Bytes of target tensors a builder works on at once (64 MiB)."""


def megatron_meta(source) -> tuple[MegatronConfig, dict]:
    """The model config and Megatron meta a source carries.

    Raises:
        ManifestError: if the source is not a Megatron model.
    """
    meta = (source.meta or {}).get("megatron")
    if not meta or "config" not in meta:
        raise ManifestError("the source is not a Megatron model (no megatron config in its meta); "
                            "write it with --format tenplex")
    return MegatronConfig.from_json(meta["config"]), meta


def _whole(t, shape) -> torch.Tensor:
    """A tensor with its own minimal storage (``torch.save`` writes a view's whole storage)."""
    if isinstance(t, (list, tuple)):
        return torch.cat([p.reshape(-1) for p in t]).view(shape)
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


class TargetBuilder:
    """Plans ``source -> to`` and builds target ranks' local tensors.

    Args:
        source: the shard source.
        to: the target config.
        threads: leaves built (and stored tensors read) at once.
        progress: ``progress(done_bytes, total_bytes)`` of target tensors built
            (the total counts every dp-0 rank's leaves).
        budget: bytes of target tensors built ahead at once (default :data:`BUDGET`);
            each also holds the source bytes it is built from, so the transient
            memory is a small multiple of it.

    Attributes:
        plan: the plan.
        values: the target's value leaves (:func:`tenplex.store.execute.target_values`), read
            on first use; a writer of some ranks' files uses :meth:`values_of` instead.
        bytes_written: bytes of tensors handed out so far.

    Raises:
        ConfigError: ``to`` cannot hold the tree.
    """

    def __init__(self, source, to: ParallelConfig, threads: int = 8, budget: int = BUDGET,
                 progress: Callable[[int, int], None] | None = None):
        self.source, self.to, self.threads, self.budget = source, to, max(1, threads), budget
        self.tree = source.tree
        self.plan = make_plan(self.tree, source.config, to,  # validates the tree at ``to`` first
                              src_sharding=source.sharding)
        check_attention_tp(megatron_meta(source)[0], to.tp)
        check_target_vocab(megatron_meta(source)[0], to.tp)
        self.runner = StorePlanRunner(source, self.plan, self.threads)
        self.siblings = SiblingLeaves(self.runner, to)
        self._values = None
        self._pool = ThreadPoolExecutor(self.threads)
        self.progress, self.built, self._lock = progress, 0, threading.Lock()
        D = self.runner.D
        self.total = sum(h.numel * leaf.itemsize for r in range(to.world_size) if to.coord(r).dp == 0
                         for p, leaf in self.tree.tensors()
                         if (h := D.holding(p, to.coord(r))) is not None) if progress else 0

    @property
    def values(self) -> dict:
        if self._values is None:
            self._values = target_values(self.tree, self.plan, self.source)
        return self._values

    def values_of(self, ranks) -> dict:
        """The target's value leaves as :attr:`values` holds them, read for ``ranks`` only: every
        global leaf (target rank 0's, as :attr:`values`), and of a per-rank or per-coordinate leaf
        (an RNG state) only the keys of ``ranks``, so a process writing some target files reads
        the values of those files and no others."""
        want = sorted(set(ranks))
        ops = tuple(op for op in self.plan.values if op.dst_rank in want
                    or (op.dst_rank == 0 and self.tree[op.path].scope is Scope.GLOBAL))
        per_rank = target_values(self.tree, dataclasses.replace(self.plan, values=ops), self.source,
                                 ranks=sorted(set(want) | {0}))
        out: dict = {}
        for path, leaf in self.tree.values():
            if leaf.scope is Scope.GLOBAL:
                out[path] = per_rank[0][path]
            else:
                out[path] = {leaf.key(self.plan.dst, r): per_rank[r][path] for r in want}
        return out

    def share(self, groups) -> None:
        """Build each leaf once for a group of sibling ranks (:class:`SiblingLeaves`): ``groups``
        are sets of target ranks whose files the caller writes at the same time, in the same
        leaf order (:func:`~tenplex_megatron.formats.siblings.tp_siblings`). A rank's
        :meth:`stream` then builds ahead within the budget over the group's size."""
        self.siblings.group(groups)

    def at_once(self, jobs: list[tuple[int, Callable]]) -> list:
        """Run ``jobs`` (``[(rank, fn)]``, one file writer each) at the same time, their ranks
        siblings (:meth:`share`); their results in order. When one fails (or the calling thread
        is interrupted, as by torchrun's SIGTERM), the others stop at their next leaf.

        Raises:
            The first failed job's error (in ``jobs`` order), once every job has stopped.
        """
        self.share([[rank for rank, _ in jobs]])
        pool = ThreadPoolExecutor(max(1, len(jobs)))
        futures = [pool.submit(fn) for _, fn in jobs]
        try:
            for future in as_completed(futures):
                if future.exception() is not None:
                    self.siblings.stop()
                    break
        except BaseException:
            self.siblings.stop()
            raise
        finally:
            pool.shutdown(wait=True)
            self.siblings.clear()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # a writer's own error, not the Stopped it made its siblings raise
            raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
        return [future.result() for future in futures]

    def close(self) -> None:
        self.siblings.clear()
        self.runner.close()
        self._pool.shutdown()
        if self.progress:
            self.progress(self.total, self.total)

    def _count(self, nbytes: int) -> None:
        if self.progress:
            with self._lock:
                self.built += nbytes
                self.progress(min(self.built, self.total), self.total)

    def __enter__(self) -> "TargetBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def paths(self, rank: int, prefix: str = "") -> list[str]:
        """The tensor leaves under ``prefix`` that target ``rank`` holds, in tree order."""
        coord = self.to.coord(rank)
        return [p for p, _ in self.tree.tensors()
                if p.startswith(prefix) and self.runner.D.holding(p, coord) is not None]

    def leaf(self, path: str, rank: int) -> torch.Tensor:
        """Target ``rank``'s local tensor of ``path`` (its own storage)."""
        got = self.siblings.get(path, rank)
        if got is None:
            raise ManifestError(f"target rank {rank} holds no part of {path}")
        out = _whole(got, self.runner.D.holding(path, self.to.coord(rank)).shape)
        self._count(out.numel() * out.element_size())
        return out

    def leaf_into(self, path: str, rank: int, out: torch.Tensor) -> None:
        """Copy target ``rank``'s local tensor of ``path`` into the flat view ``out`` (no joined copy)."""
        got = self.siblings.get(path, rank)
        if got is None:
            raise ManifestError(f"target rank {rank} holds no part of {path}")
        parts = got if isinstance(got, (list, tuple)) else [got]
        position = 0
        for part in parts:
            n = part.numel()
            out[position:position + n].copy_(part.reshape(-1))
            position += n
        if position != out.numel():
            raise ManifestError(f"{path}: target rank {rank}'s tensor has {position} elements, the "
                                f"buffer slot {out.numel()}")
        self._count(out.numel() * out.element_size())

    def fill(self, rank: int, jobs: list[tuple[str, torch.Tensor]]) -> None:
        """:meth:`leaf_into` for every ``(path, out)`` of ``jobs``, in parallel within the byte budget."""
        work = [(out.numel() * out.element_size(), lambda p=path, o=out: self.leaf_into(p, rank, o))
                for path, out in jobs]
        for _ in self._bounded(work, self._budget(rank)):
            pass

    def stream(self, rank: int, paths: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(path, local tensor)`` for ``paths`` in order, built ahead within the byte budget."""
        paths = list(paths)
        coord = self.to.coord(rank)
        work = [(self.runner.D.holding(p, coord).numel * self.tree[p].itemsize,
                 lambda p=p: self.leaf(p, rank)) for p in paths]
        yield from zip(paths, self._bounded(work, self._budget(rank)))

    def _budget(self, rank: int) -> int:
        """Bytes ``rank``'s writer builds ahead: the budget, shared with the rank's siblings."""
        return max(1, self.budget // max(1, len(self.siblings.group_of(rank))))

    def _bounded(self, work: list[tuple[int, Callable]], budget: int) -> Iterator:
        """Results of ``work`` (``(bytes, fn)``) in order; the jobs in flight hold at most
        ``budget`` bytes of target tensors (a larger job runs alone)."""
        pending: deque = deque()
        held = 0
        for nbytes, fn in work:
            while pending and held + nbytes > budget:
                size, future = pending.popleft()
                held -= size
                yield future.result()
            pending.append((nbytes, self._pool.submit(fn)))
            held += nbytes
        while pending:
            yield pending.popleft()[1].result()

    def rank(self, rank: int, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every local tensor of target ``rank`` under ``prefix``."""
        return dict(self.stream(rank, self.paths(rank, prefix)))


class PartValues(TargetValues):
    """:class:`~tenplex_megatron.formats.common.TargetValues` of some target ranks' files (a write in parts).

    Holds the global values and the RNG states of its own ranks' coordinates
    (:meth:`TargetBuilder.values_of`); what its derived states, notes and
    ``had_rng`` depend on beyond those (which other coordinates the source
    stores, how many dp states each holds, the kind of device generator: see
    :func:`tenplex_megatron.model.rng.fill_states`) comes from ``stored``, so
    they are what one process writing every file derives.

    Args:
        values: :meth:`TargetBuilder.values_of` of the ranks.
        cfg, config: as :class:`TargetValues`.
        stored: ``{"tp=T,pp=P": stored state list (tensors as meta tensors) or None}`` for every
            target coordinate, in target rank order (:func:`stored_rng`).
    """

    def __init__(self, values: dict, cfg: MegatronConfig, config: ParallelConfig, stored: dict):
        super().__init__(values, cfg, config)
        self._stored = stored
        self.had_rng = any(v is not None for v in stored.values())

    def rng_states(self, per_dp: bool = False) -> dict[str, list]:
        """``{"tp=T,pp=P": [rank states]}`` for this part's coordinates only."""
        mine = self._rng
        self._rng = {k: mine[k] if k in mine else v for k, v in self._stored.items()}
        try:
            states = super().rng_states(per_dp)
        finally:
            self._rng = mine
        return {k: v for k, v in states.items() if k in mine}


def _as_meta(obj):
    """``obj`` with every :class:`TensorRef` replaced by a meta tensor of its shape and dtype (nothing read)."""
    if isinstance(obj, TensorRef):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return {k: _as_meta(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_meta(v) for v in obj)
    return obj


def stored_rng(build: TargetBuilder) -> dict:
    """``{"tp=T,pp=P": stored RNG state list or None}`` for every target coordinate, in target rank
    order, as :attr:`TargetBuilder.values` would hold it; a legacy source's states are not read (their
    tensors as meta tensors of the stored shapes: a pickle already read says them), another's are
    (a torch_dist source's byte objects; a store's manifest)."""
    if RNG not in dict(build.tree.values()):
        return {}
    leaf, plan = build.tree[RNG], build.plan
    found: dict = {}
    for op in plan.values:
        if op.path == RNG:
            found[leaf.key(plan.dst, op.dst_rank)] = op.src_rank
    source, out = build.source, {}
    refs = getattr(source, "rng_refs", None)  # a legacy source's states as stored (LegacySource.rng_refs)
    for key, src_rank in found.items():
        if src_rank < 0:
            out[key] = None
        elif isinstance(refs, dict):
            out[key] = _as_meta(refs.get(leaf.key(plan.src, src_rank)))
        else:
            out[key] = from_jsonable(source.value(RNG, leaf.key(plan.src, src_rank)))
    return out


def part_values(build: TargetBuilder, cfg: MegatronConfig, to: ParallelConfig, ranks) -> TargetValues:
    """The values a writer of target ``ranks``' files needs (:class:`PartValues`), reading the RNG
    states of those ranks' coordinates only."""
    return PartValues(build.values_of(ranks), cfg, to, stored_rng(build))
