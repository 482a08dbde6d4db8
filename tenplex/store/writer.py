"""Write a checkpoint: shard files first, the manifest last (the commit).

Each replicated region is stored once, in the file of its holder class's
lowest rank (as PyTorch DCP deduplicates replicas), so a dp=8 checkpoint is
no larger than a dp=1 one apart from sharded optimizer state.

Commit protocol (Orbax's ``atomicity.py`` offers both kinds, "because not
all filesystems support atomic rename"):

1. refuse if ``manifest.json`` exists (never overwrite a commit in place);
   remove leftovers of an earlier interrupted save;
2. write every shard file under ``shards/``;
3. write the manifest: to a temporary name and rename it where rename is
   atomic (local filesystems), else in one object PUT, which object stores
   make visible atomically. A checkpoint without a manifest is invisible.
"""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch

from tenplex.errors import AlreadyExistsError, ShardError, StoreError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, Scope, torch_dtype
from tenplex.store.blocks import DEFAULT_BLOCK, BlockHasher
from tenplex.store.manifest import MANIFEST, FileRecord, Manifest, TensorRecord
from tenplex.store.safetensors_format import Entry, header_bytes
from tenplex.store.url import StoreRoot, translate_errors

__all__ = ["StoreWriter", "save", "Progress"]

Progress = Callable[[str, int], None]
"""``progress(event, nbytes)``: events are ``"bytes"`` (data written), ``"file"``
(a shard file closed), ``"manifest"`` (before the commit) and ``"committed"``."""


def shard_file(rank: int) -> str:
    return f"shards/rank-{rank:05d}.safetensors"


