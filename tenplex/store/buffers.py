"""Reused byte buffers for a streaming reshard: no page faults on every read.

A reshard streams the whole checkpoint through read buffers and target
tensors that live for one leaf each. Every byte read or assembled into a
fresh buffer first costs a page fault and a zeroed page: measured on the
0.5 GB bench store (``bench/reshard_scale.py``), 0.3 CPU s per 0.5 GB, as
much as reading it. A :class:`BufferPool` hands out buffers again once
nothing refers to them.

A buffer is free when no object but the pool refers to it (CPython's
reference count): every view of it (a numpy slice, ``torch.from_numpy``, a
``memoryview``) holds a reference to it, so a buffer with a live tensor,
or a boundary block a reader keeps as a view, is never handed out again.

The pool's buffers are anonymous private mappings of their own
(:func:`_fresh`), not ``np.empty``: numpy asks for transparent huge pages on
every large array (``madvise(MADV_HUGEPAGE)``), and where the kernel's THP
setting is ``madvise`` with ``defrag`` ``madvise`` (a common setting, and
the development machine's), a fault on such a page may first compact
memory, for as long as memory is fragmented. A fresh process resharding the
1 GB store of ``bench/reshard_vs_dcp.py`` (``dp=2,tp=2`` to ``dp=1,tp=4``)
through :func:`tenplex.reshard` took 0.82-1.06 s (median 0.93) with numpy's
buffers and 0.63-0.83 s (median 0.69) with these, 5 runs each, interleaved;
where huge pages come without compaction numpy's are 10-15% faster
(docs/benchmarks.md, "Buffers without huge pages").
"""

from __future__ import annotations

import errno
import mmap
import sys
import threading

import numpy as np

__all__ = ["BufferPool", "POOLED_MIN", "POOL_BYTES"]

POOLED_MIN = 256 << 10
"""Smaller requests (256 KiB) are served by ``np.empty`` (the heap, no ``mmap``)."""

POOL_BYTES = 1 << 30
"""Most bytes of buffers a pool keeps (1 GiB); past it, requests get fresh buffers."""


def _fresh(nbytes: int) -> np.ndarray:
    """A new, zeroed, page-aligned ``uint8`` array of ``nbytes`` (> 0) in an anonymous private
    mapping that asks for no huge pages (see the module's docstring); unmapped once no array
    or view refers to it.

    Raises:
        MemoryError: the mapping was refused (``ENOMEM``), as ``np.empty`` raises it, so that
            the API and the command report it as exhausted memory (``tenplex.errors.exhausted``),
            not as a failing store.
    """
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(f"buffer of {nbytes} bytes: the kernel refused the mapping "
                              f"({exc.strerror})") from None
        raise
    return np.frombuffer(region, dtype=np.uint8)


def _refs(buffer: np.ndarray) -> int:
    return sys.getrefcount(buffer)


class BufferPool:
    """Byte buffers by size class (powers of two from :data:`POOLED_MIN`), reused when unreferenced.

    Thread-safe. Args:
        limit: most bytes kept (:data:`POOL_BYTES`).
    """

    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self.kept = 0
        self.reused = 0
        self._classes: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        probe: list = [np.empty(1, np.uint8)]
        self._idle = self._count(probe)  # references to a buffer that only the pool holds

    @staticmethod
    def _count(buffers: list) -> int:
        for buffer in buffers:
            return _refs(buffer)
        return 0

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` array of ``nbytes`` (contents undefined), page-aligned if pooled.

        Raises:
            MemoryError: no memory for a new buffer (``np.empty``'s, or a refused mapping).
        """
        if nbytes < POOLED_MIN:
            return np.empty(nbytes, np.uint8)
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            buffers = self._classes.setdefault(size, [])
            for buffer in buffers:
                if _refs(buffer) == self._idle:
                    self.reused += nbytes
                    return buffer[:nbytes]
            buffer = _fresh(size)
            if self.kept + size <= self.limit:
                buffers.append(buffer)
                self.kept += size
        return buffer[:nbytes]
