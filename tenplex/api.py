"""The public checkpoint API: save, load, load_global, reshard, verify."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble as assemble_shards
from tenplex.store.blocks import DEFAULT_BLOCK, digest
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.reader import StoreReader
from tenplex.store.writer import StoreWriter, save
from tenplex.transform.plan import Totals
from tenplex.transform.planner import make_plan

__all__ = ["save", "load", "reshard", "load_global", "verify", "ReshardReport"]


@dataclass
class ReshardReport:
    """What a reshard did.

    Attributes:
        src, dst: the configs.
        bytes_read: bytes fetched from the source's shard files (whole checksum blocks).
        bytes_needed: unique source bytes the plan reads.
        bytes_written: tensor bytes written to the target.
        seconds: wall time, in seconds.
        plan: the plan's byte totals.
        padding: one line per padded axis whose padded length changed.
    """

    src: ParallelConfig
    dst: ParallelConfig
    bytes_read: int
    bytes_needed: int
    bytes_written: int
    seconds: float
    plan: Totals
    padding: list[str] = field(default_factory=list)

    def summary(self) -> str:
        gbps = (self.bytes_read + self.bytes_written) / max(self.seconds, 1e-9) / 1e9
        return (f"resharded {self.src} -> {self.dst}: read {_size(self.bytes_read)} "
                f"(needed {_size(self.bytes_needed)}), wrote {_size(self.bytes_written)} "
                f"in {self.seconds:.2f} s ({gbps:.2f} GB/s)")


def _joined(t, shape) -> torch.Tensor:
    """A tensor from the store executor's result (parts in flat order are concatenated)."""
    if isinstance(t, (list, tuple)):
        return torch.cat([p.reshape(-1) for p in t]).view(shape)
    return t


def _nbytes(t) -> int:
    parts = t if isinstance(t, (list, tuple)) else [t]
    return sum(p.numel() * p.element_size() for p in parts)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"


def load(url: str, config: ParallelConfig | None = None, rank: int = 0, *,
         storage_options: dict | None = None, threads: int = 8) -> dict[str, Any]:
    """One rank's local shards of the checkpoint at ``url``, laid out for ``config``.

    Only the byte ranges the rank needs are read, and their checksums verified.

    Args:
        url: the checkpoint.
        config: the rank's parallel config; default the stored one.
        rank: the rank.
        storage_options: fsspec options.
        threads: stored tensors fetched at once.

    Returns:
        ``{path: local tensor or value}`` for every leaf the rank holds.

    Raises:
        ManifestError: not a committed checkpoint, or a bad manifest.
        CorruptShardError: a missing, truncated or corrupted shard file.
        ConfigError: ``config`` cannot hold the tree.
    """
    reader = StoreReader(url, storage_options)
    config = config or reader.config
    plan = make_plan(reader.tree, reader.config, config)
    config.coord(rank)
    runner = StorePlanRunner(reader, plan, threads)
    try:
        out: dict[str, Any] = {}
        for path, leaf in reader.tree.tensors():
            for t in runner.leaf(path, [rank]).values():
                out[path] = _joined(t, runner.D.holding(path, config.coord(rank)).shape)
        out.update(target_values(reader.tree, plan, reader, [rank])[rank])
        return {p: out[p] for p in reader.tree.leaves if p in out}
    finally:
        runner.close()


def load_global(url: str, *, storage_options: dict | None = None) -> dict[str, Any]:
    """The global state of the checkpoint at ``url``: ``{path: logical tensor or value}``.

    Tensors have their logical shapes (padding rows dropped). Values are as
    stored (``{key: value}`` for scoped leaves).
    """
    reader = StoreReader(url, storage_options)
    single = ParallelConfig()
    shards = load(url, single, 0, storage_options=storage_options)
    out = assemble_shards(reader.tree, single, {0: shards})
    for path, _ in reader.tree.values():
        out[path] = reader.manifest.values[path]
    return out


