"""The torch.distributed executor: every process sends what others need and receives what it lacks.

All processes of the transition group hold the same plan (planning is
deterministic, so each computes it alone). Process ``p`` may hold a source
rank (``src_of[p]``), a target rank (``dst_of[p]``), both or neither.

- Ops whose source and target live in the same process are local copies.
- For every ordered pair of processes, the ops from one to the other form a
  byte stream: the regions' bytes, in plan order. Both sides derive the same
  stream from the plan, so no metadata travels.
- Regions of at least :data:`DIRECT_MIN` bytes that are one contiguous run in
  both the source and the target shard are sent from the source shard and
  received into the target tensor directly: no staging buffer, no copy.
- Streams are cut into chunks and moved in rounds of batched point-to-point
  operations (``batch_isend_irecv``). The first round is in flight while a
  process copies what it already holds, and round r + 1 is in flight while
  round r is unpacked. A process has at most ``memory_budget`` bytes of
  chunks in flight (sends plus receives, two rounds).
- STORE ops (recovery of regions no survivor holds) are range reads from a
  committed store; FILL ops zero new padding.

Source shards are never written, so the state held before a transfer stays
usable if the transfer fails. A target tensor that one local op fills whole
from a contiguous source region is a view of the old shard (no copy). A failure surfaces as
:class:`~tenplex.errors.TransferError` within the process group's timeout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tenplex.errors import PlanError
from tenplex.ptree.region import Box, is_contiguous, relative, to_slices
from tenplex.ptree.shards import piece_view
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.comm import Comm
from tenplex.transform.local import allocate
from tenplex.transform.plan import KIND_CODE, LINK_CODE, Link, OpKind, Plan

__all__ = ["DistStats", "execute_distributed", "DEFAULT_BUDGET"]

DEFAULT_BUDGET = 256 << 20
"""Bytes of transfer buffers a process may have in flight (256 MiB)."""

DIRECT_MIN = 256 << 10
"""Regions of at least this many bytes, contiguous in both the source and the target shard,
are sent from the source shard and received into the target shard, without staging buffers."""

_FILL = KIND_CODE[OpKind.FILL]
_STORE = LINK_CODE[Link.STORE]


@dataclass
class DistStats:
    """What one process moved, in bytes: ``sent``, ``received``, ``local`` copies,
    ``store`` reads, ``filled`` padding; ``rounds`` of exchange; ``peak_buffer``
    bytes of transfer buffers held at once."""

    sent: int = 0
    received: int = 0
    local: int = 0
    store: int = 0
    filled: int = 0
    rounds: int = 0
    peak_buffer: int = 0
    peers: list[int] = field(default_factory=list)


def execute_distributed(plan: Plan, tree: PTree, local: dict[str, Any] | None, comm: Comm,
                        src_of: Sequence[int | None], dst_of: Sequence[int | None], *,
                        memory_budget: int = DEFAULT_BUDGET,
                        store_read: Callable | None = None,
                        device: str | torch.device = "cpu") -> tuple[dict | None, DistStats]:
    """Run ``plan`` across the processes of ``comm``.

    Args:
        plan: the plan (the same on every process).
        tree: the tree spec.
        local: this process's source shards (``{path: local tensor}``), or
            ``None`` if it holds no source rank.
        comm: the communicator; ``comm.rank`` is this process.
        src_of: per process, the source rank it holds (or ``None``).
        dst_of: per process, the target rank it will hold (or ``None``).
        memory_budget: bytes of transfer buffers in flight per process.
        store_read: ``store_read(path, box) -> tensor`` for STORE ops.
        device: where target tensors and buffers are allocated.

    Returns:
        ``(target shards or None, stats)``; tensor leaves only (values are
        handled by :func:`tenplex.elastic.reconfigure`).

    Raises:
        PlanError: the process mapping does not fit the plan, or STORE ops
            without ``store_read``.
        TransferError: a peer failed or timed out.
    """
    me = comm.rank
    proc_src, proc_dst = _owners(src_of, plan.src.world_size, "source"), \
        _owners(dst_of, plan.dst.world_size, "target")
    my_dst = dst_of[me]
    S, D = Sharding(tree, plan.src), Sharding(tree, plan.dst)
    out = allocate(tree, D, my_dst) if my_dst is not None else None
    if out is not None and torch.device(device).type != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    stats = DistStats()
    c = plan.table.cols
    n = len(c["dst"])
    src_proc = np.where(c["src"] >= 0, proc_src[np.maximum(c["src"], 0)], -1)
    dst_proc = proc_dst[c["dst"]] if n else np.zeros(0, dtype=np.int64)
    fill = c["kind"] == _FILL
    store = c["link"] == _STORE
    mine_in = (dst_proc == me)
    ctx = _Context(plan, S, D, local, out)
    local_rows = np.nonzero(mine_in & ((src_proc == me) | fill | store))[0]
    if out is not None and local is not None:
        local_rows = _share_unchanged(ctx, local_rows, mine_in, stats)
    sends = defaultdict(list)
    recvs = defaultdict(list)
    for row in np.nonzero((src_proc == me) & (dst_proc != me) & ~fill & ~store)[0].tolist():
        sends[int(dst_proc[row])].append(row)
    for row in np.nonzero(mine_in & (src_proc != me) & (src_proc >= 0) & ~fill & ~store)[0].tolist():
        recvs[int(src_proc[row])].append(row)
    if sends and local is None:
        raise PlanError(f"process {me} must send but holds no source shards")
    stats.peers = sorted(set(sends) | set(recvs))
    # the first round is in flight while this process copies what it already holds
    _exchange(ctx, comm, sends, recvs, memory_budget, stats, device,
              meanwhile=lambda: [ctx.local_op(row, stats, store_read) for row in local_rows.tolist()])
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
    keep = []
    for row in local_rows.tolist():
        op = ctx.op(row)
        path_index = int(c["path"][row])
        target = ctx.out.get(op.path)
        if counts[path_index] == 1 and op.kind is not OpKind.FILL and op.link is Link.LOCAL:
            view = ctx.src_view(row)
            if view.is_contiguous() and view.numel() == target.numel() and view.dtype == target.dtype:
                ctx.out[op.path] = view.view(target.shape)
                stats.local += op.nbytes
                continue
        keep.append(row)
    return np.asarray(keep, dtype=np.int64)


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

    def __init__(self, plan: Plan, S: Sharding, D: Sharding, local, out):
        self.plan, self.S, self.D, self.local, self.out = plan, S, D, local, out
        self.table = plan.table
        self._held: dict = {}
        self._ops: dict = {}

    def op(self, row: int):
        op = self._ops.get(row)
        if op is None:
            op = self._ops[row] = self.table[row]
        return op

    def _piece(self, sharding, rank, path, index):
        key = (id(sharding), rank, path)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = sharding.holding(path, sharding.config.coord(rank))
        return held.pieces[index]

    def contiguous(self, row: int) -> bool:
        """Whether the row's region is one run in both its source and its target shard (geometry only)."""
        op = self.op(row)
        for sharding, rank, index in ((self.S, op.src_rank, op.src_piece), (self.D, op.dst_rank, op.dst_piece)):
            piece = self._piece(sharding, rank, op.path, index)
            rel = relative(op.region, piece.box)
            local = Box(tuple(l + r for l, r in zip(piece.local.offsets, rel.offsets)), rel.sizes)
            if not is_contiguous(local, piece.view):
                return False
        return True

    def src_view(self, row: int) -> torch.Tensor:
        op = self.op(row)
        piece = self._piece(self.S, op.src_rank, op.path, op.src_piece)
        return piece_view(self.local[op.path], piece)[to_slices(relative(op.region, piece.box))]

    def dst_view(self, row: int) -> torch.Tensor:
        op = self.op(row)
        piece = self._piece(self.D, op.dst_rank, op.path, op.dst_piece)
        return piece_view(self.out[op.path], piece)[to_slices(relative(op.region, piece.box))]

    def local_op(self, row: int, stats: DistStats, store_read) -> None:
        op = self.op(row)
        target = self.dst_view(row)
        if op.kind is OpKind.FILL:
            target.zero_()
            stats.filled += op.nbytes
        elif op.link is Link.STORE:
            if store_read is None:
                raise PlanError(f"plan reads {op.path} {op.region} from a store, but no store was given")
            target.copy_(store_read(op.path, op.region))
            stats.store += op.nbytes
        else:
            target.copy_(self.src_view(row))
            stats.local += op.nbytes


