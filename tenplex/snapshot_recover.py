"""Recovery from host-local snapshots after torchrun's elastic restart, at any new world size.

Every process of the restarted job calls :func:`recover_from_snapshots`:

1. each process lists the snapshots in its host's folder (``root``), both
   buffers of every old rank (:mod:`tenplex.snapshot`), and all processes
   exchange what their hosts hold (one all-gather of a few hundred bytes per
   process);
2. every process then makes the same choice: the newest step ``s`` (with its
   old config) whose snapshots, together with the global checkpoint
   ``store``, cover the new state. The checkpoint may fill what no snapshot
   holds only if it is of step ``s`` too: steps are never mixed;
3. on each host, the snapshots of step ``s`` are held by that host's
   processes in order (the host's first process holds its lowest old rank);
   a snapshot left over when a host runs fewer processes than it has
   snapshots is not a source;
4. :func:`tenplex.recover` moves the bytes: each region from a snapshot on
   the same host if one holds it, else from another host over
   ``torch.distributed``, and only regions no snapshot holds from ``store``.

Without a feasible step, every process loads the checkpoint (``rolled_back``).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tenplex.errors import CorruptShardError, MissingDataError, StoreError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, TensorLeaf, torch_dtype
from tenplex.snapshot import ALIGN, default_root, read_head
from tenplex.transform.comm import Comm
from tenplex.transform.distributed import DEFAULT_BUDGET
from tenplex.transform.guard import DEFAULT_TIMEOUT

__all__ = ["Restored", "recover_from_snapshots", "local_offers", "load_snapshot"]


@dataclass
class Restored:
    """What :func:`recover_from_snapshots` gives one process.

    Attributes:
        state: this process's ``{path: local tensor or value}`` under the new
            config, or ``None`` if it holds no new rank.
        report: the :class:`~tenplex.elastic.ReconfigureReport` (``report.store``:
            bytes read from the checkpoint), or ``None`` after a roll-back.
        step: the step of the recovered state.
        old: the config the snapshots were taken at.
        sources: the old ranks whose snapshots served as sources.
        rolled_back: ``True`` if every rank loaded the checkpoint instead.
        skipped: snapshots on this host that were not usable, with the reason.
    """

    state: dict[str, Any] | None
    report: Any
    step: int
    old: ParallelConfig | None
    sources: list[int] = field(default_factory=list)
    rolled_back: bool = False
    skipped: list[str] = field(default_factory=list)


def _folders(root: str, job: str) -> list[tuple[int, str]]:
    base = os.path.join(root, job)
    if not os.path.isdir(base):
        return []
    out = []
    for name in os.listdir(base):
        if name.startswith("rank-") and name[5:].isdigit():
            out.append((int(name[5:]), os.path.join(base, name)))
    return sorted(out)


def _meta(folder: str, slot: int) -> dict:
    """A slot's ``.json``, its fields checked for type (not yet against the tree).

    Raises:
        StoreError: unreadable, or a field missing or of the wrong type.
    """
    path = os.path.join(folder, f"slot-{slot}.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable ({exc})") from exc
    want = {"config": dict, "rank": int, "step": int, "size": int, "values": dict, "tensors": list}
    for key, kind in want.items():
        if not isinstance(meta, dict) or not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            found = type(meta.get(key)).__name__ if isinstance(meta, dict) else type(meta).__name__
            raise StoreError(f"{path}: expected {key!r} of type {kind.__name__}, found {found}")
    return meta


def local_offers(root: str, job: str) -> tuple[list[list], list[str]]:
    """The snapshots in one host's folder: ``[old rank, step, slot, config json]`` each, and what was skipped."""
    offers, skipped = [], []
    for rank, folder in _folders(root, job):
        try:
            head = read_head(folder)
        except (StoreError, OSError, ValueError) as exc:
            skipped.append(f"{folder}: {exc}")
            continue
        for slot in (head["latest"], head["previous"]):
            if slot is None:
                continue
            try:
                meta = _meta(folder, slot)
                ParallelConfig.from_json(meta["config"])
                if meta["rank"] != rank:
                    raise StoreError(f"{folder}/slot-{slot}.json: expected rank {rank}, found {meta['rank']}")
            except Exception as exc:   # a lying file is skipped, and said so
                skipped.append(f"{folder}/slot-{slot}: {exc}")
                continue
            offers.append([rank, meta["step"], slot, meta["config"]])
    return offers, skipped


