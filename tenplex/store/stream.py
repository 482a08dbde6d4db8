"""Stream a plan's target shard files from a store executor into a writer.

Target files are written in groups of at most ``max_open_files``: for each
group, leaf by leaf, the calling thread builds the group's target tensors
(:meth:`StorePlanRunner.leaves`, which reads a local store ahead in windows)
and hands them to one write thread, which appends them to their files, each
closed after its last tensor. So at most
``max_open_files`` files are open at once, whatever the target's world size
(one open file per target rank hit ``EMFILE`` at 1024 ranks, and each open
object-store file buffers a part in memory). Each group reads only the byte
ranges its ranks need.

Why one building thread and one write thread: building a leaf is mostly
Python (the ops' views and byte runs), which holds the interpreter lock,
while a write and its block digests release it. Two threads that each do one
kind of work overlap well; several builders mostly wait for the lock and for
each other (on the 0.5 GB store of ``bench/reshard_scale.py``, 2 cores:
0.56-0.64 s against 0.79-0.95 s for two builder threads and a writing
caller; docs/benchmarks.md, "One building thread, one write thread"). Tensors
waiting to be written are bounded by :data:`QUEUE_BYTES` (and one leaf, however
large), the reads the builder has made ahead by
:data:`~tenplex.store.execute.READ_AHEAD`. An object-store target
writes a leaf's files on a pool of ``threads`` (each write may upload a part).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from tenplex.store.execute import StorePlanRunner
from tenplex.store.writer import StoreWriter

__all__ = ["MAX_OPEN_FILES", "QUEUE_BYTES", "stream_targets"]

MAX_OPEN_FILES = 64
"""Default bound on target files open at once."""

QUEUE_BYTES = 64 << 20
"""Bytes of built tensors that may wait for the write thread (64 MiB; at least one leaf waits)."""


def stream_targets(runner: StorePlanRunner, writer: StoreWriter, *, threads: int = 8,
                   max_open_files: int = MAX_OPEN_FILES, ranks=None) -> None:
    """Write every target file of ``writer`` (or those of ``ranks``) with tensors built by ``runner``.

    Args:
        runner: the store executor of a plan to ``writer.config``.
        writer: the target's writer (files are written, not committed).
        threads: a leaf's files written at once on an object-store target (a local one is
            written by one thread).
        max_open_files: target files open at once (at least 1).
        ranks: the target ranks whose files to write (default: every rank that stores data);
            a reshard under torchrun gives each process its share.

    Raises:
        Whatever building or writing raised first (the other thread stops first; the files
        stay for the caller's ``writer.abort``).
    """
    entries = writer.entries()
    ranks = sorted(entries) if ranks is None else sorted(r for r in ranks if r in entries)
    size = max(1, max_open_files)
    for i in range(0, len(ranks), size):
        group = ranks[i:i + size]
        storing: dict[str, list[int]] = {}
        for rank in group:
            for path, _, _ in entries[rank]:
                storing.setdefault(path, []).append(rank)
        paths = [p for p, _ in runner.tree.tensors() if p in storing]
        _write_group(runner, writer, paths, storing, threads)


def _write_group(runner, writer, paths: list[str], storing: dict, threads: int) -> None:
    queue = _Handoff(QUEUE_BYTES)
    pool = None if writer.root.local else ThreadPoolExecutor(max_workers=max(1, threads))
    thread = threading.Thread(target=_drain, args=(queue, writer, pool), name="tenplex-write", daemon=True)
    thread.start()
    try:
        for path, tensors in runner.leaves(paths, storing):
            queue.put(path, tensors)
        queue.close()
    except BaseException:
        queue.stop()
        raise
    finally:
        thread.join()
        if pool is not None:
            pool.shutdown()
    queue.raise_error()


def _drain(queue: "_Handoff", writer: StoreWriter, pool) -> None:
    """The write thread: write each leaf's tensors to their files, in order, until the queue ends."""
    try:
        while (item := queue.get()) is not None:
            path, tensors, nbytes = item
            items = sorted(tensors.items())
            if pool is None or len(items) == 1:
                for rank, tensor in items:
                    writer.write(rank, path, tensor)
            else:
                list(pool.map(lambda it: writer.write(it[0], path, it[1]), items))
            del item, tensors, items  # the buffers go back to the runner's pool
            queue.done(nbytes)
    except BaseException as exc:
        queue.stop(exc)


class _Handoff:
    """Built leaves on their way to the write thread, at most ``limit`` bytes of them (and one leaf).

    Either side may end it: the builder by :meth:`close` (all put) or :meth:`stop` (it failed),
    the write thread by ``stop(error)``; a builder waiting for room raises the write thread's error.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._items: deque = deque()
        self._bytes = 0
        self._closed = self._stopped = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def put(self, path: str, tensors: dict) -> None:
        nbytes = sum(_nbytes(t) for t in tensors.values())
        with self._cond:
            while self._items and self._bytes + nbytes > self.limit and self._error is None:
                self._cond.wait()
            self.raise_error()
            self._items.append((path, tensors, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()

    def get(self):
        """The next ``(path, tensors, nbytes)``, or None once closed and empty, or stopped."""
        with self._cond:
            while not self._items and not (self._closed or self._stopped):
                self._cond.wait()
            if self._stopped or not self._items:
                return None
            return self._items.popleft()

    def done(self, nbytes: int) -> None:
        """The write thread wrote an item of ``nbytes``: they leave the bound."""
        with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stop(self, error: BaseException | None = None) -> None:
        """End it now, dropping what waits: the builder failed, or the write thread (``error``)."""
        with self._cond:
            self._error = self._error or error
            self._stopped = True
            self._items.clear()
            self._cond.notify_all()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _nbytes(tensor) -> int:
    parts = tensor if isinstance(tensor, (list, tuple)) else [tensor]
    return sum(p.numel() * p.element_size() for p in parts if isinstance(p, torch.Tensor))
