"""Host-local snapshots of a rank's state that outlive the worker processes.

A :class:`Snapshotter` copies this rank's local state (``{path: tensor or
value}`` under ``config``) into host-local shared memory every few steps, so
that after torchrun's elastic restart the surviving hosts' states are sources
again (:func:`tenplex.recover_from_snapshots`).

Layout, per job and old rank, under ``root`` (default ``$TENPLEX_SNAPSHOT_DIR``
or ``/dev/shm/tenplex``)::

    {root}/{job}/rank-{r}/slot-0.bin   raw tensor bytes, one after another (64-byte aligned)
    {root}/{job}/rank-{r}/slot-0.json  what slot-0.bin holds: config, rank, step, tree digest,
                                       per tensor (path, dtype, shape, offset), the value leaves
    {root}/{job}/rank-{r}/slot-1.*     the other buffer
    {root}/{job}/rank-{r}/head.json    {"latest": slot or null, "previous": slot or null}

Double buffering: a snapshot is written into the slot that is not the latest;
before the first byte, ``head.json`` stops naming that slot as ``previous``,
and only after its last byte (and its ``.json``) is ``head.json`` replaced
(write, then ``os.replace``, atomic on POSIX) to name it ``latest``. A crash
mid-copy therefore leaves the latest snapshot whole and named. Nothing here
is pickled; a reader checks every offset, size and dtype against the file and
the tree (:mod:`tenplex.snapshot_recover`).

Overlap: :meth:`Snapshotter.save` copies in a background thread (torch's
``copy_`` releases the GIL) and returns at once; training may go on reading
the state (forward, backward), but must not change it before
:meth:`Snapshotter.wait` returns: call it before ``optimizer.step()``.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from tenplex.errors import ShardError, StoreError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, torch_dtype
from tenplex.transform.agree import local_problems, tree_digest

__all__ = ["Snapshotter", "snapshot", "default_root", "ALIGN"]

ALIGN = 64
"""Byte alignment of each tensor in a slot file."""


def default_root() -> str:
    """``$TENPLEX_SNAPSHOT_DIR``, else ``/dev/shm/tenplex`` (host-local shared memory)."""
    return os.environ.get("TENPLEX_SNAPSHOT_DIR", "/dev/shm/tenplex")


def rank_dir(root: str, job: str, rank: int) -> str:
    """The folder of one old rank's snapshots."""
    return os.path.join(root, job, f"rank-{rank}")