class _FileWriter:
    """One safetensors file written in a stream, in header order, with block digests."""

    def __init__(self, root: StoreRoot, key: str, entries: list[Entry], block: int,
                 progress: Progress | None):
        self.key, self.entries, self.progress = key, entries, progress
        prefix, self.offsets = header_bytes(entries)
        self.hasher = BlockHasher(block)
        self.size = self.offsets[-1] + entries[-1].nbytes if entries else len(prefix)
        self.next = 0
        with translate_errors(f"{root}/{key}"):
            root.fs.makedirs(root.key("shards"), exist_ok=True)
            self.handle = root.fs.open(root.key(key), "wb")
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
        dtype = torch_dtype(expected[1])
        numel = sum(p.numel() for p in parts)
        shape = tuple(parts[0].shape) if len(parts) == 1 else None
        if any(p.dtype != dtype for p in parts) or (shape if shape is not None else (numel,)) != \
                (expected[2] if shape is not None else (Entry(*expected).nbytes // dtype.itemsize,)):
            found = [list(p.shape) for p in parts]
            raise ShardError(f"{self.key}: tensor {name}: expected {list(expected[2])} {expected[1]}, "
                             f"found {found[0] if len(found) == 1 else found} "
                             f"{str(parts[0].dtype).removeprefix('torch.')}")
        total = 0
        for part in parts:
            data = part.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
            self._write(data)
            total += data.nbytes
        self.next += 1
        if self.progress:
            self.progress("bytes", total)
        return total

    def close(self) -> FileRecord:
        if self.next != len(self.entries):
            raise ShardError(f"{self.key}: {len(self.entries) - self.next} tensors were not written")
        self.handle.close()
        if self.progress:
            self.progress("file", self.size)
        return FileRecord(self.size, self.hasher.block, tuple(self.hasher.finish()))


class StoreWriter:
    """Writes a checkpoint of ``tree`` laid out for ``config`` at ``url``.

    Use :meth:`entries` to see which tensors each rank's file holds, feed them
    with :meth:`write` (each file in its order; different files from
    different threads), then :meth:`commit`. On error, :meth:`abort` removes
    what was written; as a context manager this happens automatically.

    With ``clear=False`` leftovers of an interrupted save are kept: in a
    distributed save, one process clears before the others write.

    Raises:
        AlreadyExistsError: if ``url`` holds a committed checkpoint.
    """

    def __init__(self, url: str | StoreRoot, tree: PTree, config: ParallelConfig, *,
                 storage_options: dict | None = None, block: int = DEFAULT_BLOCK,
                 meta: dict | None = None, progress: Progress | None = None, clear: bool = True):
        self.root = url if isinstance(url, StoreRoot) else StoreRoot(url, storage_options)
        self.tree, self.config = tree, config
        self.sharding = Sharding(tree, config)
        self.block, self.meta, self.progress = block, dict(meta or {}), progress
        if self.root.exists(MANIFEST):
            raise AlreadyExistsError(f"{self.root}: a committed checkpoint exists; "
                                     "save to a new location (tenplex never overwrites in place)")
        if clear:  # in a distributed save, only the committing rank clears, before the others write
            self._clear_leftovers()
        self._entries: dict[int, list[Entry]] = {}
        self._regions: dict = {}
        for path, leaf in tree.tensors():
            for cls in self.sharding.classes(path):
                rank = cls.ranks[0]
                self._entries.setdefault(rank, []).append(Entry(path, leaf.dtype, cls.holding.shape))
                self._regions[(path, rank)] = [p.box for p in cls.holding.pieces]
        self._files: dict[int, _FileWriter] = {}
        self._records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0

    def _clear_leftovers(self) -> None:
        with translate_errors(str(self.root)):
            for key in ("shards", MANIFEST + ".tmp"):
                full = self.root.key(key)
                if self.root.fs.exists(full):
                    self.root.fs.rm(full, recursive=True)

    def entries(self) -> dict[int, list[Entry]]:
        """``{rank: [(path, dtype, local shape), ...]}`` in file order, for ranks that store data."""
        return {r: list(e) for r, e in self._entries.items()}

    def write(self, rank: int, path: str, tensor: torch.Tensor) -> None:
        """Write ``rank``'s next tensor (``path`` must be the next entry of its file)."""
        with self._lock:
            f = self._files.get(rank)
            if f is None:
                if rank not in self._entries:
                    raise ShardError(f"rank {rank} stores no tensors under {self.config}")
                f = self._files[rank] = _FileWriter(self.root, shard_file(rank),
                                                    self._entries[rank], self.block, self.progress)
        with translate_errors(f"{self.root}/{f.key}"):
            n = f.write(path, tensor)
            if f.next == len(f.entries):
                self._records[f.key] = f.close()
        with self._lock:
            self.bytes_written += n

    def records(self) -> dict[str, FileRecord]:
        """The shard files this writer has closed: ``{key: FileRecord}``."""
        return dict(self._records)

    def add_records(self, records: Mapping[str, FileRecord]) -> None:
        """Add files other processes wrote (a distributed save commits them all at once)."""
        self._records.update(records)

    def commit(self, values: Mapping[str, Any]) -> Manifest:
        """Write the manifest: the checkpoint becomes visible.

        Args:
            values: ``{path: value}`` for every value leaf (``{key: value}`` for
                scoped leaves); must be JSON-serializable.

        Raises:
            ShardError: if a file is incomplete or a value is missing or not JSON.
        """
        for rank, entries in self._entries.items():
            if shard_file(rank) not in self._records:
                raise ShardError(f"{self.root}: rank {rank}'s shard file is incomplete")
        vals = _check_values(self.tree, values)
        tensors = {}
        for rank, entries in sorted(self._entries.items()):
            offsets = header_bytes(entries)[1]
            for entry, offset in zip(entries, offsets):
                tensors[(entry[0], rank)] = TensorRecord(entry[0], rank, shard_file(rank), offset,
                                                         entry.nbytes, entry[2], entry[1])
        files = {k: self._records[k] for k in sorted(self._records)}
        manifest = Manifest(self.config, self.tree, vals, files, tensors, self.meta)
        data = manifest.dumps(self._regions)
        if self.progress:
            self.progress("manifest", len(data))
        with translate_errors(f"{self.root}/{MANIFEST}"):
            if self.root.atomic_rename:
                tmp = self.root.key(f"{MANIFEST}.tmp-{uuid.uuid4().hex}")
                with self.root.fs.open(tmp, "wb") as f:
                    f.write(data)
                self.root.fs.mv(tmp, self.root.key(MANIFEST))
            else:
                with self.root.fs.open(self.root.key(MANIFEST), "wb") as f:
                    f.write(data)
        if self.progress:
            self.progress("committed", 0)
        return manifest

    def abort(self) -> None:
        """Close open files and remove everything written (nothing was committed)."""
        for f in self._files.values():
            try:
                f.handle.close()
            except Exception:  # the handle may be broken already; removal follows
                pass
        try:
            self._clear_leftovers()
        except StoreError:
            pass

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _check_values(tree: PTree, values: Mapping[str, Any]) -> dict:
    out = {}
    for path, leaf in tree.values():
        if path not in values:
            raise ShardError(f"value leaf {path} has no value")
        value = values[path]
        if leaf.scope is not Scope.GLOBAL and not isinstance(value, Mapping):
            raise ShardError(f"value leaf {path}: expected {{key: value}} for scope {leaf.scope.value}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ShardError(f"value leaf {path}: not JSON-serializable: {exc}") from exc
        out[path] = value
    return out


def gather_values(tree: PTree, config: ParallelConfig, shards_by_rank: Mapping[int, Mapping]) -> dict:
    """Value leaves of every rank's shards as stored values (one per key)."""
    out: dict = {}
    for path, leaf in tree.values():
        if leaf.scope is Scope.GLOBAL:
            out[path] = shards_by_rank[min(shards_by_rank)][path]
        else:
            out[path] = {leaf.key(config, r): shards[path] for r, shards in sorted(shards_by_rank.items())}
    return out


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
        progress: ``progress(event, nbytes)`` callback.

    Returns:
        The committed manifest.

    Raises:
        AlreadyExistsError: ``url`` holds a committed checkpoint.
        ShardError: a rank, leaf or value is missing, or has the wrong shape or dtype.
        StoreError: the storage backend failed; nothing is committed.
    """
    missing = sorted(set(range(config.world_size)) - set(shards_by_rank))
    if missing:
        raise ShardError(f"save under {config}: shards of ranks {missing} are missing")
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
