"""Any shard source into a tenplex store: the store executor over a plan, written file by file.

This is :func:`tenplex.api.reshard`'s loop for a source that is not a
tenplex store (a format plugin's :meth:`open_source`): leaf by leaf, the
target ranks' local tensors are built from the source's byte ranges and
streamed into the new store's shard files; the manifest is written last.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tenplex.ptree.config import ParallelConfig
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.writer import StoreWriter
from tenplex.transform.planner import make_plan

__all__ = ["write_store"]


def _nbytes(t) -> int:
    parts = t if isinstance(t, (list, tuple)) else [t]
    return sum(p.numel() * p.element_size() for p in parts)


def write_store(source, dst: str, to: ParallelConfig, *, threads: int = 8,
                progress: Callable[[int, int], None] | None = None) -> dict:
    """Write ``source`` laid out for ``to`` as a tenplex store at ``dst``.

    Args:
        source: a :class:`tenplex.store.source.ShardSource`.
        dst: the store URL; it must not hold a committed checkpoint.
        to: the target config.
        threads: stored tensors read at once.
        progress: ``progress(done_bytes, total_bytes)`` as data is written.

    Returns:
        ``{"bytes_read", "bytes_needed", "bytes_written", "seconds", "padding", "notes"}``.

    Raises:
        ConfigError: ``to`` cannot hold the tree.
        AlreadyExistsError: ``dst`` holds a committed checkpoint.
    """
    start = time.perf_counter()
    tree = source.tree
    plan = make_plan(tree, source.config, to)
    runner = StorePlanRunner(source, plan, threads)
    try:
        with StoreWriter(dst, tree, to, meta=source.meta) as writer:
            storing: dict[str, list[int]] = {}
            entries = writer.entries()
            for rank, items in entries.items():
                for path, _, _ in items:
                    storing.setdefault(path, []).append(rank)
            total = sum(e.nbytes for items in entries.values() for e in items)
            done = 0
            paths = [p for p, _ in tree.tensors()]
            with ThreadPoolExecutor(max_workers=2) as builder:
                futures = {i: builder.submit(runner.leaf, p, storing.get(p, [])) for i, p in enumerate(paths[:2])}
                for i, path in enumerate(paths):
                    tensors = futures.pop(i).result()
                    if i + 2 < len(paths):
                        futures[i + 2] = builder.submit(runner.leaf, paths[i + 2], storing.get(paths[i + 2], []))
                    for rank, tensor in sorted(tensors.items()):
                        writer.write(rank, path, tensor)
                    done += sum(_nbytes(t) for t in tensors.values())
                    if progress:
                        progress(done, total)
            writer.commit(target_values(tree, plan, source))
    finally:
        runner.close()
    return {"bytes_read": source.bytes_read, "bytes_needed": runner.bytes_needed,
            "bytes_written": writer.bytes_written, "seconds": time.perf_counter() - start,
            "padding": list(plan.padding), "notes": []}
