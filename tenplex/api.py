"""The public checkpoint API: save, load, load_global, reshard (any format to any format), verify."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

# numpy 2's np.unique imports numpy.ma at its first call (15-30 ms), which a reshard's planner
# would pay mid-run; imported here, it is part of importing the library, as torch is
import numpy.ma  # noqa: F401
import torch
from tqdm import tqdm

from tenplex.errors import ConfigError, bounded_entry
from tenplex.limits import short
from tenplex.formats import TENPLEX, VerifyResult, detect, get_format
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble
from tenplex.store.blocks import DEFAULT_BLOCK
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.reader import StoreReader
from tenplex.store.stream import MAX_OPEN_FILES
from tenplex.store.writer import save as _save
from tenplex.transform.planner import make_plan
from tenplex.units import Progress, format_bytes

__all__ = ["save", "load", "load_global", "reshard", "verify", "ReshardReport"]

save = bounded_entry("url")(_save)  # the verbs turn MemoryError and RecursionError into LimitError


def _counts(where: str, **counts) -> None:
    """Each of ``counts`` is an int >= 1 (the CLI's ``positive_int``, for API callers).

    Raises:
        ConfigError: naming the argument and the value found (``threads=0`` was taken as 1,
            ``threads=2.5`` as 2 and ``max_open_files=0`` as 1, silently).
    """
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {name}: expected an integer >= 1, found {short(value)}")



@dataclass(frozen=True)
class ReshardReport:
    """What a reshard did.

    Attributes:
        src_format, format: the source's and the target's format names.
        src: the source's config (None after a direct reshard, which reads no plan).
        dst: the target config.
        bytes_read: bytes fetched from the source's files (for a tenplex
            store: whole checksum blocks).
        bytes_needed: unique source bytes the plan reads (None after a direct reshard).
        bytes_written: tensor bytes written to the target.
        files: target files written.
        seconds: wall time, in seconds.
        padding: one line per padded axis whose padded length changed.
        notes: remarks for the user (what the target format dropped or derived).
        direct: True when the source's stored items were copied as they are.
    """

    src_format: str
    format: str
    src: ParallelConfig | None
    dst: ParallelConfig
    bytes_read: int
    bytes_needed: int | None
    bytes_written: int
    files: int
    seconds: float
    padding: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    direct: bool = False

    def summary(self) -> str:
        """One line: formats, bytes read, needed and written, seconds and GB/s."""
        gbps = (self.bytes_read + self.bytes_written) / max(self.seconds, 1e-9) / 1e9
        formats = "" if self.src_format == self.format == TENPLEX else \
            f" ({self.src_format} -> {self.format}{', items copied directly' if self.direct else ''})"
        needed = "" if self.bytes_needed is None else f" (needed {format_bytes(self.bytes_needed)})"
        src = "" if self.src is None else f"{self.src} "
        return (f"resharded {src}-> {self.dst}{formats}: read {format_bytes(self.bytes_read)}{needed}, "
                f"wrote {format_bytes(self.bytes_written)} in {self.seconds:.2f} s ({gbps:.2f} GB/s)")


def _joined(t, shape) -> torch.Tensor:
    """A tensor from the store executor's result (parts in flat order are concatenated)."""
    if isinstance(t, (list, tuple)):
        return torch.cat([p.reshape(-1) for p in t]).view(shape)
    return t


@bounded_entry("url")
def load(url: str, config: ParallelConfig | None = None, rank: int = 0, *,
         storage_options: dict | None = None, threads: int = 8) -> dict[str, Any]:
    """One rank's local shards of the checkpoint at ``url``, laid out for ``config``.

    Only the byte ranges the rank needs are read, and their checksums
    verified. Only the rank's own part is planned
    (``make_plan(..., ranks=[rank])``), so the cost grows with what the rank
    holds, not with the world size.

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
        ConfigError: ``config`` cannot hold the tree, or ``threads`` is not an int >= 1.
    """
    _counts(f"load {url}", threads=threads)
    reader = StoreReader(url, storage_options)
    config = config or reader.config
    config.coord(rank)
    plan = make_plan(reader.tree, reader.config, config, ranks=[rank], src_sharding=reader.sharding)
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


@bounded_entry("url")
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