def load_snapshot(root: str, job: str, rank: int, slot: int, tree: PTree) -> dict[str, Any]:
    """One old rank's snapshot as ``{path: tensor or value}``, memory-mapped (copy on write).

    Every entry is checked against the tree and the file: the path is a
    tensor leaf the rank holds, dtype and local shape are the tree's, the
    bytes lie inside the file, aligned, without overlap.

    Raises:
        CorruptShardError: an entry or the file lies, naming it, what was expected and found.
    """
    folder = os.path.join(root, job, f"rank-{rank}")
    meta = _meta(folder, slot)
    config = ParallelConfig.from_json(meta["config"])
    sharding, coord = Sharding(tree, config), config.coord(rank)
    data = os.path.join(folder, f"slot-{slot}.bin")
    size = os.path.getsize(data)
    if size != meta["size"]:
        raise CorruptShardError(f"{data}: expected {meta['size']} bytes, found {size}")
    entries, end = [], 0
    for item in sorted(meta["tensors"], key=lambda e: e[3] if isinstance(e, list) and len(e) == 5 else -1):
        path, dtype, shape, offset, nbytes = _entry(data, item)
        leaf = tree.leaves.get(path)
        held = sharding.holding(path, coord) if isinstance(leaf, TensorLeaf) else None
        if held is None or leaf.dtype != dtype or tuple(held.shape) != tuple(shape):
            raise CorruptShardError(f"{data}: entry {path}: expected a leaf rank {rank} holds at {config} "
                                    f"({None if held is None else leaf.dtype} {None if held is None else held.shape}),"
                                    f" found {dtype} {shape}")
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty((), dtype=torch_dtype(dtype)).element_size()
        if offset % ALIGN or offset < end or nbytes != numel * itemsize or offset + nbytes > size:
            raise CorruptShardError(f"{data}: entry {path}: expected {numel * itemsize} bytes at an offset "
                                    f"aligned to {ALIGN}, at or after {end}, inside {size}; found {nbytes} at {offset}")
        entries.append((path, dtype, tuple(shape), offset))
        end = offset + nbytes
    state: dict[str, Any] = {k: v for k, v in meta["values"].items() if k in tree.leaves}
    if size:
        with open(data, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        for path, dtype, shape, offset in entries:
            numel = 1
            for n in shape:
                numel *= n
            state[path] = torch.frombuffer(mm, dtype=torch_dtype(dtype), count=numel, offset=offset).view(shape) \
                if numel else torch.empty(shape, dtype=torch_dtype(dtype))
    return state


def _entry(data: str, item) -> tuple:
    ok = isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and isinstance(item[1], str) \
        and isinstance(item[2], list) and all(isinstance(n, int) and n >= 0 for n in item[2]) \
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in item[3:])
    if not ok:
        raise CorruptShardError(f"{data}: expected an entry [path, dtype, shape, offset, nbytes], found {item!r}")
    return tuple(item)


def _choose(tree_of, new: ParallelConfig, hosts: list[str], offers: dict[str, list], store_step,
            has_store: bool):
    """The newest feasible ``(step, old config, src_of, tree)``, or ``None``: the same on every process.

    A step is feasible if its snapshots hold every byte the new state needs, or the checkpoint
    is of that step and fills the rest. That is checked on holder classes
    (:func:`~tenplex.transform.weights.first_uncovered`), without planning the whole world:
    :func:`tenplex.recover` then plans each process's own part.
    """
    import numpy as np

    from tenplex.transform.weights import first_uncovered

    candidates = sorted({(o[1], json.dumps(o[3], sort_keys=True)) for host in offers.values() for o in host},
                        reverse=True)
    for step, text in candidates:
        old = ParallelConfig.from_json(json.loads(text))
        src_of: list[int | None] = [None] * len(hosts)
        for host, mine in offers.items():
            ranks = sorted({o[0] for o in mine if (o[1], json.dumps(o[3], sort_keys=True)) == (step, text)})
            ranks = [r for r in ranks if 0 <= r < old.world_size]
            procs = [p for p, h in enumerate(hosts) if h == host]
            for p, r in zip(procs, ranks):
                src_of[p] = r
        alive = np.zeros(old.world_size + 1, dtype=bool)
        alive[[r for r in src_of if r is not None]] = True
        tree = tree_of(old)
        if first_uncovered(tree, old, new, alive) is not None and (not has_store or store_step != step):
            continue  # the snapshots miss bytes that the checkpoint cannot fill (none, or of another step)
        return step, old, src_of, tree
    return None


