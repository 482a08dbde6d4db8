"""The torch.distributed executor: every process sends what others need and receives what it lacks.

All processes of the transition group hold the same plan (planning is
deterministic, so each computes it alone, and :mod:`~tenplex.transform.agree`
checks that the digests match). Process ``p`` may hold a source rank
(``src_of[p]``), a target rank (``dst_of[p]``), both or neither.

- Ops whose source and target live in the same process are local copies.
- Regions of at least :data:`~tenplex.transform.exchange.DIRECT_MIN` bytes
  that are one contiguous run in both the source and the target shard are
  sent from the source shard and received into the target tensor directly:
  no buffer, no copy.
- The other ops between each ordered pair of processes form a byte stream
  (:mod:`~tenplex.transform.streams`), cut into chunks sized by each
  process's real peers and moved in rounds of batched point-to-point
  operations (:mod:`~tenplex.transform.exchange`): two rounds are in flight,
  so round r + 1 is packed while round r moves; local copies run while the
  first rounds are in flight. A region of at least ``DIRECT_MIN`` bytes that
  is contiguous at one end only (a row-parallel slice: strided in its source
  shard, whole rows of its target) is used in place at that end: sent from
  the shard, or received into the target tensor, with one copy at the other
  end instead of two.
- STORE ops (recovery of regions no survivor holds) are range reads from a
  committed store, in a thread pool started before round 0, so they overlap
  the rounds; FILL ops zero new padding.
- ``memory_budget`` bounds the transfer buffers a process holds at once:
  chunks of two rounds (sends and receives), plus the store reads in
  flight (half of the budget goes to each when there are store reads).
  ``DistStats.peak_buffer`` reports the most held.

Source shards are never written, so the state held before a transfer stays
usable if the transfer fails. Target tensors are the caller's (``out``),
filled in place, or new ones; a new target tensor that one local op fills
whole from a contiguous source region is a view of the old shard (no copy).
Every wait goes through the :class:`~tenplex.transform.guard.TransferGuard`,
so a failure anywhere surfaces here as a TransferError within its bounds.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tenplex.errors import PlanError
from tenplex.ptree.region import Box, decompose_flat, is_contiguous, relative, shift, to_slices, volume
from tenplex.ptree.shards import piece_view
from tenplex.ptree.tree import PTree
from tenplex.transform.comm import Comm
from tenplex.transform.exchange import Clock, exchange
from tenplex.transform.guard import DEFAULT_TIMEOUT, TransferGuard
from tenplex.transform.local import allocate
from tenplex.transform.plan import FILL_CODE, LINK_CODE, Link, OpKind, Plan
from tenplex.transform.streams import MIN_CHUNK, Buffers, chunk_shares

__all__ = ["DistStats", "execute_distributed", "DEFAULT_BUDGET"]

DEFAULT_BUDGET = 256 << 20
"""Bytes of transfer buffers a process may hold at once (256 MiB)."""

STORE_THREADS = 4
"""Store reads in flight at once during recovery."""

_STORE, _LOCAL = LINK_CODE[Link.STORE], LINK_CODE[Link.LOCAL]


@dataclass
class DistStats:
    """What one process moved, in bytes: ``sent``, ``received``, ``local`` copies,
    ``store`` reads, ``filled`` padding; ``rounds`` of exchange; ``peak_buffer``
    bytes of transfer buffers held at once (chunks and store reads); ``peers``
    it exchanged with; ``chunk`` the largest chunk size it used; ``times`` seconds spent per
    phase (``allocate``, ``setup``: row classes and views, ``pack``, ``post``, ``local``:
    copies within the process, ``wait``: blocked on transfers, ``unpack``, ``store``), and ``cpu``
    the CPU seconds of the calling thread in the same phases (without the backend's threads)."""

    sent: int = 0
    received: int = 0
    local: int = 0
    store: int = 0
    filled: int = 0
    rounds: int = 0
    peak_buffer: int = 0
    chunk: int = 0
    peers: list[int] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


def execute_distributed(plan: Plan, tree: PTree, local: dict[str, Any] | None, comm: Comm,
                        src_of: Sequence[int | None], dst_of: Sequence[int | None], *,
                        memory_budget: int = DEFAULT_BUDGET,
                        store_read: Callable | None = None,
                        device: str | torch.device = "cpu",
                        guard: TransferGuard | None = None,
                        timeout: float = DEFAULT_TIMEOUT,
                        out: dict[str, torch.Tensor] | None = None) -> tuple[dict | None, DistStats]:
    """Run ``plan`` across the processes of ``comm``.

    Args:
        plan: the plan (the same on every process).
        tree: the tree spec.
        local: this process's source shards (``{path: local tensor}``), or
            ``None`` if it holds no source rank. Checked by the caller
            (:func:`~tenplex.transform.agree.local_problems`).
        comm: the communicator; ``comm.rank`` is this process.
        src_of: per process, the source rank it holds (or ``None``).
        dst_of: per process, the target rank it will hold (or ``None``).
        memory_budget: bytes of transfer buffers a process may hold at once.
        store_read: ``store_read(path, box) -> tensor`` for STORE ops (called
            from worker threads).
        device: where target tensors and buffers are allocated.
        guard: the caller's fail-together guard (already entered); default
            a new one over ``comm`` with ``timeout``.
        timeout: seconds a silent peer is waited for (only without ``guard``).
        out: the target tensors to fill in place (``{path: tensor}``, every tensor leaf this
            process's target rank holds, contiguous, of the local shape and dtype, on
            ``device``, sharing no memory with ``local``; checked by the caller,
            :func:`~tenplex.transform.agree.out_problems`); default: new tensors.

    Returns:
        ``(target shards or None, stats)``; tensor leaves only (values are
        handled by :func:`tenplex.elastic.reconfigure`).

    Raises:
        PlanError: the process mapping does not fit the plan, or STORE ops
            without ``store_read``.
        TransferError: a peer failed, died or timed out.
    """
    if guard is None:
        with TransferGuard(comm, timeout=timeout, what="execute_distributed") as own:
            return execute_distributed(plan, tree, local, comm, src_of, dst_of,
                                       memory_budget=memory_budget, store_read=store_read,
                                       device=device, guard=own, out=out)
    me, stats = comm.rank, DistStats()
    clock = Clock(stats.times, stats.cpu)
    proc_src = _owners(src_of, plan.src.world_size, "source")
    proc_dst = _owners(dst_of, plan.dst.world_size, "target")
    my_dst = dst_of[me]
    given = out is not None
    with clock("allocate"):
        if given:  # the caller's tensors, filled in place
            out = dict(out) if my_dst is not None else None
        else:
            out = allocate(tree, plan.dst_sharding(tree), my_dst) if my_dst is not None else None
            if out is not None and torch.device(device).type != "cpu":
                out = {k: v.to(device) for k, v in out.items()}
    with clock("setup"):  # which rows go where (every process can tell for every row)
        c = plan.table.cols
        n = len(c["dst"])
        src_proc = np.where(c["src"] >= 0, proc_src[np.maximum(c["src"], 0)], -1)
        dst_proc = proc_dst[c["dst"]] if n else np.zeros(0, dtype=np.int64)
        fill, store = c["kind"] == FILL_CODE, c["link"] == _STORE
        cross = (src_proc >= 0) & (src_proc != dst_proc) & ~fill & ~store
        ctx = _Context(plan, tree, local, out)
        mine_in = dst_proc == me
        local_rows = np.nonzero(mine_in & (src_proc == me) & ~store | mine_in & fill)[0]
        store_rows = np.nonzero(mine_in & store & ~fill)[0]
        if out is not None and local is not None and not given:
            local_rows = _share_unchanged(ctx, local_rows, mine_in, stats)
        if len(store_rows) and store_read is None:
            op = ctx.op(int(store_rows[0]))
            raise PlanError(f"plan reads {op.path} {op.region} from a store, but no store was given")
        sends, recvs = defaultdict(list), defaultdict(list)
        for row in np.nonzero(cross & (src_proc == me))[0].tolist():
            sends[int(dst_proc[row])].append(row)
        for row in np.nonzero(cross & mine_in)[0].tolist():
            recvs[int(src_proc[row])].append(row)
        if sends and local is None:
            raise PlanError(f"process {me} must send but holds no source shards")
        stats.peers = sorted(set(sends) | set(recvs))
        # a process with store reads gives half of its budget to them; every process knows which do
        reading = np.bincount(dst_proc[store & ~fill], minlength=comm.size)[: comm.size] > 0
        p2p_budget = np.where(reading, memory_budget // 2, memory_budget)
        shares = chunk_shares(src_proc[cross], dst_proc[cross], comm.size, p2p_budget)
        buffers = Buffers()
        reads = _StoreReads(ctx, store_rows, store_read, memory_budget - int(p2p_budget[me]), buffers)
        pending = guard.pending  # posted exchanges not yet waited for: the guard aborts them on failure
    try:
        reads.start()

        def meanwhile():
            guard.phase("local copy")
            for row in local_rows.tolist():
                ctx.local_op(row, stats)

        exchange(ctx, comm, guard, sends, recvs, shares, buffers, stats, device, meanwhile, pending)
        guard.phase("store read")
        with clock("store"):
            stats.store = reads.finish()
    finally:
        reads.close()
    stats.peak_buffer = buffers.peak
    return out, stats


def _share_unchanged(ctx: "_Context", local_rows: np.ndarray, mine_in: np.ndarray,
                     stats: DistStats) -> np.ndarray:
    """Target tensors that one local op fills whole from a contiguous source region share its storage.

    Returns the local rows that still need copying. Shared tensors are views
    of the old shards: the old state is never written, and the new one costs
    no copy (replicated norms, a kept slice of an axis-0 split, ...).
    """
    c = ctx.table.cols
    counts = np.bincount(c["path"][mine_in], minlength=len(ctx.table.paths))
    alone = ((counts[c["path"][local_rows]] == 1) & (c["kind"][local_rows] != FILL_CODE)
             & (c["link"][local_rows] == _LOCAL))
    keep = np.ones(len(local_rows), dtype=bool)
    for i in np.nonzero(alone)[0].tolist():
        row = int(local_rows[i])
        op = ctx.op(row)
        target = ctx.out.get(op.path)
        view = ctx.src_view(row)
        if view.is_contiguous() and view.numel() == target.numel() and view.dtype == target.dtype:
            ctx.out[op.path] = view.view(target.shape)
            stats.local += op.nbytes
            keep[i] = False
    return local_rows[keep]


def _owners(of: Sequence[int | None], world: int, what: str) -> np.ndarray:
    owners = np.full(world, -1, dtype=np.int64)
    for proc, rank in enumerate(of):
        if rank is not None:
            if not 0 <= rank < world or owners[rank] >= 0:
                raise PlanError(f"{what} rank {rank} is given to two processes or is out of range")
            owners[rank] = proc
    return owners


class _Context:
    """Views of source and target regions for plan rows."""

    def __init__(self, plan: Plan, tree: PTree, local, out):
        self.S, self.D = plan.src_sharding(tree), plan.dst_sharding(tree)
        self.local, self.out = local, out
        self.table = plan.table
        self._held: dict = {}
        self._ops: dict = {}
        self._views: dict = {}  # (shards, path, piece index) -> the piece's view
        self._coords: dict = {}  # (sharding, rank) -> coordinates (a few ranks, many leaves)

    def op(self, row: int):
        op = self._ops.get(row)
        if op is None:
            op = self._ops[row] = self.table[row]
        return op

    def _piece(self, sharding, rank, path, index):
        key = (id(sharding), rank, path)
        held = self._held.get(key)
        if held is None:
            coord = self._coords.get((id(sharding), rank))
            if coord is None:
                coord = self._coords[(id(sharding), rank)] = sharding.config.coord(rank)
            held = self._held[key] = sharding.holding(path, coord)
        return held.pieces[index]

    def contiguous(self, row: int, src: bool) -> bool:
        """Whether the row's region is one run of its source (or target) shard (geometry only:
        every process can tell for every row)."""
        op = self.op(row)
        sharding, rank, index = (self.S, op.src_rank, op.src_piece) if src else \
            (self.D, op.dst_rank, op.dst_piece)
        piece = self._piece(sharding, rank, op.path, index)
        rel = relative(op.region, piece.box)
        local = Box(tuple(l + r for l, r in zip(piece.local.offsets, rel.offsets)), rel.sizes)
        return is_contiguous(local, piece.view)

    def _view(self, shards, sharding, rank, path, index, region) -> torch.Tensor:
        key = (id(shards), path, index)
        seen = self._views.get(key)
        if seen is None:
            piece = self._piece(sharding, rank, path, index)
            tensor = shards[path]
            if (piece.offset == 0 and piece.view == tuple(tensor.shape) and piece.local.sizes == piece.view
                    and not any(piece.local.offsets)):
                whole = tensor  # the piece is the whole local tensor (most are)
            else:
                whole = piece_view(tensor, piece)
            seen = self._views[key] = (whole, piece.box)
        whole, box = seen
        if region == box:
            return whole
        return whole[to_slices(relative(region, box))]

    def src_view(self, row: int) -> torch.Tensor:
        op = self.op(row)
        return self._view(self.local, self.S, op.src_rank, op.path, op.src_piece, op.region)

    def dst_view(self, row: int) -> torch.Tensor:
        op = self.op(row)
        return self._view(self.out, self.D, op.dst_rank, op.path, op.dst_piece, op.region)

    def local_op(self, row: int, stats: DistStats) -> None:
        op = self.op(row)
        target = self.dst_view(row)
        if op.kind is OpKind.FILL:
            target.zero_()
            stats.filled += op.nbytes
        else:
            target.copy_(self.src_view(row))
            stats.local += op.nbytes


class _StoreReads:
    """STORE ops read in a thread pool, overlapped with the rounds, in pieces of bounded size.

    Each op's region is cut into boxes of at most ``budget / threads`` bytes
    (flat ranges of the region, at most ``2 * ndim - 1`` boxes each), so the
    reads in flight hold at most ``budget`` bytes of this executor's buffers.
    """

    def __init__(self, ctx: _Context, rows: np.ndarray, read, budget: int, buffers: Buffers):
        self.ctx, self.rows, self.read, self.buffers = ctx, rows.tolist(), read, buffers
        self.threads = STORE_THREADS
        self.piece_bytes = max(MIN_CHUNK, budget // self.threads)
        self.pool: ThreadPoolExecutor | None = None
        self.futures: list = []

    def start(self) -> None:
        if not self.rows:
            return
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tenplex-store")
        for row in self.rows:
            op = self.ctx.op(row)
            itemsize = max(1, op.nbytes // max(1, volume(op.region)))
            step = max(1, self.piece_bytes // itemsize)
            total = volume(op.region)
            for lo in range(0, total, step):
                for box in decompose_flat(lo, min(total, lo + step), op.region.sizes):
                    self.futures.append(self.pool.submit(self._read, row, box, itemsize))

    def _read(self, row: int, rel: Box, itemsize: int) -> int:
        op = self.ctx.op(row)
        n = volume(rel) * itemsize
        self.buffers.take(n)
        try:
            data = self.read(op.path, shift(rel, op.region.offsets))
            self.ctx.dst_view(row)[to_slices(rel)].copy_(data)
        finally:
            self.buffers.give(n)
        return n

    def finish(self) -> int:
        """Wait for every read; the bytes read. Raises the first read's error."""
        return sum(f.result() for f in self.futures)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
