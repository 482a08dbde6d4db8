"""Read a checkpoint: the manifest, then verified range reads of shard files.

A reader fetches only the byte runs a region needs, widened to whole
checksum blocks, coalesced into few requests, and verifies each block's
xxh3-128 digest before any byte is used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from math import prod

import numpy as np
import torch

from tenplex.errors import CorruptShardError, ManifestError
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import torch_dtype
from tenplex.store.blocks import MERGE_GAP, coalesce, digest, needed_blocks
from tenplex.store.manifest import MANIFEST, Manifest, TensorRecord
from tenplex.store.url import StoreRoot, translate_errors

__all__ = ["StoreReader", "open_manifest"]


def open_manifest(root: StoreRoot) -> Manifest:
    """Read and validate ``root``'s manifest.

    Raises:
        ManifestError: no manifest (not a committed checkpoint) or a bad one.
    """
    where = f"{root}/{MANIFEST}"
    try:
        with translate_errors(where):
            data = root.fs.cat_file(root.key(MANIFEST))
    except FileNotFoundError:
        leftovers = root.exists("shards")
        raise ManifestError(
            f"{where}: no manifest; {root} is not a committed checkpoint"
            + (" (it holds shards of an incomplete save)" if leftovers else "")) from None
    return Manifest.loads(data, where)


class StoreReader:
    """A committed checkpoint opened for reading.

    Args:
        url: the checkpoint's URL.
        storage_options: fsspec options.

    Implements :class:`~tenplex.store.source.ShardSource`.

    Attributes:
        manifest, tree, config, meta: as stored.
        sharding: the stored layout.
        bytes_read: bytes fetched from shard files so far (thread-safe).

    Raises:
        ManifestError: see :func:`open_manifest`.
    """

    def __init__(self, url: str | StoreRoot, storage_options: dict | None = None):
        self.root = url if isinstance(url, StoreRoot) else StoreRoot(url, storage_options)
        self.manifest = open_manifest(self.root)
        self.tree, self.config = self.manifest.tree, self.manifest.config
        self.meta = self.manifest.meta
        self.sharding = Sharding(self.tree, self.config)
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._checked: set[str] = set()
        self._cache: OrderedDict = OrderedDict()
        self._file_locks: dict[str, threading.Lock] = {}
        self.cache_blocks = 64
        self._first_rank: dict[str, dict[int, int]] = {}

    def record(self, path: str, rank: int) -> TensorRecord:
        """The stored tensor that holds ``path``'s data for ``rank`` (its holder class's record).

        Raises:
            ManifestError: if the manifest has no such tensor.
        """
        firsts = self._first_rank.get(path)
        if firsts is None:
            firsts = {r: c.ranks[0] for c in self.sharding.classes(path) for r in c.ranks}
            self._first_rank[path] = firsts
        rec = self.manifest.tensors.get((path, firsts.get(rank, -1)))
        if rec is None:
            raise ManifestError(f"{self.root}: no stored tensor holds leaf {path} for rank {rank}")
        return rec

    def check_file(self, key: str) -> None:
        """Raise CorruptShardError if shard file ``key`` is missing or has the wrong size."""
        if key in self._checked:
            return
        expected = self.manifest.files[key].size
        try:
            size = self.root.size(key)
        except FileNotFoundError:
            raise CorruptShardError(f"{self.root}/{key}: shard file is missing") from None
        if size != expected:
            raise CorruptShardError(f"{self.root}/{key}: shard file is truncated or altered: "
                                    f"expected {expected} bytes, found {size}")
        self._checked.add(key)

    def read(self, rec: TensorRecord, starts: np.ndarray | None = None,
             ends: np.ndarray | None = None) -> torch.Tensor:
        """``rec``'s local tensor with (at least) the bytes ``[starts[i], ends[i])`` filled.

        Offsets are relative to the tensor's first byte; ``None`` means all of it.
        Bytes outside the requested runs and their blocks are undefined.

        Raises:
            CorruptShardError: a missing or truncated file, or a block whose
                digest differs from the manifest's, naming file, tensor and digests.
        """
        self.check_file(rec.file)
        frec = self.manifest.files[rec.file]
        if starts is None:
            starts, ends = np.array([0]), np.array([rec.nbytes])
        dtype = torch_dtype(rec.dtype)
        if not rec.nbytes:
            return torch.empty(rec.shape, dtype=dtype)
        blocks = needed_blocks(starts + rec.offset, ends + rec.offset, frec.block, frec.size)
        if not len(blocks):
            return torch.empty(rec.shape, dtype=dtype)
        # the buffer covers the whole tensor and every needed block: the first needed
        # block may start after the tensor's first byte, and the last may end past its end
        span_start = min(int(blocks[0]) * frec.block, rec.offset)
        span_end = max(min((int(blocks[-1]) + 1) * frec.block, frec.size), rec.offset + rec.nbytes)
        span = np.empty(span_end - span_start, dtype=np.uint8)
        self._fill(rec, frec, blocks, span, span_start)
        lo = rec.offset - span_start
        raw = span[lo: lo + rec.nbytes]
        if lo % dtype.itemsize:  # a misaligned tensor (rare): copy it to aligned memory
            raw = raw.copy()
        tensor = torch.from_numpy(raw).view(dtype)
        return tensor.view(rec.shape) if prod(rec.shape) else tensor.reshape(rec.shape)

    def _fill(self, rec, frec, blocks: np.ndarray, span: np.ndarray, span_start: int) -> None:
        """Put ``blocks`` of ``rec.file`` into ``span`` (file bytes from ``span_start``), verified.

        Cached boundary blocks are copied in; the others are read straight into
        ``span`` (``readinto`` on local files). Fetches from one file are
        serialized (files are read in parallel), so two neighbouring tensors
        never fetch their shared boundary block twice.
        """
        with self._lock:
            file_lock = self._file_locks.setdefault(rec.file, threading.Lock())
        with file_lock:
            missing = []
            with self._lock:
                for b in blocks.tolist():
                    data = self._cache.get((rec.file, b))
                    if data is None:
                        missing.append(b)
                        continue
                    self._cache.move_to_end((rec.file, b))
                    a = b * frec.block - span_start
                    span[a: a + len(data)] = np.frombuffer(data, dtype=np.uint8)
            runs = coalesce(np.asarray(missing, dtype=np.int64), MERGE_GAP // frec.block)
            if runs:
                self._fetch(rec, frec, runs, span, span_start)

    def _fetch(self, rec, frec, runs, span: np.ndarray, span_start: int) -> None:
        """Read block runs ``[(first, last + 1)]`` into ``span``, one request each; verify every block."""
        full = self.root.key(rec.file)
        starts = [a * frec.block for a, _ in runs]
        ends = [min(b * frec.block, frec.size) for _, b in runs]
        with translate_errors(f"{self.root}/{rec.file}"):
            try:
                if self.root.atomic_rename:  # a local file: read straight into place
                    with open(full, "rb") as f:
                        for a, b in zip(starts, ends):
                            f.seek(a)
                            got = f.readinto(memoryview(span)[a - span_start: b - span_start])
                            if got != b - a:
                                raise CorruptShardError(
                                    f"{self.root}/{rec.file}: short read at [{a}, {b}): got {got} "
                                    "bytes; the file is truncated")
                else:
                    chunks = self.root.fs.cat_ranges([full] * len(runs), starts, ends, on_error="raise")
                    for a, b, data in zip(starts, ends, chunks):
                        if len(data) != b - a:
                            raise CorruptShardError(
                                f"{self.root}/{rec.file}: short read at [{a}, {b}): got {len(data)} "
                                "bytes; the file is truncated")
                        span[a - span_start: b - span_start] = np.frombuffer(data, dtype=np.uint8)
            except FileNotFoundError:
                raise CorruptShardError(f"{self.root}/{rec.file}: shard file is missing") from None
        view = memoryview(span)
        for first, last in runs:
            for index in range(first, last):
                a = index * frec.block - span_start
                part = view[a: min(a + frec.block, frec.size - span_start)]
                actual = digest(part)
                if actual != frec.digests[index]:
                    raise self.mismatch(rec.file, index, actual)
        with self._lock:
            self.bytes_read += sum(b - a for a, b in zip(starts, ends))
            self.requests += len(runs)
            for first, last in runs:  # boundary blocks are likely shared with the next tensor
                for index in {first, last - 1}:
                    a = index * frec.block - span_start
                    self._cache[(rec.file, index)] = bytes(view[a: min(a + frec.block, frec.size - span_start)])
            while len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)

    def mismatch(self, key: str, index: int, actual: str) -> CorruptShardError:
        """The error for block ``index`` of file ``key`` whose digest is ``actual``."""
        frec = self.manifest.files[key]
        lo, hi = index * frec.block, min((index + 1) * frec.block, frec.size)
        holders = [t.path for t in self.manifest.tensors.values()
                   if t.file == key and t.offset < hi and t.offset + t.nbytes > lo]
        return CorruptShardError(
            f"{self.root}/{key}: checksum mismatch in block {index} (bytes {lo}..{hi}) holding "
            f"{', '.join(holders) if holders else 'the file header'}: "
            f"expected xxh3-128 {frec.digests[index]}, found {actual}")

    def value(self, path: str, key: str):
        """The stored value of value leaf ``path`` for ``key`` (``""`` for global), or None."""
        stored = self.manifest.values[path]
        return stored if key == "" else stored.get(key)