def recover_from_snapshots(tree: PTree | Callable[[ParallelConfig], PTree], new: ParallelConfig, *,
                           root: str | None = None, job: str = "job", store=None,
                           step_path: str = "optimizer/step", host: str | None = None, group=None,
                           comm: Comm | None = None, memory_budget: int = DEFAULT_BUDGET, device: str = "cpu",
                           timeout: float = DEFAULT_TIMEOUT) -> Restored:
    """This process's state under ``new``, from the snapshots the surviving hosts hold.

    Call it on every process of the restarted job (torchrun's new world);
    process ``p`` takes new rank ``p``.

    Args:
        tree: the tree spec, or ``tree(old) -> PTree`` when it depends on the
            old config (found in the snapshots).
        new: the config to go on at.
        root: this host's snapshot folder (default :func:`tenplex.snapshot.default_root`).
        job: the job's name, as given to :class:`~tenplex.snapshot.Snapshotter`.
        store: the last committed global checkpoint (URL or ``StoreReader``),
            for what no snapshot holds; used only if it is of the chosen step.
        step_path: the global value leaf that holds the checkpoint's step.
        host: this host's name (default: the machine's name and ``root``'s real
            path, so two folders on one machine are two hosts).
        group, comm, memory_budget, device, timeout: as :func:`tenplex.recover`.

    Returns:
        :class:`Restored`, the same step and sources on every process.

    Raises:
        MissingDataError: neither the snapshots (of one step) nor ``store`` hold
            the state; on every process alike.
        CorruptShardError: a chosen snapshot's file lies about its contents.
        PlanError, ShardError, TransferError: as :func:`tenplex.recover`.
    """
    from tenplex.api import load
    from tenplex.elastic import _comm, _reader, recover

    root = root or default_root()
    tree_of = tree if callable(tree) else (lambda old: tree)
    comm = _comm(group, comm, device)
    host = host or f"{socket.gethostname()}:{os.path.realpath(root)}"
    offers, skipped = local_offers(root, job)
    everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps({"host": host, "offers": offers}).encode())]
    hosts = [e["host"] for e in everyone]
    by_host: dict[str, list] = {}
    for e in everyone:
        by_host.setdefault(e["host"], e["offers"])
    reader = _reader(store)
    store_step = None if reader is None else reader.manifest.values.get(step_path)
    chosen = _choose(tree_of, new, hosts, by_host, store_step, reader is not None)
    me = comm.rank
    if chosen is None:
        if reader is None:
            raise MissingDataError(f"recover_from_snapshots: the snapshots on hosts {sorted(by_host)} do not cover "
                                   f"{new} at any one step, and there is no checkpoint")
        state = load(store, new, me) if me < new.world_size else None
        return Restored(state, None, int(store_step) if store_step is not None else -1, None, [], True, skipped)
    step, old, src_of, tree_r = chosen
    mine = src_of[me]
    local = None
    if mine is not None:
        slot = next(o[2] for o in by_host[host] if o[0] == mine and o[1] == step)
        local = load_snapshot(root, job, mine, slot, tree_r)
    alive = {r for r in src_of if r is not None}
    state, report = recover(local, tree_r, old, new, lost=set(range(old.world_size)) - alive,
                                    src_of=src_of, store=reader, step_path=step_path, comm=comm,
                                    memory_budget=memory_budget, device=device, timeout=timeout)
    return Restored(state, report, step, old, sorted(alive), False, skipped)
