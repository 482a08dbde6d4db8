"""Commit a store whose shard files several processes wrote (one commit, by one process).

:func:`commit_gathered` is the commit step of :func:`tenplex.save_distributed`
and of a reshard under torchrun (:mod:`tenplex.distributed_reshard`): every
process has written and fsynced its files and reported their records (size,
block size, block digests); the committing process checks that each file is
in the store, as it sees it, with its recorded size, and only then writes
the manifest. With per-host directories (``/dev/shm`` on several hosts) the
files of the other hosts are missing there, and the commit is refused
instead of naming files no one can find.
"""

from __future__ import annotations

from typing import Any, Mapping

from tenplex.store.manifest import FileRecord
from tenplex.store.writer import StoreWriter, shard_file

__all__ = ["commit_gathered", "records_from_json", "remove_token_files"]


def records_from_json(items: Mapping[str, Mapping[str, Any]]) -> dict[str, FileRecord]:
    """``{key: FileRecord}`` from ``{key: {"size", "block", "digests"}}`` (``dataclasses.asdict`` of records)."""
    return {k: FileRecord(v["size"], v["block"], tuple(v["digests"])) for k, v in items.items()}


def commit_gathered(writer: StoreWriter, records: Mapping[str, FileRecord], values: Mapping[str, Any],
                    what: str) -> str | None:
    """Check every reported file at the URL the manifest names, then commit; the error, if any.

    Args:
        writer: the committing process's writer (its own files' records are already in it).
        records: every process's file records, ``{key: FileRecord}``.
        values: ``{path: value}`` for every value leaf (as :meth:`StoreWriter.commit`).
        what: the operation, for messages.

    Returns:
        None once committed, or a message naming a file missing or of another size.
    """
    root = writer.root
    root.fs.invalidate_cache()
    for key, rec in sorted(records.items()):
        try:
            size = root.size(key)
        except FileNotFoundError:
            size = None
        if size != rec.size:
            found = "no such file" if size is None else f"{size} bytes"
            return (f"{what}: shard file {root}/{key} is not in the store as process 0 "
                    f"sees it: expected {rec.size} bytes, found {found}; the processes need a store "
                    "every process (and every later reader) can read (a shared filesystem or s3://), "
                    "not a per-host directory")
    writer.add_records(records)
    writer.commit(values)
    return None


def remove_token_files(writer: StoreWriter, ranks) -> None:
    """Remove the shard files of ``ranks`` named with ``writer.token`` (best effort; nothing was committed)."""
    for rank in ranks:
        key = shard_file(rank, writer.token)
        try:
            if writer.root.exists(key):
                writer.root.fs.rm(writer.root.key(key))
        except Exception:  # best effort: the checkpoint is invisible without its manifest
            pass
