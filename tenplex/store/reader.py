"""Read a checkpoint: the manifest, then verified range reads of shard files.

A reader fetches only the byte runs a region needs, widened to whole
checksum blocks, coalesced into few requests, and verifies each block's
xxh3-128 digest before any byte is used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from math import prod

import numpy as np
import torch

from tenplex.errors import CorruptShardError, ManifestError
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import torch_dtype
from tenplex.store.blocks import MERGE_GAP, coalesce, digest, needed_blocks
from tenplex.store.manifest import MANIFEST, Manifest, TensorRecord
from tenplex.store.manifest_parse import MAX_MANIFEST, parse_manifest
from tenplex.store.safetensors_format import check_header, header_length, parse_header
from tenplex.store.url import StoreRoot, translate_errors

__all__ = ["StoreReader", "open_manifest", "OPEN_FILES"]

OPEN_FILES = 16
"""Local shard files a reader keeps open between reads."""



def open_manifest(root: StoreRoot) -> Manifest:
    """Read and check ``root``'s manifest (at most ``MAX_MANIFEST`` bytes are read).

    Raises:
        ManifestError: no manifest (not a committed checkpoint) or a bad one,
            naming the field (see :mod:`tenplex.store.manifest_parse`).
    """
    return parse_manifest(_manifest_bytes(root), f"{root}/{MANIFEST}")


def _manifest_bytes(root: StoreRoot) -> bytes:
    """The manifest file's bytes (at most ``MAX_MANIFEST + 1``; the parser refuses more)."""
    where = f"{root}/{MANIFEST}"
    try:
        with translate_errors(where):
            with root.open_read(MANIFEST, where) as f:
                data = f.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        leftovers = root.exists("shards")
        raise ManifestError(
            f"{where}: no manifest; {root} is not a committed checkpoint"
            + (" (it holds shards of an incomplete save)" if leftovers else "")) from None
    return data