@bounded_entry("src")
def reshard(src: str, dst: str, to: ParallelConfig, *, format: str | None = None,
            storage_options: dict | None = None, threads: int = 8, block: int = DEFAULT_BLOCK,
            max_open_files: int = MAX_OPEN_FILES, progress: Progress | None = None,
            **options) -> ReshardReport:
    """Convert the checkpoint at ``src`` (any installed format) to config ``to``, written atomically at ``dst``.

    The source's format is detected (:func:`tenplex.formats.detect`); the
    target's is ``format``, by default the source's. Where the format offers a
    direct reshard within itself, that is tried first. Otherwise the source
    is opened in place (its metadata and every file's size and header are
    checked before anything is written), only the needed byte ranges are
    read, in parallel, and the target format writes its files a bounded
    number at a time (a tenplex store: at most ``max_open_files``, manifest last).

    Args:
        src: the source checkpoint (path or URL).
        dst: where to write; must not hold a committed checkpoint.
        to: the target config.
        format: the target format's name (``tenplex``, or a plugin's such as
            ``megatron-dist``); default the source's.
        storage_options: fsspec options for tenplex stores.
        threads: work run at once: stored tensors fetched, leaves built by a format plugin's
            writer, files uploaded to an object store (a tenplex store written from a local
            source is built by one thread, which also reads, and written by one more).
        block: a tenplex target's checksum block size, in bytes.
        max_open_files: target shard files open at once.
        progress: ``progress(done_bytes, total_bytes)``: target tensor bytes written.
        options: format options (see :mod:`tenplex.formats.protocol`), e.g.
            ``model_config`` for a Megatron checkpoint without args.

    Returns:
        A :class:`ReshardReport`.

    Raises:
        ConfigError: ``to`` cannot hold the tree, ``format`` is unknown, or ``threads``,
            ``block`` or ``max_open_files`` is not an int >= 1.
        AlreadyExistsError: ``dst`` holds a committed checkpoint, or another
            writer committed there first.
        ManifestError, CorruptShardError: a bad source; nothing is committed at
            ``dst``, and what this reshard wrote there is removed.
    """
    start = time.perf_counter()
    if not isinstance(to, ParallelConfig):
        raise ConfigError(f"reshard {src}: to: expected a ParallelConfig, found {short(to)}")
    _counts(f"reshard {src}", threads=threads, block=block, max_open_files=max_open_files)
    src_fmt = detect(src)
    out_fmt = get_format(format) if format else src_fmt
    opts = {**options, "storage_options": storage_options, "threads": threads, "block": block,
            "max_open_files": max_open_files, "progress": progress}
    direct = getattr(out_fmt, "reshard", None) if out_fmt.name == src_fmt.name else None
    result = direct(src, dst, to, **opts) if direct is not None else None
    config = None
    if result is None:
        source = src_fmt.open_source(src, **opts)
        config = source.config
        result = out_fmt.write(source, dst, to, **opts)
    return ReshardReport(src_fmt.name, out_fmt.name, config, to, result.bytes_read, result.bytes_needed,
                         result.bytes_written, result.files, time.perf_counter() - start,
                         tuple(result.padding), tuple(result.notes), result.direct)


@bounded_entry("url")
def verify(url: str, *, storage_options: dict | None = None, threads: int = 4,
           progress: Progress | bool | None = None, **options) -> VerifyResult:
    """Check a checkpoint of any installed format on disk, without loading it.

    For a tenplex store: the manifest, every shard file's size and header, and
    every block checksum, streamed block by block, ``threads`` files at once, in
    bounded memory (see :mod:`tenplex.store.verify`). Other formats check
    their own (see their ``verify``).

    Args:
        url: the checkpoint.
        storage_options: fsspec options.
        threads: files verified at once.
        progress: ``progress(done_bytes, total_bytes)``; ``None`` shows a tqdm
            bar on stderr when it is a terminal, ``True`` always; ``False`` shows nothing.
        options: format options (see :mod:`tenplex.formats.protocol`).

    Returns:
        A :class:`tenplex.formats.VerifyResult` on success.

    Raises:
        ManifestError: metadata that lies, naming the field.
        CorruptShardError: a missing, truncated or corrupted file, or a header
            that lies, naming the file.
        ConfigError: ``threads`` is not an int >= 1.
    """
    _counts(f"verify {url}", threads=threads)
    fmt = detect(url)
    opts = {**options, "storage_options": storage_options, "threads": threads}
    if progress is False or callable(progress):
        return fmt.verify(url, **opts, progress=progress or None)
    with tqdm(total=0, unit="B", unit_scale=True, desc="verify", disable=None if progress is None
              else False, file=sys.stderr) as bar:
        def show(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        return fmt.verify(url, **opts, progress=show)
