"""One process's part of a distributed transfer: direct regions at once, the rest as streams
cut into chunks, two rounds in flight.

Used by :func:`~tenplex.transform.distributed.execute_distributed`, which decides which rows
this process sends to and receives from each peer. Here:

- **Direct** regions (at least :data:`DIRECT_MIN` bytes, one contiguous run of both the
  source and the target shard) are posted first, in one batch, from the source shard into
  the target tensor: no buffer, no copy.
- The other rows of each ordered pair form a :class:`~tenplex.transform.streams.Stream`,
  cut into chunks of at most :data:`MAX_CHUNK` bytes (less when the memory budget's share
  is smaller). Rounds ``r`` and ``r + 1`` are in flight together: round ``r + 1`` is packed
  while round ``r`` is on the wire, and round ``r + 2`` is posted once round ``r`` is
  waited for and unpacked (it reuses round ``r``'s buffers). Local copies run while the
  first two rounds are in flight.
- Every batch holds the sends and the receives of the same round, posted in the same order
  on every process (NCCL requires matched groups; gloo matches a pair's messages in order).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from tenplex.errors import PlanError
from tenplex.transform.comm import Comm
from tenplex.transform.guard import TransferGuard
from tenplex.transform.streams import Buffers, Stream

__all__ = ["Clock", "DIRECT_MIN", "MAX_CHUNK", "exchange"]

DIRECT_MIN = 256 << 10
"""Regions of at least this many bytes, contiguous in both the source and the target shard,
are sent from the source shard and received into the target shard, without buffers."""

MAX_CHUNK = 8 << 20
"""The largest chunk, in bytes. Smaller chunks let packing overlap the transfer sooner and keep
the chunk buffers small enough to be reused warm (a buffer is touched once per transfer,
whatever the number of rounds); each round costs one batch of messages."""

IN_FLIGHT = 2
"""Rounds posted and not yet waited for (each stream has this many chunk buffers)."""


class Clock:
    """Wall and thread CPU seconds spent per phase of this process, added to ``times`` and ``cpu``."""

    def __init__(self, times: dict, cpu: dict):
        self.times, self.cpu = times, cpu

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0


def classify(ctx, rows: list[int], nbytes: np.ndarray, at_src: bool):
    """Split one pair's rows: direct ones (large, contiguous at both ends) and the stream's rows,
    in plan order, with the stream rows' in-place flags at this end and at the other end.

    ``ctx`` gives ``contiguous(row, src=...)`` (geometry only: both ends compute the same).
    ``at_src``: this end is the sender. Only rows of at least :data:`DIRECT_MIN` bytes are
    ever in place (smaller ones are cheaper packed together).
    """
    direct, packed, here, there = [], [], [], []
    for row in rows:
        if nbytes[row] >= DIRECT_MIN:
            s, d = ctx.contiguous(row, src=True), ctx.contiguous(row, src=False)
        else:
            s = d = False
        if s and d:
            direct.append(row)
            continue
        packed.append(row)
        here.append(s if at_src else d)
        there.append(d if at_src else s)
    return direct, packed, here, there


def flat(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous ``t`` as a 1-D uint8 view (never a copy).

    Raises:
        PlanError: ``t`` is strided.
    """
    if not t.is_contiguous():
        raise PlanError(f"a region of shape {list(t.shape)} was expected to be contiguous, found strided")
    t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def exchange(ctx, comm: Comm, guard: TransferGuard, sends: dict, recvs: dict, shares: np.ndarray,
             buffers: Buffers, stats, device, meanwhile: Callable[[], None], pending: list) -> None:
    """Move every pair's bytes (see the module docstring).

    Args:
        ctx: the executor's views (``src_view(row)``, ``dst_view(row)``, ``contiguous``).
        comm, guard: the communicator and the transfer's guard.
        sends, recvs: ``{peer: [plan rows]}`` this process sends to / receives from.
        shares: ``[processes]`` chunk bytes per stream (:func:`~tenplex.transform.streams.chunk_shares`).
        buffers: counts the chunk buffers held.
        stats: the executor's ``DistStats`` (bytes, rounds, chunk, times).
        meanwhile: local work run while the first rounds are in flight.
        pending: posted exchanges not yet waited for (the guard aborts them on failure).
    """
    me, nbytes, clock = comm.rank, ctx.table.cols["nbytes"], Clock(stats.times, stats.cpu)
    direct_out, direct_in, out_streams, in_streams = [], [], {}, {}
    with clock("setup"):
        for p, rows in sends.items():
            direct, packed, here, there = classify(ctx, rows, nbytes, at_src=True)
            direct_out += [(p, ctx.src_view(r)) for r in direct]
            out_streams[p] = Stream(packed, nbytes, _chunk(shares, me, p), ctx.src_view, here, there)
        for p, rows in recvs.items():
            direct, packed, here, there = classify(ctx, rows, nbytes, at_src=False)
            direct_in += [(p, ctx.dst_view(r)) for r in direct]
            in_streams[p] = Stream(packed, nbytes, _chunk(shares, me, p), ctx.dst_view, here, there)
    streams = list(out_streams.values()) + list(in_streams.values())
    rounds = max([s.chunks for s in streams] + [0])
    stats.chunk = max([s.chunk for s in streams if s.chunks] + [0])
    slots: dict = {}  # IN_FLIGHT buffers per stream, used by rounds in turn

    def buffer(key, s: Stream, r: int) -> torch.Tensor:
        buf = slots.get((key, r % IN_FLIGHT))
        if buf is None:
            buf = slots[(key, r % IN_FLIGHT)] = torch.empty(s.chunk, dtype=torch.uint8, device=device)
            buffers.take(s.chunk)
        return buf

    def post(r):
        send_bufs, recv_bufs, unpacks = [], [], []
        for p, s in in_streams.items():
            for at, n, spans, in_place in s.messages(r) if r < s.chunks else ():
                if in_place:
                    recv_bufs.append((p, s.in_place(spans[0])))
                else:
                    buf = buffer(("in", p), s, r)[at: at + n]
                    recv_bufs.append((p, buf))
                    unpacks.append((s, buf, [(i, x, y, a - at) for i, x, y, a in spans]))
        with clock("pack"):
            for p, s in out_streams.items():
                for at, n, spans, in_place in s.messages(r) if r < s.chunks else ():
                    if in_place:
                        send_bufs.append((p, s.in_place(spans[0])))
                    else:
                        buf = buffer(("out", p), s, r)[at: at + n]
                        s.pack(r, buf, [(i, x, y, a - at) for i, x, y, a in spans])
                        send_bufs.append((p, buf))
        stats.sent += sum(b.numel() for _, b in send_bufs)
        stats.received += sum(b.numel() for _, b in recv_bufs)
        with clock("post"):
            pending.append(comm.start(send_bufs, recv_bufs))
        return unpacks, pending[-1]

    def wait(w) -> None:
        with clock("wait"):
            guard.wait(w)
        pending.remove(w)

    direct_wait = None
    if direct_out or direct_in:  # zero-copy: views of the source shards and the target tensors
        with clock("post"):
            direct_wait = comm.start([(p, flat(t)) for p, t in direct_out],
                                     [(p, flat(t)) for p, t in direct_in])
        pending.append(direct_wait)
        stats.sent += sum(t.numel() * t.element_size() for _, t in direct_out)
        stats.received += sum(t.numel() * t.element_size() for _, t in direct_in)
    inflight = deque()
    if rounds:
        inflight.append(post(0))
    guard.phase("first round")
    if rounds > 1:
        inflight.append(post(1))
    with clock("local"):
        meanwhile()
    for r in range(rounds):
        if r == rounds // 2 and rounds >= 2:
            guard.phase("middle round")
        guard.phase_name = f"round {r + 1} of {rounds}"
        unpacks, w = inflight.popleft()
        wait(w)
        with clock("unpack"):
            for s, buf, spans in unpacks:
                s.unpack(r, buf, spans)
        if r + IN_FLIGHT < rounds:  # reuses round r's buffers, now free
            inflight.append(post(r + IN_FLIGHT))
        stats.rounds += 1
    if direct_wait is not None:
        guard.phase_name = "direct transfers"
        wait(direct_wait)
    buffers.give(sum(b.numel() for b in slots.values()))


def _chunk(shares: np.ndarray, me: int, peer: int) -> int:
    """A stream's chunk bytes: the smaller of its two ends' shares, at most :data:`MAX_CHUNK`
    (the same at both ends)."""
    return int(min(shares[me], shares[peer], MAX_CHUNK))
