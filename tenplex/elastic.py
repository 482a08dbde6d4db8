"""Checkpoint-free reconfiguration and failure recovery inside a running job.

Every process of a *transition group* (the union of old and new devices)
calls the same function. Each process may hold a rank of the old config
(``src_of``), a rank of the new one (``dst_of``), both, or neither:

- a process in both configs keeps what is already on its device and swaps the rest;
- a process that only leaves sends and returns ``None``;
- a process that only joins starts empty (``local_state=None``) and receives.

By default process ``p`` holds old rank ``p`` (if ``p`` < old world size)
and new rank ``p`` (if ``p`` < new world size), on the same device.

Usage, inside ``torch.distributed`` (see docs/elastic.md for torchrun recipes)::

    state = tenplex.reconfigure(state, tree, old, new)       # all processes
    state, report = tenplex.recover(state, tree, cfg, cfg, lost={3}, store=last_ckpt)
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence


from tenplex.errors import ShardError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf
from tenplex.transform.comm import Comm, LocalComm, TorchComm
from tenplex.transform.distributed import DEFAULT_BUDGET, execute_distributed
from tenplex.transform.placement import Device, Placement
from tenplex.transform.planner import make_plan

__all__ = ["reconfigure", "recover", "stage", "ReconfigureReport", "default_mapping"]


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
        steps_kept: for :func:`recover` with ``step_path``, the steps of
            progress kept against restarting from the store's checkpoint.
    """

    sent: int = 0
    local: int = 0
    store: int = 0
    filled: int = 0
    planned_moved: int = 0
    lower_bound: int = 0
    seconds: float = 0.0
    steps_kept: int | None = None


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


def _gather(comm: Comm, tree: PTree, local_state, my_src) -> list[dict]:
    """One all-gather: every process's host name, old rank and value leaves (JSON)."""
    values = {}
    if local_state is not None:
        values = {path: local_state.get(path) for path, _ in tree.values()}
    try:
        blob = json.dumps({"host": socket.gethostname(), "src": my_src, "values": values}).encode()
    except (TypeError, ValueError) as exc:
        raise ShardError(f"value leaves must be JSON-serializable to move between processes: {exc}") from exc
    return [json.loads(b) for b in comm.all_gather_bytes(blob)]


def _placements(hosts: list[str], src_of, dst_of, src: ParallelConfig, dst: ParallelConfig):
    device = {p: Device(hosts[p], p) for p in range(len(hosts))}
    spare = [Device(f"gone-{r}", r) for r in range(src.world_size)]
    src_dev = [spare[r] for r in range(src.world_size)]
    dst_dev: list = [None] * dst.world_size
    for p, r in enumerate(src_of):
        if r is not None:
            src_dev[r] = device[p]
    for p, r in enumerate(dst_of):
        if r is not None:
            dst_dev[r] = device[p]
    missing = [r for r, d in enumerate(dst_dev) if d is None]
    if missing:
        raise ShardError(f"target ranks {missing} are given to no process")
    return Placement(tuple(src_dev)), Placement(tuple(dst_dev))


def reconfigure(local_state: dict[str, Any] | None, tree: PTree, src: ParallelConfig,
                dst: ParallelConfig, *, group=None, comm: Comm | None = None,
                src_of: Sequence[int | None] | None = None, dst_of: Sequence[int | None] | None = None,
                alive=None, store=None, memory_budget: int = DEFAULT_BUDGET,
                device: str = "cpu", report: bool = False):
    """This process's state under ``dst``, moved from the other processes without a checkpoint.

    Args:
        local_state: this process's ``{path: local tensor or value}`` under
            ``src``, or ``None`` if it holds no old rank.
        tree: the tree spec (the same everywhere).
        src, dst: the old and new configs.
        group: the transition process group (default: the world).
        comm: a communicator instead of ``group``.
        src_of, dst_of: per process, its old and new rank (see the module docstring).
        alive: old ranks whose data can be read (default: those held by a process).
        store: a committed checkpoint (URL or :class:`StoreReader`) for regions
            no live rank holds.
        memory_budget: transfer-buffer bytes in flight per process.
        device: where new tensors are allocated (``"cuda"`` with NCCL).
        report: also return a :class:`ReconfigureReport`.

    Returns:
        The new ``{path: local tensor or value}``, or ``None`` for a process
        that holds no new rank; with ``report``, ``(state, report)``.

    Raises:
        ConfigError: ``dst`` cannot hold the tree.
        MissingDataError: a region no live rank (and no store) holds; raised
            on every process alike, before anything moves.
        TransferError: a peer failed or timed out during the transfer; the
            old state is untouched.
    """
    start = time.perf_counter()
    comm = _comm(group, comm, device)
    default_src, default_dst = default_mapping(comm.size, src, dst)
    src_of = list(src_of) if src_of is not None else default_src
    dst_of = list(dst_of) if dst_of is not None else default_dst
    held = {r for r in src_of if r is not None}
    alive = held if alive is None else set(alive) & held
    gathered = _gather(comm, tree, local_state, src_of[comm.rank])
    src_pl, dst_pl = _placements([g["host"] for g in gathered], src_of, dst_of, src, dst)
    reader = _reader(store)
    plan = make_plan(tree, src, dst, src_placement=src_pl, dst_placement=dst_pl, alive=alive,
                     store_fallback=reader is not None)
    me = comm.rank
    tensors = None if local_state is None else {p: v for p, v in local_state.items()
                                                if isinstance(tree.leaves.get(p), TensorLeaf)}
    read = None
    if reader is not None:
        from tenplex.store.region import read_region
        read = lambda path, box: read_region(reader, path, box)
    out, stats = execute_distributed(plan, tree, tensors, comm, src_of, dst_of,
                                     memory_budget=memory_budget, store_read=read, device=device)
    values = _values(tree, plan, gathered, dst_of[me], reader)
    # every process confirms it holds its new state: a peer lost after its last byte was sent
    # still fails the reconfiguration everywhere, so no process goes on alone
    comm.barrier()
    if out is not None:
        out.update(values)
        out = {p: out[p] for p in tree.leaves if p in out}
    if not report:
        return out
    totals = _sum_stats(comm, stats, time.perf_counter() - start)
    rep = ReconfigureReport(sent=totals["sent"], local=totals["local"], store=totals["store"],
                            filled=totals["filled"], planned_moved=plan.totals.moved,
                            lower_bound=plan.totals.lower_bound, seconds=totals["seconds"])
    return out, rep


