"""The tenplex store as a :class:`~tenplex.formats.protocol.Format`.

A tenplex checkpoint is a directory (or any fsspec URL) with a
``manifest.json`` at its root. ``write`` plans the source's config to the
target's (:func:`tenplex.transform.planner.make_plan`), builds target tensors
with the store executor (:class:`tenplex.store.execute.StorePlanRunner`)
from the source's byte ranges, streams them into the target's shard files
at most ``max_open_files`` at a time (:func:`tenplex.store.stream.stream_targets`)
and commits the manifest last. Every reshard that writes a tenplex store,
from any format, goes through this one loop.
"""

from __future__ import annotations

import re

from tenplex.errors import ManifestError, StoreError
from tenplex.formats.protocol import Description, VerifyResult, WriteResult, padding_lines, source_notes
from tenplex.limits import short
from tenplex.ptree.config import ParallelConfig
from tenplex.store.blocks import DEFAULT_BLOCK
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.manifest import MANIFEST
from tenplex.store.reader import StoreReader
from tenplex.store.source import ShardSource
from tenplex.store.stream import MAX_OPEN_FILES, stream_targets
from tenplex.store.url import StoreRoot
from tenplex.store.verify import verify_store
from tenplex.store.writer import StoreWriter
from tenplex.transform.planner import make_plan

__all__ = ["TENPLEX", "TenplexFormat", "write_store"]

TENPLEX = "tenplex"
"""The store format's name (``--format tenplex``)."""

_DIGEST = re.compile(r"[0-9a-f]{32}")  # xxh3-128, hex (tenplex.store.blocks.digest)


def write_store(source: ShardSource, dst: str, to: ParallelConfig, *, threads: int = 8,
                storage_options: dict | None = None, block: int = DEFAULT_BLOCK,
                max_open_files: int = MAX_OPEN_FILES, progress=None) -> WriteResult:
    """Write ``source`` laid out for ``to`` as a tenplex store at ``dst``, committed atomically.

    Args:
        source: any shard source (a tenplex store, or another format's ``open_source``).
        dst: the target URL; it must not hold a committed checkpoint.
        to: the target config.
        threads: stored tensors read from, and a leaf's files written to, an object store at
            once (a local source is read by the building thread, a local target written by
            one write thread: :mod:`tenplex.store.stream`).
        storage_options: fsspec options for ``dst``.
        block: the target's checksum block size, in bytes.
        max_open_files: target shard files open at once (whatever the
            number of target ranks; one open file per rank hit ``EMFILE``).
        progress: ``progress(done_bytes, total_bytes)``: target tensor bytes written.

    Returns:
        A :class:`WriteResult` (``bytes_read`` counts the source's reads so far; ``notes`` are the
        source's, :func:`~tenplex.formats.protocol.source_notes`).

    Raises:
        ConfigError: ``to`` cannot hold the tree.
        AlreadyExistsError: ``dst`` holds a committed checkpoint, or another
            writer committed there first.
        ManifestError, CorruptShardError: a bad source; nothing is committed at
            ``dst``, and what was written there is removed.
    """
    tree = source.tree
    plan = make_plan(tree, source.config, to, src_sharding=source.sharding)
    runner = StorePlanRunner(source, plan, threads, reuse=True, inline_local=True)
    try:
        with StoreWriter(dst, tree, to, storage_options=storage_options, meta=source.meta,
                         block=block, progress=progress, sharding=plan.dst_sharding(tree)) as writer:
            stream_targets(runner, writer, threads=threads, max_open_files=max_open_files)
            writer.commit(target_values(tree, plan, source))
    finally:
        runner.close()
    return WriteResult(bytes_read=source.bytes_read, bytes_needed=runner.bytes_needed,
                       bytes_written=writer.bytes_written, files=len(writer.entries()),
                       padding=padding_lines(plan.padding), notes=source_notes(source))


class TenplexFormat:
    """tenplex's own checkpoints: safetensors shard files and a JSON manifest, on any fsspec URL.

    Options: ``storage_options`` (fsspec), ``threads``, ``block``,
    ``max_open_files``, ``progress``; others are ignored.
    """

    name = TENPLEX

    @staticmethod
    def detect(path: str) -> bool:
        try:
            return StoreRoot(path).exists(MANIFEST)
        except StoreError:
            return False

    @staticmethod
    def describe(path: str, **options) -> Description:
        reader = StoreReader(path, options.get("storage_options"))
        m = reader.manifest
        return Description(format=TENPLEX, tree=reader.tree, config=reader.config, values=m.values,
                           meta=m.meta, files=len(m.files), stored_bytes=sum(f.size for f in m.files.values()))

    @staticmethod
    def open_source(path: str, **options) -> StoreReader:
        """The store's reader, with every shard file's size and header checked first."""
        reader = StoreReader(path, options.get("storage_options"))
        reader.check_files(options.get("threads", 8))
        return reader

    @staticmethod
    def share(source: StoreReader) -> dict:
        """What another process needs to open the same store (:meth:`open_shared`): the digest of
        the manifest this process read. Its files were checked by :meth:`open_source` here."""
        return {"manifest": source.manifest_digest}

    @staticmethod
    def open_shared(path: str, shared, **options) -> StoreReader:
        """The store :meth:`share` described, as this process reads it: the manifest is read and
        checked here, each shard file's size and header only before this process's first read of
        it (:meth:`StoreReader.check_file`), so a process reads the headers of its own files only.

        Raises:
            ManifestError: ``shared`` is not what :meth:`share` gives, or the manifest at ``path``
                differs from the one the sharing process read (``path`` is not on storage that
                every process shares, or holds another copy).
        """
        expected = shared.get("manifest") if isinstance(shared, dict) else None
        if not isinstance(expected, str) or not _DIGEST.fullmatch(expected):
            raise ManifestError(f"{path}: shared source: expected {{'manifest': 32 hex digits "
                                f"(xxh3-128)}}, found {short(shared, 80)}")
        reader = StoreReader(path, options.get("storage_options"))
        if expected != reader.manifest_digest:
            raise ManifestError(f"{reader.root}/{MANIFEST}: this process read a manifest with xxh3-128 "
                                f"{reader.manifest_digest}, the process that opened the source read "
                                f"{expected}; every process must see the same store (shared storage)")
        return reader

    @staticmethod
    def write(source: ShardSource, path: str, to: ParallelConfig, **options) -> WriteResult:
        keep = ("threads", "storage_options", "block", "max_open_files", "progress")
        return write_store(source, path, to, **{k: options[k] for k in keep if options.get(k) is not None})

    @staticmethod
    def verify(path: str, **options) -> VerifyResult:
        reader = StoreReader(path, options.get("storage_options"))
        r = verify_store(reader, threads=options.get("threads", 4), progress=options.get("progress"))
        return VerifyResult(files=r["files"], bytes=r["bytes"], tensors=r["tensors"],
                            checked="every checksum")