class StoreReader:
    """A committed checkpoint opened for reading.

    The manifest is checked whole when the reader opens (see
    :mod:`tenplex.store.manifest_parse`); each shard file's size and
    safetensors header are checked against it before the file's first read
    (:meth:`check_file`); every block read is checked against its digest
    before any of its bytes is used.

    Args:
        url: the checkpoint's URL.
        storage_options: fsspec options.

    Implements :class:`~tenplex.store.source.ShardSource`.

    Attributes:
        manifest, tree, config, meta: as stored.
        manifest_digest: xxh3-128 hex digest of the manifest file's bytes, as read.
        sharding: the stored layout.
        bytes_read: bytes fetched from shard files so far (thread-safe).
        requests: read requests made so far.
        cache_blocks: boundary blocks kept for the next read: of a block that a tensor (or range)
            read shares with its neighbours, the verified bytes outside that tensor, copied
            (at most one block each); four per shard file (a head and a tail for each of the two
            leaves a reshard builds at once), 16 to 64.
        host_cache: a :class:`~tenplex.store.hostcache.HostBlockCache` whose edge
            blocks other processes of this host share (None: no sharing).
        buffers: a :class:`~tenplex.store.buffers.BufferPool` read buffers come from
            (None: fresh ones); the store executor sets it while it runs.

    Raises:
        ManifestError: see :func:`open_manifest`.
    """

    def __init__(self, url: str | StoreRoot, storage_options: dict | None = None):
        self.root = url if isinstance(url, StoreRoot) else StoreRoot(url, storage_options)
        data = _manifest_bytes(self.root)
        self.manifest = parse_manifest(data, f"{self.root}/{MANIFEST}")
        self.manifest_digest = digest(data)
        self.tree, self.config = self.manifest.tree, self.manifest.config
        self.meta = self.manifest.meta
        self.sharding = self.manifest.sharding or Sharding(self.tree, self.config)
        self.bytes_read = 0
        self.requests = 0
        self.cache_blocks = min(64, max(16, 4 * len(self.manifest.files)))
        self.host_cache = None
        self.buffers = None
        self._lock = threading.Lock()
        self._checked: set[str] = set()
        self._check_locks: dict[str, threading.Lock] = {}
        self._cache: OrderedDict = OrderedDict()
        self._file_locks: dict[str, threading.Lock] = {}
        self._handles: OrderedDict = OrderedDict()
        self._first_rank: dict[str, dict[int, int]] = {}
        self._by_file: dict[str, list[TensorRecord]] | None = None

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

    def records_in(self, key: str) -> list[TensorRecord]:
        """The stored tensors the manifest places in shard file ``key``."""
        if self._by_file is None:
            by_file: dict[str, list[TensorRecord]] = {k: [] for k in self.manifest.files}
            for rec in self.manifest.tensors.values():
                by_file[rec.file].append(rec)
            self._by_file = by_file
        return self._by_file.get(key, [])

    def check_file(self, key: str) -> None:
        """Check shard file ``key``'s size and safetensors header against the manifest (once).

        The header is read through verified blocks, then checked: length
        inside the file, offsets inside the data, no overlaps or holes,
        dtypes and shapes that match each tensor's byte count, and exactly
        the manifest's tensors at the manifest's offsets.

        Raises:
            CorruptShardError: a missing file, a wrong size, a block that
                fails its digest, or a header that lies, naming the file and field.
        """
        if key in self._checked:
            return
        with self._lock:
            lock = self._check_locks.setdefault(key, threading.Lock())
        with lock:
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
            where = f"{self.root}/{key}"
            n = header_length(self.read_bytes(key, 0, min(8, size)), size, where)
            entries = parse_header(self.read_bytes(key, 8, 8 + n), size, where)
            check_header(entries, self.records_in(key), where)
            self._checked.add(key)

    def check_files(self, threads: int = 8) -> None:
        """:meth:`check_file` every shard file of the manifest, ``threads`` at once.

        Raises:
            CorruptShardError: the first file (in name order) that fails.
        """
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(self.check_file, sorted(self.manifest.files)))

    def read_bytes(self, key: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of shard file ``key``, every block they touch verified.

        Raises:
            CorruptShardError: see :meth:`read`.
        """
        frec = self.manifest.files[key]
        start, end = max(0, start), min(end, frec.size)
        if end <= start:
            return memoryview(b"")
        blocks = needed_blocks(np.array([start]), np.array([end]), frec.block, frec.size)
        span, span_start = self._fill(key, frec, blocks, start, end)
        return memoryview(span)[start - span_start: end - span_start]

    def read(self, rec: TensorRecord, starts: np.ndarray | None = None,
             ends: np.ndarray | None = None) -> torch.Tensor:
        """``rec``'s local tensor with (at least) the bytes ``[starts[i], ends[i])`` filled.

        Offsets are relative to the tensor's first byte; ``None`` means all of it.
        Bytes outside the requested runs and their blocks are undefined.

        Raises:
            CorruptShardError: a missing or truncated file, a header that lies,
                or a block whose digest differs from the manifest's, naming
                file, tensor and digests.
        """
        return self.read_many([(rec, starts, ends)])[0]

    def read_many(self, requests: list) -> list[torch.Tensor]:
        """:meth:`read` of several tensors of one shard file, into one buffer: ``[tensor, ...]``.

        ``requests`` are ``(rec, starts, ends)`` as :meth:`read` takes them (byte offsets from
        each tensor's first byte, int64 arrays, or ``None`` for all of it), every ``rec`` in the
        same file. Returns one tensor per request, of ``rec.shape`` and ``rec.dtype``. The blocks they need are fetched as one union (a block two neighbouring
        tensors share is read and verified once, and not copied), and each tensor is a view of
        the buffer, which spans the first tensor's first byte to the last one's last: so the
        caller groups tensors that lie close together (the streaming executor's read-ahead,
        :mod:`tenplex.store.execute`).

        Raises:
            ValueError: ``requests`` is empty or names more than one file.
            CorruptShardError: as :meth:`read`.
        """
        if not requests or len({rec.file for rec, _, _ in requests}) != 1:
            raise ValueError(f"read_many: expected requests of one shard file, found {len(requests)} "
                             f"in {sorted({rec.file for rec, _, _ in requests})}")
        key = requests[0][0].file
        self.check_file(key)
        frec = self.manifest.files[key]
        starts, ends = [], []
        for rec, s, e in requests:
            if s is None:
                s, e = np.array([0]), np.array([rec.nbytes])
            starts.append(s + rec.offset)
            ends.append(e + rec.offset)
        blocks = needed_blocks(np.concatenate(starts), np.concatenate(ends), frec.block, frec.size)
        sized = [rec for rec, _, _ in requests if rec.nbytes]
        span = span_start = None
        if len(blocks) and sized:
            lo, hi = min(r.offset for r in sized), max(r.offset + r.nbytes for r in sized)
            span, span_start = self._fill(key, frec, blocks, lo, hi)
        return [self._tensor(rec, span, span_start) for rec, _, _ in requests]

    @staticmethod
    def _tensor(rec: TensorRecord, span, span_start) -> torch.Tensor:
        """``rec``'s tensor viewing ``span`` (file bytes from ``span_start``), or an empty one."""
        dtype = torch_dtype(rec.dtype)
        if not rec.nbytes or span is None:
            return torch.empty(rec.shape, dtype=dtype)
        lo = rec.offset - span_start
        raw = span[lo: lo + rec.nbytes]
        if lo % dtype.itemsize:  # a misaligned tensor (rare): copy it to aligned memory
            raw = raw.copy()
        tensor = torch.from_numpy(raw).view(dtype)
        return tensor.view(rec.shape) if prod(rec.shape) else tensor.reshape(rec.shape)

    def _fill(self, key: str, frec, blocks: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """A buffer with ``blocks`` of file ``key`` in place, verified; ``(span, span_start)``.

        ``span`` holds file bytes from ``span_start``: all of ``[lo, hi)`` (the tensor or the
        range asked for) and every block fetched now, whole (a block is verified whole).
        A block whose bytes inside ``[lo, hi)`` a cached boundary piece holds (verified when
        fetched) is copied in from there, only where it meets ``[lo, hi)``, so a small tensor
        inside a cached block costs a copy of its own bytes. The others are read straight into
        ``span`` (``readinto`` on local files). Fetches from one file are serialized (files are
        read in parallel), so two neighbouring tensors never fetch their shared boundary block twice.
        """
        with self._lock:
            file_lock = self._file_locks.setdefault(key, threading.Lock())
        with file_lock:
            missing, cached = [], []
            with self._lock:
                for b in blocks.tolist():
                    a, e = max(b * frec.block, lo), min((b + 1) * frec.block, frec.size, hi)
                    piece = self._cache.get((key, b))
                    if piece is not None and piece[0] <= a and e <= piece[0] + len(piece[1]):
                        self._cache.move_to_end((key, b))
                    else:
                        data = self._shared(key, frec, b)
                        piece = None if data is None else (b * frec.block, data)
                    if piece is None:
                        missing.append(b)
                    else:
                        cached.append((a, e, piece))
            span_start, span_end = lo, hi
            if missing:  # the buffer covers the tensor and every block fetched: the first may
                # start before the tensor's first byte, and the last may end past its end
                span_start = min(lo, missing[0] * frec.block)
                span_end = max(hi, min((missing[-1] + 1) * frec.block, frec.size))
            n = span_end - span_start
            span = np.empty(n, dtype=np.uint8) if self.buffers is None else self.buffers.take(n)
            for a, e, (p, data) in cached:
                if e > a:
                    span[a - span_start: e - span_start] = np.frombuffer(data, dtype=np.uint8)[a - p: e - p]
            runs = coalesce(np.asarray(missing, dtype=np.int64), MERGE_GAP // frec.block)
            if runs:
                self._fetch(key, frec, runs, span, span_start, lo, hi)
        return span, span_start

    def _shared(self, key: str, frec, index: int) -> bytes | None:
        """An edge block another process of this host fetched (checked against its digest), or None."""
        host = self.host_cache
        if host is None or not host.wanted(key, index):
            return None
        data = host.get(key, index)
        size = min((index + 1) * frec.block, frec.size) - index * frec.block
        if data is None or len(data) != size or digest(data) != frec.digests[index]:
            return None
        host.bytes_shared += len(data)
        return data

    def _fetch(self, key: str, frec, runs, span: np.ndarray, span_start: int, lo: int, hi: int) -> None:
        """Read block runs ``[(first, last + 1)]`` into ``span``, one request each; verify every block.

        Of each run's first and last block, the verified bytes outside ``[lo, hi)`` (what the
        neighbouring tensors need) are copied to the boundary cache: a copy, not a view, so that
        ``span`` is free for reuse as soon as its tensor is written (views kept every read buffer
        of the last 64 reads alive, so a :class:`~tenplex.store.buffers.BufferPool` handed out
        fresh, page-faulting ones: half the bytes of a reshard).
        """
        starts = [a * frec.block for a, _ in runs]
        ends = [min(b * frec.block, frec.size) for _, b in runs]
        where = f"{self.root}/{key}"
        with translate_errors(where):
            try:
                if self.root.local:  # a local file: read straight into place
                    f = self._handle(key, where)
                    for a, b in zip(starts, ends):
                        f.seek(a)
                        got = f.readinto(memoryview(span)[a - span_start: b - span_start])
                        _check_length(where, a, b, got)
                else:
                    chunks = self.root.fs.cat_ranges([self.root.key(key)] * len(runs), starts, ends,
                                                     on_error="raise")
                    for a, b, data in zip(starts, ends, chunks):
                        _check_length(where, a, b, len(data))
                        span[a - span_start: b - span_start] = np.frombuffer(data, dtype=np.uint8)
            except FileNotFoundError:
                raise CorruptShardError(f"{where}: shard file is missing") from None
        view = memoryview(span)
        for first, last in runs:
            for index in range(first, last):
                a = index * frec.block - span_start
                actual = digest(view[a: min(a + frec.block, frec.size - span_start)])
                if actual != frec.digests[index]:
                    raise self.mismatch(key, index, actual)
        keep = []  # boundary blocks are likely shared with the next tensor
        for first, last in runs:
            for index in {first, last - 1}:
                piece = self._outside(index * frec.block, min((index + 1) * frec.block, frec.size), lo, hi)
                if piece is not None:
                    keep.append(((key, index), (piece[0], self._copy(view, piece, span_start))))
        with self._lock:
            self.bytes_read += sum(b - a for a, b in zip(starts, ends))
            self.requests += len(runs)
            self._cache.update(keep)
            while len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)
        if self.host_cache is not None:  # leave edge blocks for this host's other processes
            for first, last in runs:
                for index in range(first, last):
                    if self.host_cache.wanted(key, index):
                        a = index * frec.block - span_start
                        self.host_cache.put(key, index, view[a: min(a + frec.block, frec.size - span_start)])

    def _handle(self, key: str, where: str):
        """An open handle of local shard file ``key`` (the caller holds the file's lock).

        At most :data:`OPEN_FILES` stay open (least recently used first out; a handle another
        thread is reading stays), so a store of many files never runs out of descriptors, and a
        reshard opens each file once, not once per read (the path checks cost 86 us per open).
        """
        with self._lock:
            f = self._handles.get(key)
            if f is not None:
                self._handles.move_to_end(key)
                return f
        f = self.root.open_read(key, where)
        with self._lock:
            self._handles[key] = f
            for victim in list(self._handles):
                if len(self._handles) <= OPEN_FILES:
                    break
                lock = self._file_locks.get(victim)
                if victim != key and lock is not None and lock.acquire(blocking=False):
                    try:
                        self._handles.pop(victim).close()
                    finally:
                        lock.release()
        return f

    def close(self) -> None:
        """Close the shard files kept open (a later read opens them again)."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), OrderedDict()
        for f in handles:
            f.close()

    @staticmethod
    def _outside(a: int, e: int, lo: int, hi: int) -> tuple[int, int] | None:
        """The part of block ``[a, e)`` that other tensors than ``[lo, hi)`` may need, or None.

        One range: the bytes after ``hi``, or before ``lo``, or the whole block if ``[lo, hi)``
        lies strictly inside it; None for a block inside ``[lo, hi)``.
        """
        before, after = a < lo, hi < e
        if before and after:
            return a, e
        if after:
            return hi, e
        if before:
            return a, lo
        return None

    def _copy(self, view: memoryview, piece: tuple[int, int], span_start: int) -> np.ndarray:
        a, e = piece
        out = np.empty(e - a, np.uint8) if self.buffers is None else self.buffers.take(e - a)
        out[:] = np.frombuffer(view[a - span_start: e - span_start], np.uint8)
        return out

    def mismatch(self, key: str, index: int, actual: str) -> CorruptShardError:
        """The error for block ``index`` of file ``key`` whose digest is ``actual``."""
        frec = self.manifest.files[key]
        lo, hi = index * frec.block, min((index + 1) * frec.block, frec.size)
        holders = [t.path for t in self.records_in(key) if t.offset < hi and t.offset + t.nbytes > lo]
        return CorruptShardError(
            f"{self.root}/{key}: checksum mismatch in block {index} (bytes {lo}..{hi}) holding "
            f"{', '.join(holders) if holders else 'the file header'}: "
            f"expected xxh3-128 {frec.digests[index]}, found {actual}")

    def value(self, path: str, key: str):
        """The stored value of value leaf ``path`` for ``key`` (``""`` for global), or None."""
        stored = self.manifest.values[path]
        return stored if key == "" else stored.get(key)


def _check_length(where: str, start: int, end: int, got: int) -> None:
    if got != end - start:
        raise CorruptShardError(f"{where}: short read at [{start}, {end}): got {got} bytes; "
                                "the file is truncated")
