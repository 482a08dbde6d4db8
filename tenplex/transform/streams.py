"""Byte streams between pairs of processes, cut into chunks and moved in rounds.

For every ordered pair of processes, the packed ops from one to the other
form a byte stream: the regions' bytes, in plan order. Both ends derive the
same stream, and the same chunk size, from the plan alone, so no metadata
travels.

- **Chunk size** follows each process's real peers: a process with ``d``
  streams (sends plus receives) gives each ``budget / (2 d)`` bytes per round,
  and a stream's chunk is the smaller of its two ends' shares
  (:func:`chunk_shares`). Two rounds in flight then hold at most ``budget``
  bytes at every process, whatever the world size.
- **Packing** copies each chunk's part of a region straight between the
  (strided) shard view and the chunk buffer, a few boxes at a time
  (:func:`copy_bytes`): no region is ever staged whole, however large.
- **In place**: a region that is one contiguous run of its shard at one end
  is sent from, or received into, that shard directly, as a message of its
  own (:meth:`Stream.messages`); only the other end copies.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from tenplex.errors import PlanError
from tenplex.ptree.region import decompose_flat, to_slices, volume

__all__ = ["ALIGN", "MIN_CHUNK", "Buffers", "Stream", "chunk_shares", "as_bytes", "copy_bytes"]

MIN_CHUNK = 4096
"""The smallest chunk, in bytes; a budget below ``2 * streams * MIN_CHUNK`` is exceeded by that much."""

ALIGN = 64
"""Chunk sizes are multiples of this many bytes."""


def chunk_shares(src_proc: np.ndarray, dst_proc: np.ndarray, nproc: int, budget) -> np.ndarray:
    """Per process, the chunk bytes each of its streams may use per round.

    Args:
        src_proc, dst_proc: ``[rows]`` sending and receiving process of every
            row that crosses processes.
        nproc: processes in the group.
        budget: bytes of chunk buffers a process may hold (two rounds in
            flight): one number, or ``[nproc]`` per process. Both ends of a
            stream must compute the same shares, so it may depend only on
            what every process knows (the plan).

    Returns:
        ``[nproc]`` int64: ``budget // (2 * streams)`` rounded down to
        :data:`ALIGN`, at least :data:`MIN_CHUNK`; a stream from ``p`` to
        ``q`` uses ``min(share[p], share[q])``.
    """
    pairs = np.unique(src_proc.astype(np.int64) * nproc + dst_proc.astype(np.int64))
    degree = (np.bincount(pairs // nproc, minlength=nproc)
              + np.bincount(pairs % nproc, minlength=nproc))
    share = np.asarray(budget, dtype=np.int64) // (2 * np.maximum(degree, 1))
    return np.maximum(share // ALIGN * ALIGN, MIN_CHUNK).astype(np.int64)


class Buffers:
    """Bytes of transfer buffers held now, and the most held at once (thread-safe)."""

    def __init__(self):
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            self.held += n
            self.peak = max(self.peak, self.held)

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    """``view``'s bytes as a uint8 view with the same row-major byte order (no copy).

    The last axis is widened by the item size; a view whose last axis is
    strided gets a trailing axis of one element first.
    """
    if view.dim() == 0 or view.stride(-1) != 1:
        view = view.unsqueeze(-1)
    return view if view.dtype == torch.uint8 else view.view(torch.uint8)


def copy_bytes(region: torch.Tensor, start: int, stop: int, flat: torch.Tensor, to_flat: bool) -> None:
    """Copy bytes ``[start, stop)`` (row-major) of the strided ``region`` to or from the 1-D uint8 ``flat``.

    At most ``2 * ndim + 1`` box copies; nothing is staged.
    """
    raw = as_bytes(region)
    at = 0
    for box in decompose_flat(start, stop, tuple(raw.shape)):
        n = volume(box)
        part = flat[at: at + n].view(box.sizes)
        if to_flat:
            part.copy_(raw[to_slices(box)])
        else:
            raw[to_slices(box)].copy_(part)
        at += n


class Stream:
    """One ordered pair's byte stream: its rows' region bytes, in plan order, cut into chunks.

    A row may be *in place* at either end: its region is one contiguous run
    of that end's shard, so that end sends from it, or receives into it,
    without a buffer. A chunk's part of such a row is a message of its own;
    the other parts of a chunk go, consecutive ones together, through the
    chunk buffers of both ends. Both ends derive the same messages from the
    plan alone (the flags of both ends are geometry), so no metadata travels.

    Args:
        rows: plan rows, in plan order.
        nbytes: ``[all rows]`` bytes per row.
        chunk: chunk size in bytes (the same at both ends); a stream shorter than that is
            one chunk of its own length.
        view: ``view(row) -> tensor``, the row's region at this end.
        here, there: ``[len(rows)]`` bool, whether a row is in place at this
            end, and at the other end (default: nowhere).
    """

    def __init__(self, rows: list[int], nbytes: np.ndarray, chunk: int,
                 view: Callable[[int], torch.Tensor], here=None, there=None):
        self.rows, self.view = rows, view
        self.starts = np.concatenate(([0], np.cumsum(nbytes[rows]))).astype(np.int64)
        self.total = int(self.starts[-1])
        self.chunk = int(min(chunk, self.total)) if self.total else int(chunk)  # no larger than the stream
        self.chunks = -(-self.total // self.chunk) if self.total else 0
        none = np.zeros(len(rows), dtype=bool)
        self.here = none if here is None else np.asarray(here, dtype=bool)
        self.there = none if there is None else np.asarray(there, dtype=bool)

    def chunk_size(self, r: int) -> int:
        return min(self.chunk, self.total - r * self.chunk)

    def _span(self, r: int):
        """``(row index, start, stop, buffer offset)`` of every region part in chunk ``r``."""
        a, b = r * self.chunk, min((r + 1) * self.chunk, self.total)
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        while i < len(self.rows) and self.starts[i] < b:
            lo, hi = int(self.starts[i]), int(self.starts[i + 1])
            if hi > lo:
                yield i, max(a, lo) - lo, min(b, hi) - lo, max(a, lo) - a
            i += 1

    def messages(self, r: int) -> list[tuple[int, int, list, bool]]:
        """Chunk ``r``'s messages, in order: ``(buffer offset, bytes, spans, in place here)``.

        A span of a row in place at either end is one message; consecutive
        other spans form one. ``spans`` are :meth:`_span`'s tuples.
        """
        out: list = []
        for span in self._span(r):
            i, x, y, at = span
            alone = bool(self.here[i] or self.there[i])
            if alone or not out or out[-1][3] is not None:
                out.append([at, y - x, [span], bool(self.here[i]) if alone else None])
            else:
                out[-1][1] += y - x
                out[-1][2].append(span)
        return [(at, n, spans, bool(flag)) for at, n, spans, flag in out]

    def in_place(self, span) -> torch.Tensor:
        """The 1-D uint8 view of a span of a row in place at this end (never a copy).

        Raises:
            PlanError: the row's region is not contiguous here after all.
        """
        i, x, y, _ = span
        region = self.view(self.rows[i])
        if not region.is_contiguous():
            raise PlanError(f"plan row {self.rows[i]}: region of shape {list(region.shape)} "
                            "was expected to be contiguous in its shard, found strided")
        flat = region.reshape(-1)
        return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8))[x:y]

    def pack(self, r: int, buf: torch.Tensor, spans=None) -> None:
        """Fill ``buf`` (``chunk_size(r)`` uint8) with chunk ``r``'s bytes (or only ``spans``' bytes)."""
        for i, x, y, at in self._span(r) if spans is None else spans:
            copy_bytes(self.view(self.rows[i]), x, y, buf[at: at + (y - x)], to_flat=True)

    def unpack(self, r: int, buf: torch.Tensor, spans=None) -> None:
        """Write chunk ``r``'s bytes (or only ``spans``' bytes) from ``buf`` into the target regions."""
        for i, x, y, at in self._span(r) if spans is None else spans:
            copy_bytes(self.view(self.rows[i]), x, y, buf[at: at + (y - x)], to_flat=False)