def _direct(ctx: _Context, rows: list[int], nbytes: np.ndarray) -> tuple[list[int], list[int]]:
    """Split rows into direct ones (large, contiguous at both ends) and packed ones, in plan order."""
    direct, packed = [], []
    for row in rows:
        (direct if nbytes[row] >= DIRECT_MIN and ctx.contiguous(row) else packed).append(row)
    return direct, packed


def _exchange(ctx: _Context, comm: Comm, sends, recvs, budget: int, stats: DistStats, device,
              meanwhile=None) -> None:
    """Move every pair's bytes: direct regions at once, the rest as chunked streams in rounds.

    Round r + 1 is in flight while round r unpacks. Both ends split rows and
    cut streams alike, from the plan alone.
    """
    nbytes = ctx.table.cols["nbytes"]
    # both ends of a stream must cut it alike, so the chunk size depends only on shared values;
    # two rounds in flight to at most (size - 1) peers each way keep the bytes within the budget
    chunk = max(1 << 16, budget // (4 * max(1, comm.size - 1)))
    direct_out, direct_in, out_streams, in_streams = [], [], {}, {}
    for p, rows in sends.items():
        direct, packed = _direct(ctx, rows, nbytes)
        direct_out += [(p, ctx.src_view(r)) for r in direct]
        out_streams[p] = _Stream(packed, nbytes, chunk)
    for p, rows in recvs.items():
        direct, packed = _direct(ctx, rows, nbytes)
        direct_in += [(p, ctx.dst_view(r)) for r in direct]
        in_streams[p] = _Stream(packed, nbytes, chunk)
    rounds = max([s.chunks for s in out_streams.values()] + [s.chunks for s in in_streams.values()] + [0])

    def post(r):
        send_bufs = [(p, s.pack(ctx, r, device)) for p, s in out_streams.items() if r < s.chunks]
        recv_bufs = [(p, torch.empty(s.chunk_size(r), dtype=torch.uint8, device=device))
                     for p, s in in_streams.items() if r < s.chunks]
        stats.sent += sum(b.numel() for _, b in send_bufs)
        stats.received += sum(b.numel() for _, b in recv_bufs)
        return send_bufs, recv_bufs, comm.start(send_bufs, recv_bufs)

    direct_wait = None
    if direct_out or direct_in:  # zero-copy: views of the source shards and the target tensors
        flat = lambda t: t.view(torch.uint8).reshape(-1) if t.element_size() > 1 or t.dtype != torch.uint8 else t
        direct_wait = comm.start([(p, flat(t)) for p, t in direct_out], [(p, flat(t)) for p, t in direct_in])
        stats.sent += sum(t.numel() * t.element_size() for _, t in direct_out)
        stats.received += sum(t.numel() * t.element_size() for _, t in direct_in)
    current = post(0) if rounds else None
    if meanwhile is not None:
        meanwhile()
    for r in range(rounds):
        send_bufs, recv_bufs, wait = current
        wait()
        current = post(r + 1) if r + 1 < rounds else None
        held = sum(b.numel() for _, b in send_bufs + recv_bufs)
        if current is not None:
            held += sum(b.numel() for _, b in current[0] + current[1])
        stats.peak_buffer = max(stats.peak_buffer, held)
        for p, buf in recv_bufs:
            in_streams[p].unpack(ctx, r, buf)
        stats.rounds += 1
    if direct_wait is not None:
        direct_wait()


class _Stream:
    """One ordered pair's byte stream: the rows' region bytes, in plan order, cut into chunks."""

    def __init__(self, rows: list[int], nbytes: np.ndarray, chunk: int):
        self.rows = rows
        sizes = nbytes[rows]
        self.starts = np.concatenate(([0], np.cumsum(sizes)))
        self.total = int(self.starts[-1])
        self.chunk = chunk
        self.chunks = -(-self.total // chunk) if self.total else 0
        self._cache: tuple[int, torch.Tensor] | None = None
        self._partial: dict[int, torch.Tensor] = {}

    def chunk_size(self, r: int) -> int:
        return min(self.chunk, self.total - r * self.chunk)

    def _span(self, r: int):
        a, b = r * self.chunk, min((r + 1) * self.chunk, self.total)
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        while i < len(self.rows) and self.starts[i] < b:
            lo, hi = int(self.starts[i]), int(self.starts[i + 1])
            yield i, max(a, lo) - lo, min(b, hi) - lo, max(a, lo) - a
            i += 1

    def _bytes(self, ctx: _Context, i: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != i:
            self._cache = (i, ctx.src_view(self.rows[i]).contiguous().view(torch.uint8).reshape(-1))
        return self._cache[1]

    def pack(self, ctx: _Context, r: int, device) -> torch.Tensor:
        buf = torch.empty(self.chunk_size(r), dtype=torch.uint8, device=device)
        for i, x, y, at in self._span(r):
            size = int(self.starts[i + 1] - self.starts[i])
            if x == 0 and y == size:  # the whole region: copy the strided view straight in
                view = ctx.src_view(self.rows[i])
                if at % view.element_size() == 0:
                    buf[at: at + size].view(view.dtype).view(view.shape).copy_(view)
                    continue
            buf[at: at + (y - x)] = self._bytes(ctx, i)[x:y]
        return buf

    def unpack(self, ctx: _Context, r: int, buf: torch.Tensor) -> None:
        for i, x, y, at in self._span(r):
            size = int(self.starts[i + 1] - self.starts[i])
            target = ctx.dst_view(self.rows[i])
            if x == 0 and y == size:
                target.copy_(_typed(buf[at: at + size], target))
                continue
            part = self._partial.setdefault(i, torch.empty(size, dtype=torch.uint8, device=buf.device))
            part[x:y] = buf[at: at + (y - x)]
            if y == size:
                target.copy_(_typed(part, target))
                del self._partial[i]


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw`` bytes as a tensor shaped like ``like`` (copied first if misaligned for its dtype)."""
    if raw.storage_offset() % like.element_size():
        raw = raw.clone()
    return raw.view(like.dtype).view(like.shape)