def reshard(src: str, dst: str, to: ParallelConfig, *, storage_options: dict | None = None,
            threads: int = 8, block: int = DEFAULT_BLOCK,
            progress: Callable[[int, int], None] | None = None, events=None) -> ReshardReport:
    """Convert the checkpoint at ``src`` to config ``to``, written atomically at ``dst``.

    Only the needed byte ranges are read (once each), in parallel; output
    files are streamed and the manifest is written last.

    Args:
        src: the source checkpoint.
        dst: where to write; must not hold a committed checkpoint.
        to: the target config.
        storage_options: fsspec options for both URLs.
        threads: stored tensors fetched at once.
        block: the target's checksum block size, in bytes.
        progress: ``progress(done_bytes, total_bytes)`` as data is written.
        events: the writer's low-level ``events(event, nbytes)`` callback
            (see :data:`tenplex.store.writer.Progress`).

    Returns:
        A :class:`ReshardReport`.

    Raises:
        ConfigError: ``to`` cannot hold the tree.
        AlreadyExistsError: ``dst`` holds a committed checkpoint.
        ManifestError, CorruptShardError: a bad source; nothing is committed at ``dst``.
    """
    start = time.perf_counter()
    reader = StoreReader(src, storage_options)
    tree = reader.tree
    plan = make_plan(tree, reader.config, to)
    runner = StorePlanRunner(reader, plan, threads)
    with StoreWriter(dst, tree, to, storage_options=storage_options,
                     meta=reader.manifest.meta, block=block, progress=events) as writer:
        entries = writer.entries()
        storing: dict[str, list[int]] = {}
        for rank, items in entries.items():
            for path, _, _ in items:
                storing.setdefault(path, []).append(rank)
        total = sum(e.nbytes for items in entries.values() for e in items)
        done = 0
        with ThreadPoolExecutor(max_workers=2) as builder, \
                ThreadPoolExecutor(max_workers=max(1, threads)) as io:
            paths = [p for p, _ in tree.tensors()]
            futures = {}
            for i, path in enumerate(paths[:2]):
                futures[i] = builder.submit(runner.leaf, path, storing.get(path, []))
            for i, path in enumerate(paths):
                tensors = futures.pop(i).result()
                if i + 2 < len(paths):
                    nxt = paths[i + 2]
                    futures[i + 2] = builder.submit(runner.leaf, nxt, storing.get(nxt, []))
                list(io.map(lambda item: writer.write(item[0], path, item[1]),
                            sorted(tensors.items())))
                done += sum(_nbytes(t) for t in tensors.values())
                if progress:
                    progress(done, total)
        writer.commit(target_values(tree, plan, reader))
    runner.close()
    padding = [f"{p.path}: axis {p.axis} padded {p.src_padded} -> {p.dst_padded} "
               f"(logical {p.logical}; {p.created} rows zero-filled, {p.dropped} dropped)"
               for p in plan.padding]
    return ReshardReport(reader.config, to, reader.bytes_read, runner.bytes_needed,
                         writer.bytes_written, time.perf_counter() - start, plan.totals, padding)


def verify(url: str, *, storage_options: dict | None = None, progress=None) -> dict:
    """Check every shard file's size and every block checksum, and the manifest's consistency.

    Returns:
        ``{"files": n, "bytes": n, "tensors": n}`` on success.

    Raises:
        ManifestError: a bad manifest.
        CorruptShardError: a missing, truncated or corrupted file, naming it.
    """
    reader = StoreReader(url, storage_options)
    total = 0
    for key, frec in reader.manifest.files.items():
        reader.check_file(key)
        data = reader.root.fs.cat_file(reader.root.key(key))
        for index in range(len(frec.digests)):
            part = memoryview(data)[index * frec.block:(index + 1) * frec.block]
            if digest(part) != frec.digests[index]:
                raise reader.mismatch(key, index, digest(part))
        total += frec.size
    return {"files": len(reader.manifest.files), "bytes": total,
            "tensors": len(reader.manifest.tensors)}
