"""The public checkpoint API: save, load, load_global, reshard, verify."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble
from tenplex.store.blocks import DEFAULT_BLOCK
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.reader import StoreReader
from tenplex.store.stream import MAX_OPEN_FILES, stream_targets
from tenplex.store.verify import verify_store
from tenplex.store.writer import StoreWriter, save
from tenplex.transform.plan import Totals
from tenplex.transform.planner import make_plan
from tenplex.units import Progress, format_bytes

__all__ = ["save", "load", "load_global", "reshard", "verify", "ReshardReport"]



@dataclass
class ReshardReport:
    """What a reshard did.

    Attributes:
        src, dst: the configs.
        bytes_read: bytes fetched from the source's shard files (whole checksum blocks).
        bytes_needed: unique source bytes the plan reads.
        bytes_written: tensor bytes written to the target.
        seconds: wall time, in seconds.
        totals: the plan's byte totals.
        padding: one line per padded axis whose padded length changed.
    """

    src: ParallelConfig
    dst: ParallelConfig
    bytes_read: int
    bytes_needed: int
    bytes_written: int
    seconds: float
    totals: Totals
    padding: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: bytes read, needed and written, seconds and GB/s."""
        gbps = (self.bytes_read + self.bytes_written) / max(self.seconds, 1e-9) / 1e9
        return (f"resharded {self.src} -> {self.dst}: read {format_bytes(self.bytes_read)} "
                f"(needed {format_bytes(self.bytes_needed)}), wrote "
                f"{format_bytes(self.bytes_written)} in {self.seconds:.2f} s ({gbps:.2f} GB/s)")


def _joined(t, shape) -> torch.Tensor:
    """A tensor from the store executor's result (parts in flat order are concatenated)."""
    if isinstance(t, (list, tuple)):
        return torch.cat([p.reshape(-1) for p in t]).view(shape)
    return t


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
        ManifestError: not a committed checkpoint, or a manifest that lies.
        CorruptShardError: a missing, truncated or corrupted shard file, or
            one whose safetensors header disagrees with the manifest.
        ConfigError: ``config`` cannot hold the tree.
    """
    reader = StoreReader(url, storage_options)
    config = config or reader.config
    plan = make_plan(reader.tree, reader.config, config)
    config.coord(rank)
    runner = StorePlanRunner(reader, plan, threads)
    try:
        out: dict[str, Any] = {}
        for path, _ in reader.tree.tensors():
            for t in runner.leaf(path, [rank]).values():
                out[path] = _joined(t, runner.D.holding(path, config.coord(rank)).shape)
        out.update(target_values(reader.tree, plan, reader, [rank])[rank])
        return {p: out[p] for p in reader.tree.leaves if p in out}
    finally:
        runner.close()


def load_global(url: str, *, storage_options: dict | None = None) -> dict[str, Any]:
    """The global state of the checkpoint at ``url``: ``{path: logical tensor or value}``.

    Tensors have their logical shapes (padding rows dropped). Values are as
    stored (``{key: value}`` for scoped leaves). Not to be confused with
    :func:`tenplex.ptree.assemble`, which assembles shards held in memory.

    Raises:
        ManifestError, CorruptShardError: as :func:`load`.
    """
    reader = StoreReader(url, storage_options)
    single = ParallelConfig()
    shards = load(url, single, 0, storage_options=storage_options)
    out = assemble(reader.tree, single, {0: shards})
    for path, _ in reader.tree.values():
        out[path] = reader.manifest.values[path]
    return out


def reshard(src: str, dst: str, to: ParallelConfig, *, storage_options: dict | None = None,
            threads: int = 8, block: int = DEFAULT_BLOCK, max_open_files: int = MAX_OPEN_FILES,
            progress: Progress | None = None) -> ReshardReport:
    """Convert the checkpoint at ``src`` to config ``to``, written atomically at ``dst``.

    The source's manifest and every shard file's size and header are checked
    before anything is written. Only the needed byte ranges are read, in
    parallel; output files are streamed, at most ``max_open_files`` at once,
    and the manifest is written last.

    Args:
        src: the source checkpoint.
        dst: where to write; must not hold a committed checkpoint.
        to: the target config.
        storage_options: fsspec options for both URLs.
        threads: stored tensors fetched at once.
        block: the target's checksum block size, in bytes.
        max_open_files: target shard files open at once.
        progress: ``progress(done_bytes, total_bytes)``: target tensor bytes written.

    Returns:
        A :class:`ReshardReport`.

    Raises:
        ConfigError: ``to`` cannot hold the tree.
        AlreadyExistsError: ``dst`` holds a committed checkpoint, or another
            writer committed there first.
        ManifestError, CorruptShardError: a bad source; nothing is committed at
            ``dst``, and what this reshard wrote there is removed.
    """
    start = time.perf_counter()
    reader = StoreReader(src, storage_options)
    reader.check_files(threads)
    tree = reader.tree
    plan = make_plan(tree, reader.config, to)
    runner = StorePlanRunner(reader, plan, threads)
    try:
        with StoreWriter(dst, tree, to, storage_options=storage_options, meta=reader.manifest.meta,
                         block=block, progress=progress) as writer:
            stream_targets(runner, writer, threads=threads, max_open_files=max_open_files)
            writer.commit(target_values(tree, plan, reader))
    finally:
        runner.close()
    padding = [str(p) for p in plan.padding]
    return ReshardReport(reader.config, to, reader.bytes_read, runner.bytes_needed,
                         writer.bytes_written, time.perf_counter() - start, plan.totals, padding)


def verify(url: str, *, storage_options: dict | None = None, threads: int = 4,
           progress: Progress | bool | None = None) -> dict:
    """Check the manifest, every shard file's size and header, and every block checksum.

    Files are streamed block by block, ``threads`` at once, in bounded memory
    (see :mod:`tenplex.store.verify`).

    Args:
        url: the checkpoint.
        storage_options: fsspec options.
        threads: files verified at once.
        progress: ``progress(done_bytes, total_bytes)``; ``None`` shows a tqdm
            bar on stderr when it is a terminal, ``True`` always; ``False`` shows nothing.

    Returns:
        ``{"files": n, "bytes": n, "tensors": n}`` on success (bytes of shard files).

    Raises:
        ManifestError: a manifest that lies, naming the field.
        CorruptShardError: a missing, truncated or corrupted file, or a header
            that lies, naming the file.
    """
    reader = StoreReader(url, storage_options)
    if progress is False or callable(progress):
        return verify_store(reader, threads=threads, progress=progress or None)
    with tqdm(total=0, unit="B", unit_scale=True, desc="verify", disable=None if progress is None
              else False, file=sys.stderr) as bar:
        def show(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        return verify_store(reader, threads=threads, progress=show)
