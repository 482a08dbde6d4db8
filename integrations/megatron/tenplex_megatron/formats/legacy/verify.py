"""``tenplex verify`` for Megatron-LM per-rank checkpoints, without loading them into memory.

The checkpoint is first described with every check the reader makes (safe
unpickling, every key known, every shape and dtype the model config's).
Then every ``.pt`` file is read in full and each record's CRC-32 checked,
files in parallel, and the tied embedding's copies are compared.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from tenplex_megatron.formats.checks import Progress, archive_crc, file_digest, run_jobs
from tenplex_megatron.formats.legacy.read import LegacySource, describe_legacy
from tenplex_megatron.model.tied import check_tied

__all__ = ["verify_legacy"]


def verify_legacy(root: str, model_config: dict | None = None, *, checksums: bool = False,
                  threads: int = 8, progress: Progress | None = None,
                  iteration: int | str | None = None) -> dict:
    """Verify a Megatron-LM per-rank checkpoint on disk.

    Returns:
        ``{"files", "bytes", "tensors", "checksums"}`` (``checksums``:
        ``{relative path: xxh3-128}`` when asked, else None).

    Raises:
        ManifestError, ConfigError: a file that is unsafe, unreadable, or does
            not fit the model (see :func:`tenplex_megatron.formats.legacy.read.describe_legacy`).
        CorruptShardError: a record whose CRC-32 fails, or a truncated file.
    """
    source = LegacySource(describe_legacy(root, model_config, threads, iteration))
    files = sorted({ref.file for ref in source.refs.values()})
    jobs = [((lambda f=f: archive_crc(f)), os.path.getsize(f)) for f in files]
    nbytes = run_jobs(jobs, threads, progress)
    check_tied(source)
    sums = None
    if checksums:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            sums = dict(zip((os.path.relpath(f, root) for f in files), pool.map(file_digest, files)))
    return {"files": len(files), "bytes": nbytes, "tensors": len(source.refs), "checksums": sums}
