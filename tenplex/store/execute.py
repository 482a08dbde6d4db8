"""The store executor: run a Plan whose sources are stored shards (a :class:`ShardSource`).

Leaf by leaf, the ops of every requested target are grouped by the stored
tensor they read; each stored tensor is fetched once per leaf, as the union
of the byte runs its ops need (offsets from the stored tensor's first byte;
see :meth:`ShardSource.read`), and the ops
copy their regions into target tensors (fresh ones, or with ``reuse``
buffers that no tensor refers to any more: :mod:`tenplex.store.buffers`).
Reads of a leaf's different stored tensors run on a thread pool, its last one
in the calling thread; with ``inline_local``, a local source is read in the
calling thread alone (the streaming writer's choice: there a write thread
overlaps the reads, and a hand-off to a pool thread costs more than it
overlaps; see :mod:`tenplex.store.stream`), and :meth:`StorePlanRunner.leaves`
reads a tenplex store ahead: neighbouring stored tensors of one file, for a
batch of leaves, in one window.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tenplex.errors import PlanError
from tenplex.ptree.region import Box, flat_start, is_contiguous, relative, to_slices
from tenplex.ptree.shards import piece_view
from tenplex.ptree.tree import PTree, Scope, torch_dtype
from tenplex.store.blocks import MERGE_GAP, box_runs, union_runs
from tenplex.store.buffers import BufferPool
from tenplex.store.source import ShardSource
from tenplex.store.url import StoreRoot
from tenplex.transform.plan import OpKind, Plan

__all__ = ["READ_AHEAD", "StorePlanRunner", "target_values"]

READ_AHEAD = 16 << 20
"""Source bytes a batch of :meth:`StorePlanRunner.leaves` reads ahead, and the most one window
reads (16 MiB; 8, 16, 32 and 64 MiB were measured: docs/benchmarks.md, "Read-ahead windows")."""

@dataclass
class _Op:
    dst: int
    src: int
    region: Box
    src_piece: int
    dst_piece: int
    piece: object = None  # the source piece (a :class:`~tenplex.ptree.sharding.Piece`), looked up once


class StorePlanRunner:
    """Builds target tensors of ``plan`` from the checkpoint behind ``reader``.

    Args:
        reader: the source shards (any :class:`~tenplex.store.source.ShardSource`, e.g. a
            :class:`~tenplex.store.reader.StoreReader`); ``plan.src`` must be its config.
        plan: a plan from the stored config.
        threads: stored tensors fetched at once.
        reuse: take read buffers and assembled targets from a :class:`~tenplex.store.buffers.BufferPool`
            (for a caller that drops each leaf's tensors once written, as the streaming writer
            does; a target's storage may then be larger than the target, so a caller that keeps
            them, or ``torch.save`` s them, should leave it off).
        inline_local: read a local source (every format's but a tenplex store on an object
            store) in the calling thread only, not on the pool.

    Attributes:
        S: the source :class:`~tenplex.ptree.sharding.Sharding` (``reader.sharding``).
        D: the target :class:`~tenplex.ptree.sharding.Sharding` (of ``plan.dst``).
        bytes_needed: unique source bytes the ops read (the I/O floor).

    Raises:
        PlanError: if the plan does not start from the stored config.
    """

    def __init__(self, reader: ShardSource, plan: Plan, threads: int = 8, reuse: bool = False,
                 inline_local: bool = False):
        if plan.src != reader.config:
            raise PlanError(f"plan starts from {plan.src}, the store holds {reader.config}")
        self.reader, self.plan, self.tree = reader, plan, reader.tree
        self.S = reader.sharding
        self.D = plan.dst_sharding(self.tree)
        self.inline = inline_local and _local(reader)
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads))
        self.buffers = BufferPool() if reuse else None
        if reuse and hasattr(reader, "buffers"):
            reader.buffers = self.buffers
        self.bytes_needed = 0
        self._lock = threading.Lock()
        cols = plan.table.cols
        order = np.lexsort((cols["dst"], cols["path"]))
        self._order = order
        paths = cols["path"][order]
        self._index = {p: i for i, p in enumerate(plan.table.paths)}
        self._bounds = np.searchsorted(paths, np.arange(len(plan.table.paths) + 1)).tolist()

    def close(self) -> None:
        self.pool.shutdown()
        if self.buffers is not None and getattr(self.reader, "buffers", None) is self.buffers:
            self.reader.buffers = None

    def _rows(self, path: str, ranks: set[int]) -> list[_Op]:
        i = self._index.get(path)
        if i is None:
            return []
        lo, hi = self._bounds[i], self._bounds[i + 1]
        table, out = self.plan.table, []
        for row in self._order[lo:hi].tolist():
            op = table[row]
            if op.dst_rank in ranks:
                out.append(_Op(op.dst_rank, op.src_rank if op.kind is not OpKind.FILL else -1,
                               op.region, op.src_piece, op.dst_piece))
        return out

    def leaf(self, path: str, ranks) -> dict[int, torch.Tensor]:
        """The local tensors of ``path`` for target ``ranks`` (those that hold it).

        A target filled whole by one contiguous source region is a view of the
        read buffer (no copy); the others are assembled from their ops.
        """
        job = self._prepare(path, ranks)
        pooled = [] if self.inline else job.reads[:-1]  # the last one here: one thread hand-off less
        futures = [self.pool.submit(self.reader.read, rec, s, e) for rec, _, s, e in pooled]
        tensors = [f.result() for f in futures]
        tensors += [self.reader.read(rec, s, e) for rec, _, s, e in job.reads[len(pooled):]]
        return self._assemble(job, tensors)

    def leaves(self, paths: list[str], ranks_of: dict):
        """Yield ``(path, leaf(path, ranks_of[path]))`` for each of ``paths``, in order.

        With ``inline_local`` and a source whose class reads several tensors at once
        (``read_many``: a :class:`~tenplex.store.reader.StoreReader`; a wrapper that only
        forwards attributes does not count, so its own ``read`` is never bypassed), leaves
        are read ahead in batches of about :data:`READ_AHEAD` source bytes: each batch's
        reads from one file are grouped into windows of neighbouring tensors (gaps of at
        most ``MERGE_GAP``, at most :data:`READ_AHEAD` bytes) read as one, so the checksum
        blocks that neighbouring tensors share are read and verified once and never copied
        (one tensor per read copied each shared block out to a cache and back in; on the
        0.5 GB store of ``bench/reshard_scale.py`` the reshard took 13% less time:
        docs/benchmarks.md, "Read-ahead windows"). Only the blocks the reads need are
        fetched, as before.

        Memory: a batch's reads (:data:`READ_AHEAD`, or one leaf's if larger) beyond what
        the caller holds.

        Raises:
            Whatever :meth:`leaf` raises; a batch's read error before any of its leaves is yielded.
        """
        if not (self.inline and callable(getattr(type(self.reader), "read_many", None))):
            for path in paths:
                yield path, self.leaf(path, ranks_of[path])
            return
        batch, nbytes = [], 0
        for path in paths:
            job = self._prepare(path, ranks_of[path])
            batch.append(job)
            nbytes += sum(rec.nbytes for rec, _, _, _ in job.reads)
            if nbytes >= READ_AHEAD:
                yield from self._batch(batch)
                batch, nbytes = [], 0
        yield from self._batch(batch)

    def _batch(self, jobs: list["_Job"]):
        """Read ``jobs``' stored tensors, each file's in windows, then yield each leaf's targets."""
        by_file = defaultdict(list)
        for i, job in enumerate(jobs):
            for j, (rec, _, s, e) in enumerate(job.reads):
                by_file[rec.file].append((i, j, rec, s, e))
        tensors = [[None] * len(job.reads) for job in jobs]
        for reads in by_file.values():
            reads.sort(key=lambda r: r[2].offset)
            for window in _windows(reads):
                got = self.reader.read_many([(rec, s, e) for _, _, rec, s, e in window])
                for (i, j, _, _, _), tensor in zip(window, got):
                    tensors[i][j] = tensor
        for job, got in zip(jobs, tensors):
            yield job.path, self._assemble(job, got)

    def _prepare(self, path: str, ranks) -> "_Job":
        """What ``path``'s targets of ``ranks`` hold, their ops, and the source reads they need."""
        held = {}
        for rank in ranks:
            h = self.D.holding(path, self.plan.dst.coord(rank))
            if h is not None:
                held[rank] = h
        ops_of = defaultdict(list)
        by_record = defaultdict(list)
        holding = {}
        for op in self._rows(path, set(held)):
            ops_of[op.dst].append(op)
            if op.src >= 0:
                h = holding.get(op.src)
                if h is None:
                    h = holding[op.src] = self.S.holding(path, self.plan.src.coord(op.src))
                op.piece = h.pieces[op.src_piece]
                by_record[self.reader.record(path, op.src)].append(op)
        itemsize = self.tree[path].itemsize
        reads = [(rec, ops, *self._runs(ops, itemsize)) for rec, ops in by_record.items()]
        return _Job(path, held, ops_of, reads)

    def _assemble(self, job: "_Job", tensors: list) -> dict[int, torch.Tensor]:
        """The targets of ``job`` from its reads' tensors (in ``job.reads`` order)."""
        leaf = self.tree[job.path]
        dtype = torch_dtype(leaf.dtype)
        sources = {}
        for (_, ops, _, _), source in zip(job.reads, tensors):
            for op in ops:
                sources[id(op)] = source
        out = {}
        for rank, h in job.held.items():
            ops = job.ops_of[rank]
            parts = self._tiling(job.path, h, ops, sources)
            if parts is not None:
                out[rank] = parts[0].view(h.shape) if len(parts) == 1 else parts
                continue
            target = out[rank] = self._empty(h.shape, h.numel, dtype, leaf.itemsize)
            for op in ops:
                tview = self._view(target, h.pieces[op.dst_piece], op.region)
                if op.src < 0:
                    _raw(tview).fill(0)
                else:
                    np.copyto(_raw(tview), _raw(self._view(sources[id(op)], op.piece, op.region)))
        return out

    def _empty(self, shape, numel: int, dtype, itemsize: int) -> torch.Tensor:
        """An uninitialized target tensor, from the buffer pool when it has data."""
        if not numel or self.buffers is None:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self.buffers.take(numel * itemsize)).view(dtype).view(shape)

    def _tiling(self, path, held, ops, sources):
        """Source views that tile the target in flat order (each contiguous at both ends), or None.

        Such a target is never assembled: its parts go to the writer as they are.
        """
        if not ops or any(op.src < 0 for op in ops) or len(held.pieces) != 1:
            return None
        piece = held.pieces[0]
        placed = []
        for op in ops:
            rel = relative(op.region, piece.box)
            local = Box(tuple(l + r for l, r in zip(piece.local.offsets, rel.offsets)), rel.sizes)
            if not is_contiguous(local, piece.view):
                return None
            view = self._view(sources[id(op)], op.piece, op.region)
            if not view.is_contiguous():
                return None
            placed.append((piece.offset + flat_start(local, piece.view), view))
        placed.sort(key=lambda item: item[0])
        position = 0
        for start, view in placed:
            if start != position:
                return None
            position += view.numel()
        return [view for _, view in placed] if position == held.numel else None

    @staticmethod
    def _view(local: torch.Tensor, piece, region: Box) -> torch.Tensor:
        return piece_view(local, piece)[to_slices(relative(region, piece.box))]

    def _runs(self, ops: list[_Op], itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        """The byte runs ``(starts, ends)`` of one stored tensor that ``ops`` read; counts them."""
        starts, lengths = [], []
        for op in ops:
            piece = op.piece
            rel = relative(op.region, piece.box)
            offs = tuple(l + r for l, r in zip(piece.local.offsets, rel.offsets))
            s, n = box_runs(piece.view, offs, op.region.sizes, piece.offset)
            starts.append(s * itemsize)
            lengths.append(np.full(len(s), n * itemsize, dtype=np.int64))
        s = np.concatenate(starts)
        e = s + np.concatenate(lengths)
        needed = _union_bytes(s, e)
        with self._lock:
            self.bytes_needed += needed
        return s, e


@dataclass
class _Job:
    """One leaf's work: targets held (``{rank: Holding}``), their ops, and reads ``[(rec, ops, starts, ends)]``."""
    path: str
    held: dict
    ops_of: dict
    reads: list


def _windows(reads: list):
    """Split one file's reads ``(i, j, rec, starts, ends)``, sorted by ``rec.offset``, into runs
    of neighbours read as one.

    A window ends where the next tensor starts more than ``MERGE_GAP`` bytes after the
    window's end (the bytes between would be read or at least allocated for nothing), or
    where the window would pass :data:`READ_AHEAD` bytes.
    """
    window, start, end = [], 0, 0
    for read in reads:
        rec = read[2]
        if window and (rec.offset > end + MERGE_GAP or rec.offset + rec.nbytes - start > READ_AHEAD):
            yield window
            window = []
        if not window:
            start = rec.offset
            end = rec.offset
        window.append(read)
        end = max(end, rec.offset + rec.nbytes)
    if window:
        yield window


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s bytes as same-size integers (bfloat16 has no numpy type).

    Targets are assembled with numpy, not torch: a torch copy runs on torch's intra-op
    (OpenMP) threads, whose waiting workers take the core the write thread needs: in a
    process with torch's 2 threads on 2 cores, the 0.5 GB store of ``bench/reshard_scale.py``
    resharded in 0.87-1.06 s with torch's copies, 0.58-0.70 s with numpy's (5 runs each,
    interleaved; docs/benchmarks.md)."""
    raw = _RAW.get(t.element_size())
    return (t.view(raw) if raw is not None and t.dtype != raw else t).numpy()


def _local(reader: ShardSource) -> bool:
    """Whether ``reader`` reads local files (a store on an object store does not; other formats do)."""
    root = getattr(reader, "root", None)
    return root.local if isinstance(root, StoreRoot) else True


def _union_bytes(starts: np.ndarray, ends: np.ndarray) -> int:
    s, e = union_runs(starts, ends)
    return int((e - s).sum())


def target_values(tree: PTree, plan: Plan, reader: ShardSource, ranks=None) -> dict:
    """Stored values of the target config: ``{path: value or {key: value}}``, or per rank.

    With ``ranks`` given, returns ``{rank: {path: value}}`` instead.
    """
    per_rank: dict = defaultdict(dict)
    for op in plan.values:
        leaf = tree[op.path]
        value = None
        if op.src_rank >= 0:
            value = reader.value(op.path, leaf.key(plan.src, op.src_rank))
        per_rank[op.dst_rank][op.path] = value
    if ranks is not None:
        return {r: per_rank[r] for r in ranks}
    out: dict = {}
    for path, leaf in tree.values():
        if leaf.scope is Scope.GLOBAL:
            out[path] = per_rank[0][path]
        else:
            out[path] = {leaf.key(plan.dst, r): per_rank[r][path] for r in range(plan.dst.world_size)}
    return out
