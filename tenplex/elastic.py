"""Checkpoint-free reconfiguration and failure recovery inside a running job.

Every process of a *transition group* (the union of old and new devices)
calls the same function. Each process may hold a rank of the old config
(``src_of``), a rank of the new one (``dst_of``), both, or neither:

- a process in both configs keeps what is already on its device and swaps the rest;
- a process that only leaves sends and returns ``None`` as its state;
- a process that only joins starts empty (``local_state=None``) and receives.

For :func:`reconfigure`, process ``p`` holds old rank ``p`` (if ``p`` < old
world size) unless ``src_of`` says otherwise. For :func:`recover`, every
survivor declares the old rank it holds (``old_rank=``), or the caller passes
``src_of``: torchrun renumbers survivors, so no default is safe. For
:func:`recover`, process ``p`` holds new rank ``p`` (if ``p`` < new world
size) unless ``dst_of`` says otherwise. :func:`reconfigure` renumbers by
default: the new ranks go to the processes that keep the most bytes in
place (``report.dst_of``; the numbering above where it keeps as many), and
the caller forms its new group in that order; ``renumber=False`` or a
given ``dst_of`` keeps the numbering.

Before any byte moves, every process checks that all were called with the
same arguments, tree and planner version (one gather), that the process
mapping is consistent, that every local state matches the tree, and that all
plan from the same inputs (in groups of more than
:data:`~tenplex.transform.parts.WHOLE_PLAN_UP_TO` processes, a second gather
of a digest of the tree, configs, placements and live ranks). Each process of
such a group plans only the ops that touch it or the peers it exchanges with
(:mod:`tenplex.transform.parts`), at a cost that grows with what they hold,
not with the world; a smaller group plans the whole world. Any mismatch raises the same error on every process
(:mod:`tenplex.transform.agree`). During the transfer, a failure anywhere
raises :class:`~tenplex.errors.TransferError` everywhere within ``timeout``
(:mod:`tenplex.transform.guard`).

Usage, inside ``torch.distributed`` (see docs/elastic.md for torchrun recipes)::

    state, report = tenplex.reconfigure(state, tree, old, new)       # all processes
    new_rank = report.dst_of[my_process]                                # renumbered
    state, report = tenplex.recover(state, tree, cfg, cfg, lost={3}, old_rank=my_old_rank,
                                    store=last_ckpt)
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from tenplex.errors import PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, TensorLeaf, ValueLeaf
from tenplex.store.reader import StoreReader
from tenplex.store.fetch import read_region
from tenplex.transform.agree import (check_local_state, check_same_inputs,
                                     local_problems, out_problems, tree_digest)
from tenplex.transform.comm import Comm, LocalComm, TorchComm
from tenplex.transform.distributed import DEFAULT_BUDGET, execute_distributed
from tenplex.transform.guard import DEFAULT_TIMEOUT, TransferGuard
from tenplex.transform.assign import best_numbering
from tenplex.transform.parts import plan_own_part, planner_version
from tenplex.transform.placement import Device, Placement

__all__ = ["reconfigure", "recover", "ReconfigureReport", "default_mapping"]

UNDECLARED = "undeclared"
"""``old_rank`` of a process that did not declare the old rank it holds."""


@dataclass
class ReconfigureReport:
    """A reconfiguration's bytes, summed over all processes, and its wall time.

    Attributes:
        sent: bytes sent between processes (equals bytes received).
        local: bytes copied within a process (already on the device).
        store: bytes read from the store (regions no live rank held).
        filled: bytes of zero-filled new padding.
        planned_moved: the plan's bytes moved; ``lower_bound`` beside it.
        seconds: wall time on the slowest process, in seconds.
        peak_buffer: the most bytes of transfer buffers one process held at
            once (at most ``memory_budget``, see
            :mod:`tenplex.transform.distributed`).
        rounds: the most rounds of chunked exchange one process ran.
        steps_kept: for :func:`recover` with ``step_path``, the steps of
            progress kept against restarting from the store's checkpoint.
        dst_of: per process, the new rank it holds (the numbering used; with
            renumbering the best one, so read this process's entry).
        placement_bound: when renumbering was asked for, the bytes no numbering of the new
            ranks can avoid moving (:func:`~tenplex.transform.assign.placement_bound`); else
            ``None``.
    """

    sent: int = 0
    local: int = 0
    store: int = 0
    filled: int = 0
    planned_moved: int = 0
    lower_bound: int = 0
    seconds: float = 0.0
    peak_buffer: int = 0
    rounds: int = 0
    steps_kept: int | None = None
    dst_of: list | None = None
    placement_bound: int | None = None


def default_mapping(size: int, src: ParallelConfig, dst: ParallelConfig):
    """Process ``p`` holds old rank ``p`` and new rank ``p`` where they exist."""
    src_of = [p if p < src.world_size else None for p in range(size)]
    dst_of = [p if p < dst.world_size else None for p in range(size)]
    return src_of, dst_of


def _comm(group, comm: Comm | None, device) -> Comm:
    if comm is not None:
        return comm
    import torch.distributed as dist
    return TorchComm(group, device) if dist.is_initialized() else LocalComm()


def reconfigure(local_state: dict[str, Any] | None, tree: PTree, src: ParallelConfig,
                dst: ParallelConfig, *, group=None, comm: Comm | None = None,
                src_of: Sequence[int | None] | None = None, dst_of: Sequence[int | None] | None = None,
                alive=None, store=None, memory_budget: int = DEFAULT_BUDGET,
                device: str = "cpu", timeout: float = DEFAULT_TIMEOUT, renumber: bool = True,
                out: dict[str, Any] | None = None):
    """This process's state under ``dst``, moved from the other processes without a checkpoint.

    Args:
        local_state: this process's ``{path: local tensor or value}`` under
            ``src``, or ``None`` if it holds no old rank. Tensors must have
            the tree's dtype and local shape, be contiguous and on ``device``;
            value leaves must be JSON-serializable.
        tree: the tree spec (the same everywhere).
        src, dst: the old and new configs.
        group: the transition process group (default: the world).
        comm: a communicator instead of ``group``.
        src_of, dst_of: per process, its old and new rank (see the module docstring).
        alive: old ranks whose data can be read (default: those held by a process).
        store: a committed checkpoint (URL or :class:`StoreReader`) for regions
            no live rank holds.
        memory_budget: bytes of transfer buffers a process may hold at once.
        device: where new tensors are allocated (``"cuda"`` with NCCL).
        timeout: seconds a process may stay silent (dead, or not yet in this
            call) before the reconfiguration fails on every process.

        renumber: give the new ranks to the processes that keep the most bytes in place
            (:func:`~tenplex.transform.assign.best_numbering`: optimal per component of the
            bytes-in-common matrix; the default numbering where it keeps as many). On by
            default: this process's new rank is then ``report.dst_of[process]``, and the
            caller forms its new group in that order
            (:meth:`tenplex_megatron.live.Membership.form` takes it). ``False`` keeps the
            default numbering (process ``p`` holds new rank ``p``, torchrun's); a given
            ``dst_of`` is always kept.
        out: the tensors to receive this process's new state into, in place, as
            ``torch.distributed.checkpoint.load`` loads into the state dict it is given
            (e.g. the new model's parameters and optimizer states, already allocated):
            ``{path: tensor}`` for every tensor leaf its new rank holds, of the leaf's dtype
            and new local shape, contiguous, on ``device``, sharing no memory with
            ``local_state``. Every byte of the new state is written into them (no new tensor
            is allocated, none is a view of the old state), and the returned state holds
            these very tensors. It needs the numbering known before the call:
            ``renumber=False`` or ``dst_of=``. ``None`` (default): new tensors are
            allocated, and a new tensor that one contiguous region of an old shard fills
            whole is a view of it (no copy).

    Returns:
        ``(state, report)``: the new ``{path: local tensor or value}``
        (``None`` for a process that holds no new rank) and a
        :class:`ReconfigureReport`, the same on every process.

    Raises:
        PlanError: the processes were called with different arguments, a
            process mapping that does not fit, or computed different plans;
            on every process alike, before anything moves.
        ShardError: a local state, or an ``out``, does not match the tree
            (missing leaf, dtype, shape, device, memory shared with the old
            state); on every process alike, naming the process, leaf,
            expected and found.
        ConfigError: ``dst`` cannot hold the tree.
        MissingDataError: a region no live rank (and no store) holds; raised
            on every process alike, before anything moves.
        TransferError: a process failed, died or timed out during the
            transfer; raised on every process with the same message, and
            the old state is untouched.
    """
    return _transition(local_state, tree, src, dst, what="reconfigure", group=group, comm=comm,
                       src_of=src_of, dst_of=dst_of, old_rank=UNDECLARED, alive=alive, lost=(),
                       store=store, memory_budget=memory_budget, device=device, timeout=timeout,
                       renumber=renumber, out=out)


def recover(local_state: dict[str, Any] | None, tree: PTree, src: ParallelConfig,
            dst: ParallelConfig, *, lost: set[int], old_rank: int | None | str = UNDECLARED,
            src_of: Sequence[int | None] | None = None, store=None, step_path: str | None = None,
            dst_of: Sequence[int | None] | None = None, group=None, comm: Comm | None = None,
            memory_budget: int = DEFAULT_BUDGET, device: str = "cpu",
            timeout: float = DEFAULT_TIMEOUT):
    """Rebuild the state after losing the old ranks ``lost``.

    Regions held by a surviving replica (dp replicas, tied copies) come from
    it. Only regions no survivor holds are read from ``store`` (the last
    committed checkpoint), by range reads in threads that overlap the
    transfers. Call it on every process of the new group (survivors and
    replacements).

    Args:
        local_state, tree, src, dst: as :func:`reconfigure`; a replacement
            passes ``local_state=None``.
        lost: the old ranks that are gone.
        old_rank: the old rank this process holds (a survivor), or ``None``
            (a replacement; the default when ``local_state`` is ``None``).
        src_of: instead of ``old_rank``, per process, the old rank it holds
            (the same list on every process).
        store: the last committed checkpoint, for regions no survivor holds.
        step_path: a global value leaf counting steps (e.g.
            ``"optimizer/step"``); the report then says how many steps of
            progress were kept against restarting from ``store``.
        dst_of, group, comm, memory_budget, device, timeout: as :func:`reconfigure`.

    Returns:
        ``(state, report)``.

    Raises:
        PlanError: a survivor declares no old rank (and no ``src_of``), two
            processes declare the same old rank, a declaration contradicts
            ``src_of``, or a process declares a lost rank; on every process alike.
        MissingDataError: a region neither a survivor nor the store holds,
            listing the leaves and regions; on every process alike.
        ShardError, ConfigError, TransferError: as :func:`reconfigure`.
    """
    if old_rank == UNDECLARED and local_state is None:
        old_rank = None
    return _transition(local_state, tree, src, dst, what="recover", group=group, comm=comm,
                       src_of=src_of, dst_of=dst_of, old_rank=old_rank, alive=None, lost=lost,
                       store=store, memory_budget=memory_budget, device=device, timeout=timeout,
                       step_path=step_path)


def _transition(local_state, tree, src, dst, *, what, group, comm, src_of, dst_of, old_rank,
                alive, lost, store, memory_budget, device, timeout, step_path=None, renumber=False,
                out=None):
    start = time.perf_counter()
    comm = _comm(group, comm, device)
    me = comm.rank
    renumber = renumber and dst_of is None  # a given numbering is kept
    dst_of = list(dst_of) if dst_of is not None else default_mapping(comm.size, src, dst)[1]
    bound = None
    with TransferGuard(comm, timeout=timeout, what=what) as guard:
        guard.phase("plan")
        reader = _reader(store)
        my_src = _local_old_rank(me, src, src_of, old_rank, what)
        src_sharding = Sharding(tree, src)
        problems = local_problems(tree, src_sharding, my_src, local_state, device) \
            if my_src is None or 0 <= my_src < src.world_size else []
        if out is not None and not renumber:  # with renumbering, refused below on every process
            problems += _out_problems(tree, dst, dst_of, me, out, device, local_state)
        tree_hex = tree_digest(tree)
        inputs = {"src": src.to_json(), "dst": dst.to_json(), "tree": tree_hex, "planner": planner_version(),
                  "src_of": None if src_of is None else list(src_of), "dst_of": dst_of,
                  "alive": None if alive is None else sorted(int(r) for r in alive),
                  "lost": sorted(int(r) for r in lost),
                  "store": reader is not None}
        values = {} if problems or local_state is None else \
            {path: local_state.get(path) for path, _ in tree.values()}
        blob = {"host": socket.gethostname(), "old_rank": old_rank, "has_state": local_state is not None,
                "problems": problems, "values": values, "inputs": inputs, "out": out is not None}
        everyone = [json.loads(b) for b in guard.gather("inputs", json.dumps(blob).encode())]
        with guard.agreeing():  # every process holds `everyone`: the same error everywhere
            check_same_inputs(what, everyone)
            given = [p for p, e in enumerate(everyone) if e["out"]]
            if renumber and given:
                raise PlanError(f"{what}: processes {given} passed out=, but the new ranks are being "
                                "renumbered, so no process knows its new rank before the call; pass "
                                "renumber=False or dst_of=")
            src_of = _resolve_src_of(what, everyone, src_of, src, dst_of, lost)
            labels = [f"process {p} (old rank {src_of[p]}, new rank {dst_of[p]})"
                      for p in range(comm.size)]
            guard.describe(labels[me])
            check_local_state(what, everyone, labels)
            held = {r for r in src_of if r is not None}
            live = (held if alive is None else set(alive) & held) - set(lost)
            shardings = (src_sharding, Sharding(tree, dst))  # filled once, used by both calls below
            if renumber:  # the same numbering on every process: from inputs all of them hold
                dst_of, bound = best_numbering(tree, src, dst, src_of, sorted(live), given=dst_of,
                                               shardings=shardings)
            src_pl, dst_pl = _placements([g["host"] for g in everyone], src_of, dst_of, src, dst)
        # each process plans the ops that touch it or its peers; all agree on the inputs' digest
        plan, own_totals = plan_own_part(guard, what, tree, src, dst, src_placement=src_pl,
                                         dst_placement=dst_pl, alive=live,
                                         store_fallback=reader is not None, src_of=src_of,
                                         dst_of=dst_of, shardings=shardings,
                                         agreed=tree_hex)
        tensors = None if local_state is None else {p: v for p, v in local_state.items()
                                                    if isinstance(tree.leaves.get(p), TensorLeaf)}
        read = None if reader is None else (lambda path, box: read_region(reader, path, box))
        out, stats = execute_distributed(plan, tree, tensors, comm, src_of, dst_of,
                                         memory_budget=memory_budget, store_read=read,
                                         device=device, guard=guard, out=out)
        by_src = {src_of[p]: g["values"] for p, g in enumerate(everyone) if src_of[p] is not None}
        values = _values(tree, plan, by_src, dst_of[me], reader)
        guard.phase("confirm")
        # every process confirms it holds its new state: a peer lost after its last byte was
        # sent still fails the transfer everywhere, so no process goes on alone
        mine = {"sent": stats.sent, "local": stats.local, "store": stats.store, "filled": stats.filled,
                "seconds": time.perf_counter() - start, "peak_buffer": stats.peak_buffer,
                "rounds": stats.rounds, "planned_moved": own_totals.moved,
                "lower_bound": own_totals.lower_bound}
        confirms = [json.loads(b) for b in guard.gather("confirm", json.dumps(mine).encode())]
    if out is not None:
        out.update(values)
        out = {p: out[p] for p in tree.leaves if p in out}
    report = ReconfigureReport(
        **{k: sum(c[k] for c in confirms) for k in ("sent", "local", "store", "filled")},
        planned_moved=sum(c["planned_moved"] for c in confirms),
        lower_bound=sum(c["lower_bound"] for c in confirms),
        seconds=max(c["seconds"] for c in confirms), peak_buffer=max(c["peak_buffer"] for c in confirms),
        rounds=max(c["rounds"] for c in confirms), dst_of=list(dst_of), placement_bound=bound)
    if step_path is not None and reader is not None:
        report.steps_kept = _steps_kept(by_src, live, step_path, reader)
    return out, report


def _out_problems(tree, dst: ParallelConfig, dst_of, me: int, out, device, old) -> list[str]:
    """:func:`~tenplex.transform.agree.out_problems` of this process's ``out`` (a bad ``dst_of``
    or ``dst`` is left to the checks that follow the gather)."""
    rank = dst_of[me] if me < len(dst_of) else None
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < dst.world_size):
        return []
    try:
        sharding = Sharding(tree, dst)
    except Exception:  # dst cannot hold the tree: raised on every process when planning
        return []
    return out_problems(tree, sharding, rank, out, device, old)


def _local_old_rank(me: int, src: ParallelConfig, src_of, old_rank, what: str):
    """The old rank this process holds, by its own arguments (checked against everyone's later)."""
    if src_of is not None:
        return src_of[me] if me < len(src_of) else None
    if old_rank != UNDECLARED:
        return old_rank
    return me if what == "reconfigure" and me < src.world_size else None


def _resolve_src_of(what: str, everyone: list[dict], src_of, src: ParallelConfig, dst_of, lost) -> list:
    """Per process, the old rank it holds, from ``src_of`` or everyone's declarations.

    Raises:
        PlanError: a survivor without a declaration, a declaration that
            contradicts ``src_of``, a rank held twice or out of range, a lost
            rank declared; the same on every process (all hold ``everyone``).
    """
    n = len(everyone)
    for name, of in (("src_of", src_of), ("dst_of", dst_of)):
        if of is not None and len(of) != n:
            raise PlanError(f"{what}: {name} has {len(of)} entries for {n} processes")
    declared = [e["old_rank"] for e in everyone]
    if src_of is not None:
        out = list(src_of)
        for p, d in enumerate(declared):
            if d != UNDECLARED and d != out[p]:
                raise PlanError(f"{what}: process {p} declares old rank {d}, but src_of gives it {out[p]}")
    elif what == "reconfigure":
        out = [d if d != UNDECLARED else (p if p < src.world_size else None) for p, d in enumerate(declared)]
    else:
        silent = [p for p, e in enumerate(everyone) if e["old_rank"] == UNDECLARED]
        if silent:
            raise PlanError(f"{what}: processes {silent} hold a local state but declare no old rank; "
                            "pass old_rank= (the rank each held before the failure; torchrun renumbers "
                            "survivors) or src_of=")
        out = declared
    for p, r in enumerate(out):
        if r is not None and not (isinstance(r, int) and 0 <= r < src.world_size):
            raise PlanError(f"{what}: process {p} holds old rank {r!r}, outside 0..{src.world_size - 1}")
        if r is not None and r in lost:
            raise PlanError(f"{what}: process {p} declares old rank {r}, which is in lost {sorted(lost)}")
    seen: dict[int, int] = {}
    for p, r in enumerate(out):
        if r is not None and r in seen:
            raise PlanError(f"{what}: old rank {r} is declared by processes {seen[r]} and {p}")
        if r is not None:
            seen[r] = p
    return out


def _placements(hosts: list[str], src_of, dst_of, src: ParallelConfig, dst: ParallelConfig):
    device = {p: Device(hosts[p], p) for p in range(len(hosts))}
    src_dev = [Device(f"gone-{r}", r) for r in range(src.world_size)]
    dst_dev: list = [None] * dst.world_size
    for p, r in enumerate(src_of):
        if r is not None:
            src_dev[r] = device[p]
    for p, r in enumerate(dst_of):
        if r is not None:
            if not (isinstance(r, int) and 0 <= r < dst.world_size) or dst_dev[r] is not None:
                raise PlanError(f"dst_of: new rank {r!r} is given to two processes or is out of range")
            dst_dev[r] = device[p]
    missing = [r for r, d in enumerate(dst_dev) if d is None]
    if missing:
        raise PlanError(f"new ranks {missing} are given to no process (dst_of {list(dst_of)})")
    return Placement(tuple(src_dev)), Placement(tuple(dst_dev))


def _reader(store):
    if store is None:
        return None
    return store if isinstance(store, StoreReader) else StoreReader(store)


def _values(tree, plan, by_src: dict, my_dst, reader) -> dict:
    out = {}
    for op in plan.values:
        if op.dst_rank != my_dst:
            continue
        if op.src_rank >= 0:
            out[op.path] = by_src[op.src_rank][op.path]
        elif reader is not None:
            leaf: ValueLeaf = tree[op.path]
            out[op.path] = reader.value(op.path, leaf.key(plan.dst, my_dst))
        else:
            out[op.path] = None
    return out


def _steps_kept(by_src: dict, live: set, step_path: str, reader) -> int | None:
    current = next((by_src[r].get(step_path) for r in sorted(live) if r in by_src), None)
    stored = reader.manifest.values.get(step_path)
    if isinstance(current, (int, float)) and isinstance(stored, (int, float)):
        return int(current - stored)
    return None
