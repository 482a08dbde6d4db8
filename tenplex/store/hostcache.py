"""Blocks several processes on one host need, read from storage once and shared through a host folder.

When a reshard's processes split a source file (:mod:`tenplex.distributed_reshard`),
the checksum blocks at the edges of each process's ranges hold bytes of two
processes' tensors; each process would fetch them whole (a block is verified
whole). A :class:`HostBlockCache` names those edge blocks in advance (blocks
that overlap a stored tensor this process reads and one it does not) and keeps
them in a folder every process of the host can reach (``/dev/shm``): the first
process to fetch an edge block leaves it there, the next one takes it from
there. Nothing from the folder is trusted: a block taken from it is checked
against the manifest's digest like one read from storage, and a block that is
missing (the other process has not read it yet) or fails its digest is
fetched as usual. Only edge blocks are kept: a few per source tensor run a
process reads, a few MiB in all.
"""

from __future__ import annotations

import os
import re
import uuid

from tenplex.store.manifest import Manifest, TensorRecord

__all__ = ["HostBlockCache", "edge_blocks"]


def edge_blocks(manifest: Manifest, needed: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """``(file, block)`` pairs that overlap a tensor of ``needed`` and a stored tensor not in it.

    Args:
        manifest: the source store's manifest.
        needed: the stored tensors this process reads (whole or in part), as ``(path, rank)``.
    """
    by_file: dict[str, list[TensorRecord]] = {}
    for rec in manifest.tensors.values():
        by_file.setdefault(rec.file, []).append(rec)
    out = set()
    for key, recs in by_file.items():
        block = manifest.files[key].block
        mine: dict[int, bool] = {}
        others: set[int] = set()
        for rec in recs:
            if not rec.nbytes:
                continue
            first, last = rec.offset // block, (rec.offset + rec.nbytes - 1) // block
            if (rec.path, rec.rank) in needed:
                mine[first] = mine[last] = True
            else:
                others.update((first, last))
        out.update((key, b) for b in mine if b in others)
    return out


class HostBlockCache:
    """Edge blocks of one source shared by the processes of one host (see the module docstring).

    Args:
        folder: a folder every process of the host can write (created if missing).
        edges: the ``(file, block)`` pairs to share (:func:`edge_blocks`).

    Attributes:
        bytes_shared: bytes this process took from the folder instead of storage.
    """

    def __init__(self, folder: str, edges: set[tuple[str, int]]):
        self.folder, self.edges = folder, edges
        self.bytes_shared = 0
        os.makedirs(folder, exist_ok=True)

    def _name(self, key: str, index: int) -> str:
        return os.path.join(self.folder, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.{index}")

    def wanted(self, key: str, index: int) -> bool:
        """Whether block ``index`` of file ``key`` is an edge block."""
        return (key, index) in self.edges

    def get(self, key: str, index: int) -> bytes | None:
        """The block's bytes if another process left them (unverified: the caller checks the digest)."""
        try:
            with open(self._name(key, index), "rb") as f:
                return f.read()
        except OSError:
            return None

    def put(self, key: str, index: int, data) -> None:
        """Leave a verified block for the other processes (atomically: a temporary file, then a
        rename, which also replaces a bad block left there)."""
        name = self._name(key, index)
        tmp = f"{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, name)
        except OSError:  # sharing is an optimization: a full /dev/shm only costs a second read
            try:
                os.remove(tmp)
            except OSError:
                pass