def _reader(store):
    if store is None:
        return None
    from tenplex.store.reader import StoreReader
    return store if isinstance(store, StoreReader) else StoreReader(store)


def _values(tree, plan, gathered: list[dict], my_dst, reader) -> dict:
    by_src = {g["src"]: g["values"] for g in gathered if g["src"] is not None}
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


def _sum_stats(comm: Comm, stats, seconds: float) -> dict:
    mine = {"sent": stats.sent, "local": stats.local, "store": stats.store, "filled": stats.filled,
            "seconds": seconds}
    everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    out = {k: sum(e[k] for e in everyone) for k in ("sent", "local", "store", "filled")}
    out["seconds"] = max(e["seconds"] for e in everyone)
    return out


def recover(local_state: dict[str, Any] | None, tree: PTree, src: ParallelConfig,
            dst: ParallelConfig, *, lost: set[int], store=None, step_path: str | None = None,
            **kwargs):
    """Rebuild the state after losing the old ranks ``lost``.

    Regions held by a surviving replica (dp replicas, tied copies) come from
    it. Only regions no survivor holds are read from ``store`` (the last
    committed checkpoint), by range reads. Call it on every process of the
    new group (survivors and replacements), with ``src_of`` saying which old
    rank each survivor holds (default: process ``p`` holds old rank ``p``
    unless ``p`` is in ``lost``).

    Args:
        local_state, tree, src, dst: as :func:`reconfigure`.
        lost: the old ranks that are gone.
        store: the last committed checkpoint, for regions no survivor holds.
        step_path: a global value leaf counting steps (e.g.
            ``"optimizer/step"``); the report then says how many steps of
            progress were kept against restarting from ``store``.
        **kwargs: passed to :func:`reconfigure` (``group``, ``comm``,
            ``src_of``, ``dst_of``, ``memory_budget``, ``device``).

    Returns:
        ``(state, report)``.

    Raises:
        MissingDataError: a region neither a survivor nor the store holds,
            listing the leaves and regions; on every process alike.
    """
    comm = _comm(kwargs.pop("group", None), kwargs.pop("comm", None), kwargs.get("device", "cpu"))
    if kwargs.get("src_of") is None:
        src_of, _ = default_mapping(comm.size, src, dst)
        kwargs["src_of"] = [None if r in lost else r for r in src_of]
    alive = {r for r in kwargs["src_of"] if r is not None} - set(lost)
    reader = _reader(store)
    state, rep = reconfigure(local_state, tree, src, dst, comm=comm, alive=alive, store=reader,
                             report=True, **kwargs)
    if step_path is not None and reader is not None:
        now = (state or {}).get(step_path)
        steps = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(now).encode())]
        current = next((s for s in steps if s is not None), None)
        stored = reader.manifest.values.get(step_path)
        if isinstance(current, (int, float)) and isinstance(stored, (int, float)):
            rep.steps_kept = int(current - stored)
    return state, rep


def stage(local_state: dict[str, Any], tree: PTree, config: ParallelConfig, url: str, *,
          rank: int | None = None, group=None, comm: Comm | None = None) -> None:
    """Save every rank's state to one checkpoint at ``url``, each rank writing its own shards.

    For elastic restarts: stage to a host-memory store (a ``file://`` path
    under ``/dev/shm``) before the workers exit; the new workers then call
    ``tenplex.load(url, new_config, new_rank)``, which reads only their byte
    ranges. Rank 0 commits the manifest after every rank has written.

    Raises:
        AlreadyExistsError: ``url`` holds a committed checkpoint.
        TransferError: a peer failed.
    """
    from tenplex.store.writer import StoreWriter, FileRecord

    comm = _comm(group, comm, "cpu")
    rank = comm.rank if rank is None else rank
    writer = StoreWriter(url, tree, config, clear=comm.rank == 0) if comm.rank == 0 else None
    comm.barrier()
    if writer is None:
        writer = StoreWriter(url, tree, config, clear=False)
    for path, _, _ in writer.entries().get(rank, []):
        writer.write(rank, path, local_state[path])
    records = {k: asdict(v) for k, v in writer.records().items()}
    values = {p: local_state.get(p) for p, _ in tree.values()}
    blob = json.dumps({"rank": rank, "records": records, "values": values}).encode()
    everyone = [json.loads(b) for b in comm.all_gather_bytes(blob)]
    if comm.rank == 0:
        for item in everyone:
            writer.add_records({k: FileRecord(v["size"], v["block"], tuple(v["digests"]))
                                for k, v in item["records"].items()})
        stored = {}
        for path, leaf in tree.values():
            if leaf.scope is Scope.GLOBAL:
                stored[path] = everyone[0]["values"][path]
            else:
                stored[path] = {leaf.key(config, e["rank"]): e["values"][path] for e in everyone}
        writer.commit(stored)
    comm.barrier()