@dataclass(frozen=True)
class Entry:
    """One tensor in a slot file: ``nbytes`` bytes at byte ``offset``."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _entries(tree: PTree, sharding: Sharding, rank: int) -> tuple[list[Entry], int]:
    """The tensors ``rank`` holds, in tree order, and the slot file's size in bytes."""
    coord, out, offset = sharding.config.coord(rank), [], 0
    for path, leaf in tree.tensors():
        held = sharding.holding(path, coord)
        if held is None:
            continue
        nbytes = held.numel * torch.empty((), dtype=torch_dtype(leaf.dtype)).element_size()
        out.append(Entry(path, leaf.dtype, tuple(held.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return out, offset


class Snapshotter:
    """Double-buffered snapshots of one rank's state in a host-local folder.

    Args:
        tree: the job's tree spec.
        config: the parallel config the state is under.
        rank: this process's rank under ``config``.
        root: the host-local folder (default :func:`default_root`); two
            simulated hosts on one machine use two folders.
        job: a name for the job (several jobs may share ``root``).

    Example::

        snaps = tenplex.Snapshotter(tree, config, rank)
        for step in range(steps):
            forward_backward()
            snaps.wait()                         # the last snapshot is whole
            optimizer.step()
            if step % 10 == 0:
                snaps.save(export_state(), step)   # copies while the next step computes
    """

    def __init__(self, tree: PTree, config: ParallelConfig, rank: int, *, root: str | None = None,
                 job: str = "job"):
        self.tree, self.config, self.rank = tree, config, rank
        self.dir = rank_dir(root or default_root(), job, rank)
        self.sharding = Sharding(tree, config)
        self.entries, self.size = _entries(tree, self.sharding, rank)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._digest = tree_digest(tree)
        os.makedirs(self.dir, exist_ok=True)

    def save(self, state: dict[str, Any], step: int) -> None:
        """Start copying ``state`` (this rank's, under ``config``) into the free slot; returns at once.

        Args:
            state: ``{path: local tensor or JSON value}``, as :func:`tenplex.reconfigure` takes.
            step: the training step the state is of (recovery matches it against
                the global checkpoint's step).

        Raises:
            ShardError: ``state`` does not match the tree (missing leaf, dtype, shape).
            StoreError: the previous snapshot failed (its error is chained).
        """
        self.wait()
        problems = local_problems(self.tree, self.sharding, self.rank, state, None)
        if problems:
            raise ShardError(f"snapshot of rank {self.rank} at {self.config}: " + "; ".join(problems))
        head = read_head(self.dir)
        slot = 1 - head["latest"] if head["latest"] is not None else 0
        write_head(self.dir, {"latest": head["latest"], "previous": None})   # `slot` is about to change
        values = {p: state[p] for p, _ in self.tree.values() if p in state}
        meta = {"config": self.config.to_json(), "rank": self.rank, "step": int(step), "tree": self._digest,
                "size": self.size, "values": values,
                "tensors": [[e.path, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]}
        tensors = [(e, state[e.path]) for e in self.entries]
        self._thread = threading.Thread(target=self._write, args=(slot, tensors, meta, head["latest"]),
                                        name=f"tenplex-snapshot-{self.rank}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the snapshot in flight is committed.

        Raises:
            StoreError: it failed (the previous snapshot stays the latest).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise StoreError(f"snapshot of rank {self.rank} into {self.dir} failed: {error}") from error

    def _write(self, slot: int, tensors, meta: dict, previous) -> None:
        try:
            write_slot(os.path.join(self.dir, f"slot-{slot}"), tensors, self.size)
            _write_json(os.path.join(self.dir, f"slot-{slot}.json"), meta)
            write_head(self.dir, {"latest": slot, "previous": previous})
        except BaseException as exc:     # reported by wait()
            self._error = exc


def write_slot(base: str, tensors, size: int) -> None:
    """Copy each tensor's bytes to its offset in ``base + ".bin"`` (``size`` bytes, memory-mapped)."""
    with open(base + ".bin", "a+b") as f:
        if os.fstat(f.fileno()).st_size != size:
            f.truncate(size)
        if size == 0:
            return
        with mmap.mmap(f.fileno(), size) as mm:
            for entry, tensor in tensors:
                if entry.nbytes:
                    dst = torch.frombuffer(mm, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
                    dst.copy_(tensor.detach().reshape(-1).view(torch.uint8))
                    del dst
            mm.flush()


def read_head(folder: str) -> dict:
    """``head.json`` of a rank's folder (``{"latest": None, "previous": None}`` if none)."""
    path = os.path.join(folder, "head.json")
    if not os.path.exists(path):
        return {"latest": None, "previous": None}
    with open(path) as f:
        head = json.load(f)
    if not isinstance(head, dict) or any(head.get(k) not in (None, 0, 1) for k in ("latest", "previous")):
        raise StoreError(f"{path}: expected {{'latest': 0|1|null, 'previous': 0|1|null}}, found {head!r}")
    return {"latest": head.get("latest"), "previous": head.get("previous")}


def write_head(folder: str, head: dict) -> None:
    _write_json(os.path.join(folder, "head.json"), head)


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def snapshot(state: dict[str, Any], tree: PTree, config: ParallelConfig, rank: int, step: int, *,
             root: str | None = None, job: str = "job", wait: bool = True) -> Snapshotter:
    """One snapshot of ``state`` (see :class:`Snapshotter`); for a loop, keep a :class:`Snapshotter`.

    Returns:
        The :class:`Snapshotter` (with ``wait=False``, call its ``wait()``
        before changing ``state``).
    """
    snaps = Snapshotter(tree, config, rank, root=root, job=job)
    snaps.save(state, step)
    if wait:
        snaps.wait()
    return snaps
