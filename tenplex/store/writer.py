"""Write a checkpoint: shard files first, the manifest last (the commit).

Each replicated region is stored once, in the file of its holder class's
lowest rank (as PyTorch DCP deduplicates replicas), so a dp=8 checkpoint is
no larger than a dp=1 one apart from sharded optimizer state.

Commit protocol (Orbax's ``atomicity.py`` offers both kinds, "because not
all filesystems support atomic rename"):

1. refuse if ``manifest.json`` exists (never overwrite a commit in place);
2. write every shard file under ``shards/``, named
   ``rank-NNNNN-<token>.safetensors`` with this writer's random token, so
   that two writers at one URL (or a rerun beside an interrupted save)
   never write the same file; local files are fsynced when closed;
3. commit the manifest with :func:`~tenplex.store.commit.commit_manifest`:
   durable, and never replacing another writer's manifest.

A writer removes only files it created itself (on :meth:`StoreWriter.abort`,
or when another writer commits first). Files of a killed writer stay where
they are, referenced by no manifest, and are never read.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch

from tenplex.errors import AlreadyExistsError, ShardError, StoreError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, torch_dtype
from tenplex.store.blocks import DEFAULT_BLOCK, BlockHasher
from tenplex.store.commit import commit_manifest
from tenplex.store.host import host_bytes
from tenplex.limits import short
from tenplex.store.bounded_json import check_writable
from tenplex.store.manifest import MANIFEST, FileRecord, Manifest, TensorRecord
from tenplex.store.manifest_parse import MAX_BLOCK
from tenplex.store.paths import resolve_inside
from tenplex.store.safetensors_format import Entry, header_bytes
from tenplex.store.url import StoreRoot, translate_errors
from tenplex.store.values import check_values, gather_values
from tenplex.units import Progress

__all__ = ["StoreWriter", "save", "shard_file", "file_rank"]


WRITE_BUFFER = 8 << 20
"""Bytes an open remote file buffers before it uploads a part (8 MiB; s3fs's default is 50 MiB)."""

_FILE = re.compile(r"shards/rank-(\d+)-([0-9a-f]+)\.safetensors")


def shard_file(rank: int, token: str) -> str:
    """The key of ``rank``'s shard file written by the writer with ``token``."""
    return f"shards/rank-{rank:05d}-{token}.safetensors"


def file_rank(key: str) -> int | None:
    """The rank of a shard file key from :func:`shard_file`, or None for another name."""
    match = _FILE.fullmatch(key)
    return int(match.group(1)) if match else None


class _FileWriter:
    """One safetensors file written in a stream, in header order, with block digests."""

    def __init__(self, root: StoreRoot, key: str, entries: list[Entry], block: int):
        self.root, self.key, self.entries = root, key, entries
        prefix, self.offsets = header_bytes(entries)
        self.hasher = BlockHasher(block)
        self.size = self.offsets[-1] + entries[-1].nbytes if entries else len(prefix)
        self.next = 0
        with translate_errors(f"{root}/{key}"):
            root.fs.makedirs(root.key("shards"), exist_ok=True)
            if root.local:  # exclusive create: never write over a file this writer did not create
                resolve_inside(root.path, root.key(key), f"{root}/{key}")  # a shards/ link out is refused
                self.handle = open(root.key(key), "xb")
            else:
                self.handle = root.fs.open(root.key(key), "wb", block_size=WRITE_BUFFER)
        self._write(prefix)

    def _write(self, data) -> None:
        self.handle.write(data)
        self.hasher.update(data)

    def write(self, name: str, tensor) -> int:
        """Write the next tensor: a tensor, or a list of contiguous parts in flat order."""
        expected = self.entries[self.next]
        if name != expected[0]:
            raise ShardError(f"{self.key}: expected tensor {expected[0]} next, got {name}")
        parts = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        if not parts or any(not isinstance(p, torch.Tensor) or p.device.type == "meta" for p in parts):
            raise ShardError(f"{self.key}: tensor {name}: expected a tensor with data (or a list of them), "
                             f"found {short(tensor)}")
        dtype = torch_dtype(expected[1])
        numel = sum(p.numel() for p in parts)
        whole = len(parts) == 1
        found = tuple(parts[0].shape) if whole else (numel,)
        wanted = expected[2] if whole else (expected.nbytes // dtype.itemsize,)
        if any(p.dtype != dtype for p in parts) or found != wanted:
            shapes = [list(p.shape) for p in parts]
            raise ShardError(f"{self.key}: tensor {name}: expected {list(expected[2])} {expected[1]}, "
                             f"found {shapes[0] if whole else shapes} "
                             f"{str(parts[0].dtype).removeprefix('torch.')}")
        total = 0
        for part in parts:
            for data in host_bytes(part):  # GPU shards reach the file through a bounded host buffer
                self._write(data)
                total += data.nbytes
        self.next += 1
        return total

    def close(self) -> FileRecord:
        """Close the file (fsynced first on local filesystems) and return its record."""
        if self.next != len(self.entries):
            raise ShardError(f"{self.key}: {len(self.entries) - self.next} tensors were not written")
        if self.root.local:
            self.handle.flush()
            os.fsync(self.handle.fileno())
        self.handle.close()
        return FileRecord(self.size, self.hasher.block, tuple(self.hasher.finish()))


class StoreWriter:
    """Writes a checkpoint of ``tree`` laid out for ``config`` at ``url``.

    Use :meth:`entries` to see which tensors each rank's file holds, feed them
    with :meth:`write` (each file in its order; different files from
    different threads), then :meth:`commit`. On error, :meth:`abort` removes
    what this writer wrote; as a context manager this happens automatically.

    In a distributed save, each process writes its ranks' files with its own
    writer and the committing process adds the others' records
    (:meth:`add_records`) before :meth:`commit`.

    Args:
        url: the checkpoint's URL (or an opened root).
        tree, config: what is stored, laid out for ``config``.
        storage_options: fsspec options.
        block: checksum block size in bytes, ``0 < block <= MAX_BLOCK``.
        meta: free-form JSON kept in the manifest.
        progress: ``progress(done_bytes, total_bytes)``: tensor bytes written so far and in
            all, after each tensor; the last call (``done == total``) comes before the commit.
        clear: ignored; kept for callers of the earlier API, where it removed
            leftovers of an interrupted save (a writer now never removes
            files it did not write, and its file names never collide).
        token: this writer's file-name token (default: random).
        sharding: ``Sharding(tree, config)`` where the caller holds it already (a plan's
            :meth:`~tenplex.transform.plan.Plan.dst_sharding`); built here otherwise.

    Raises:
        AlreadyExistsError: if ``url`` holds a committed checkpoint, or (on a local root) ``url``
            or its ``shards`` is something other than a directory.
        StoreError: ``block`` out of range.
    """

    def __init__(self, url: str | StoreRoot, tree: PTree, config: ParallelConfig, *,
                 storage_options: dict | None = None, block: int = DEFAULT_BLOCK,
                 meta: dict | None = None, progress: Progress | None = None,
                 clear: bool | None = None, token: str | None = None,
                 sharding: Sharding | None = None):
        self.root = url if isinstance(url, StoreRoot) else StoreRoot(url, storage_options)
        if not 0 < block <= MAX_BLOCK:
            raise StoreError(f"{self.root}: checksum block: expected 0 < block <= {MAX_BLOCK} "
                             f"bytes, found {block}")
        self.tree, self.config = tree, config
        self.sharding = sharding if sharding is not None and sharding.config == config else Sharding(tree, config)
        self.block, self.meta, self.progress = block, dict(meta or {}), progress
        check_writable(self.meta, f"{self.root}: meta", ShardError, depth_used=1)  # what is written must read back
        self.token = token or uuid.uuid4().hex[:16]
        if self.root.exists(MANIFEST):
            raise AlreadyExistsError(f"{self.root}: a committed checkpoint exists; "
                                     "save to a new location (tenplex never overwrites in place)")
        for key in ("", "shards"):  # checked here, not as an errno at the first write
            full = self.root.key(key) if key else self.root.path
            if self.root.local and os.path.lexists(full) and not os.path.isdir(full):
                raise AlreadyExistsError(f"{self.root}{'/' + key if key else ''}: expected a directory "
                                         "or a new path, found a file; save to a new location")
        self._existed = {k: self.root.fs.exists(self.root.key(k) if k else self.root.path)
                         for k in ("", "shards")}
        self._entries: dict[int, list[Entry]] = {}
        self._regions: dict = {}
        for path, leaf in tree.tensors():
            for holders in self.sharding.classes(path):
                rank = holders.ranks[0]
                self._entries.setdefault(rank, []).append(Entry(path, leaf.dtype, holders.holding.shape))
                self._regions[(path, rank)] = [p.box for p in holders.holding.pieces]
        self._files: dict[int, _FileWriter] = {}
        self._created: list[str] = []
        self._finished: set[int] = set()
        self._records: dict[str, FileRecord] = {}
        self._foreign: set[str] = set()
        self._lock = threading.Lock()
        self.total = sum(e.nbytes for entries in self._entries.values() for e in entries)
        self.bytes_written = 0

    def entries(self) -> dict[int, list[Entry]]:
        """``{rank: [(path, dtype, local shape), ...]}`` in file order, for ranks that store data."""
        return {r: list(e) for r, e in self._entries.items()}

    def write(self, rank: int, path: str, tensor: torch.Tensor) -> None:
        """Write ``rank``'s next tensor (``path`` must be the next entry of its file).

        A file is opened at its first tensor and closed after its last, so the
        files open at once are those the caller has started and not finished.
        """
        with self._lock:
            f = self._files.get(rank)
            if f is None:
                if rank not in self._entries:
                    raise ShardError(f"rank {rank} stores no tensors under {self.config}")
                if rank in self._finished:
                    raise ShardError(f"rank {rank}'s shard file is complete; got {path} again")
                key = shard_file(rank, self.token)
                self._created.append(key)
                f = self._files[rank] = _FileWriter(self.root, key, self._entries[rank], self.block)
        with translate_errors(f"{self.root}/{f.key}"):
            n = f.write(path, tensor)
            if f.next == len(f.entries):
                record = f.close()
                with self._lock:
                    self._records[f.key] = record
                    self._finished.add(rank)
                    del self._files[rank]
        with self._lock:
            self.bytes_written += n
            if self.progress:
                self.progress(self.bytes_written, self.total)

    def records(self) -> dict[str, FileRecord]:
        """The shard files this writer has closed: ``{key: FileRecord}``."""
        with self._lock:
            return dict(self._records)

    def add_records(self, records: Mapping[str, FileRecord]) -> None:
        """Add files other processes wrote (a distributed save commits them all at once).

        Their keys must come from :func:`shard_file`; :meth:`commit` checks
        that each exists with its recorded size.
        """
        with self._lock:
            self._records.update(records)
            self._foreign.update(records)

    def _file_of(self) -> dict[int, str]:
        by_rank: dict[int, list[str]] = {}
        for key in self._records:
            by_rank.setdefault(file_rank(key), []).append(key)
        out = {}
        for rank in sorted(self._entries):
            keys = by_rank.get(rank, [])
            if len(keys) != 1:
                raise ShardError(f"{self.root}: rank {rank}'s shard file is "
                                 + ("incomplete" if not keys else f"recorded {len(keys)} times: {keys}"))
            out[rank] = keys[0]
        for key in sorted(self._foreign):
            size = self.root.size(key) if self.root.exists(key) else None
            if size != self._records[key].size:
                raise ShardError(f"{self.root}/{key}: expected a shard file of "
                                 f"{self._records[key].size} bytes, found "
                                 + ("none" if size is None else f"{size} bytes"))
        return out

    def commit(self, values: Mapping[str, Any]) -> Manifest:
        """Write the manifest: the checkpoint becomes visible.

        Args:
            values: ``{path: value}`` for every value leaf (``{key: value}`` for
                scoped leaves); must be JSON-serializable.

        Raises:
            ShardError: if a file is incomplete or a value is missing or not JSON.
            AlreadyExistsError: another writer committed first (its manifest is
                untouched; this writer's files are removed as a context manager).
        """
        file_of = self._file_of()
        vals = check_values(self.tree, values)
        tensors = {}
        for rank, entries in sorted(self._entries.items()):
            offsets = header_bytes(entries)[1]
            for entry, offset in zip(entries, offsets):
                tensors[(entry[0], rank)] = TensorRecord(entry[0], rank, file_of[rank], offset,
                                                         entry.nbytes, entry[2], entry[1])
        files = {k: self._records[k] for k in sorted(file_of.values())}
        manifest = Manifest(self.config, self.tree, vals, files, tensors, self.meta)
        commit_manifest(self.root, manifest.dumps(self._regions))
        return manifest

    def abort(self) -> None:
        """Close open files and remove the files this writer created (nothing was committed)."""
        for f in list(self._files.values()):
            try:
                f.handle.close()
            except Exception:  # the handle may be broken already; removal follows
                pass
        self._files.clear()
        fs = self.root.fs
        for key in self._created:
            try:
                if fs.exists(self.root.key(key)):
                    fs.rm_file(self.root.key(key))
            except (OSError, StoreError):
                pass
        for key in ("shards", ""):  # directories this writer created, if now empty
            path = self.root.key(key) if key else self.root.path
            try:
                if not self._existed[key] and fs.isdir(path) and not fs.ls(path):
                    fs.rmdir(path)
            except OSError:
                pass

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def save(url: str, tree: PTree, config: ParallelConfig, shards_by_rank: Mapping[int, Mapping[str, Any]],
         *, storage_options: dict | None = None, meta: dict | None = None, threads: int = 4,
         block: int = DEFAULT_BLOCK, progress: Progress | None = None) -> Manifest:
    """Save every rank's local shards (held in this process) as a checkpoint at ``url``.

    Args:
        url: an fsspec URL (``file://``, ``memory://``, ``s3://``...) or a path.
        tree: the tree spec.
        config: the config the shards are laid out for.
        shards_by_rank: ``{rank: {path: local tensor or value}}`` for every rank.
        storage_options: fsspec options.
        meta: free-form JSON kept in the manifest.
        threads: files written at once.
        block: checksum block size in bytes.
        progress: ``progress(done_bytes, total_bytes)`` (see :class:`StoreWriter`).

    Returns:
        The committed manifest.

    Raises:
        AlreadyExistsError: ``url`` holds a committed checkpoint, or another
            writer committed there first.
        ShardError: a rank, leaf or value is missing, or has the wrong shape or dtype.
        StoreError: the storage backend failed; nothing is committed.
    """
    missing = sorted(set(range(config.world_size)) - set(shards_by_rank))
    if missing:
        raise ShardError(f"save under {config}: shards of {len(missing)} ranks are missing: {short(missing)}")
    with StoreWriter(url, tree, config, storage_options=storage_options, meta=meta,
                     block=block, progress=progress) as writer:
        def write_rank(item):
            rank, entries = item
            for path, _, _ in entries:
                tensor = shards_by_rank[rank].get(path)
                if tensor is None:
                    raise ShardError(f"rank {rank}: leaf {path} is missing from its shards")
                writer.write(rank, path, tensor)

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(write_rank, writer.entries().items()))
        return writer.commit(gather_values(tree, config, shards_by_rank))
