"""Stream a plan's target shard files from a store executor into a writer.

Target files are written in groups of at most ``max_open_files``: for each
group, leaf by leaf, the store executor builds the group's target tensors
(the next two leaves are built while one is written) and the writer appends
them to their files, each of which is closed after its last tensor. So at
most ``max_open_files`` files are open at once, whatever the target's
world size (one open file per target rank hit ``EMFILE`` at 1024 ranks, and
each open object-store file buffers a part in memory). Each group reads only
the byte ranges its ranks need.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tenplex.store.execute import StorePlanRunner
from tenplex.store.writer import StoreWriter

__all__ = ["MAX_OPEN_FILES", "stream_targets"]

MAX_OPEN_FILES = 64
"""Default bound on target files open at once."""


def stream_targets(runner: StorePlanRunner, writer: StoreWriter, *, threads: int = 8,
                   max_open_files: int = MAX_OPEN_FILES, ranks=None) -> None:
    """Write every target file of ``writer`` (or those of ``ranks``) with tensors built by ``runner``.

    Args:
        runner: the store executor of a plan to ``writer.config``.
        writer: the target's writer (files are written, not committed).
        threads: tensors written at once.
        max_open_files: target files open at once (at least 1).
        ranks: the target ranks whose files to write (default: every rank that stores data);
            a reshard under torchrun gives each process its share.
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
    with ThreadPoolExecutor(max_workers=2) as builder, \
            ThreadPoolExecutor(max_workers=max(1, threads)) as io:
        futures = {i: builder.submit(runner.leaf, p, storing[p]) for i, p in enumerate(paths[:2])}
        for i, path in enumerate(paths):
            tensors = futures.pop(i).result()
            if i + 2 < len(paths):
                nxt = paths[i + 2]
                futures[i + 2] = builder.submit(runner.leaf, nxt, storing[nxt])
            items = sorted(tensors.items())
            if len(items) == 1:  # one file to write: here, not on the pool (a thread hand-off less)
                writer.write(items[0][0], path, items[0][1])
            else:
                list(io.map(lambda item: writer.write(item[0], path, item[1]), items))
