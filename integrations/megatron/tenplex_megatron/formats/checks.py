"""Checks both Megatron formats' ``verify`` share: archive CRC-32s, file digests, jobs in threads.

A ``torch.save`` archive (a legacy ``.pt`` file, or a DCP item inside a
``.distcp`` file) is read in full and each of its records checked against
the CRC-32 the archive stores; an xxh3-128 digest of a whole file is
returned for a later comparison.
"""

from __future__ import annotations

import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import xxhash

from tenplex.errors import CorruptShardError

from tenplex_megatron.torchfiles.ptfile import Window

__all__ = ["Progress", "archive_crc", "file_digest", "run_jobs"]

Progress = Callable[[int, int], None]


def archive_crc(path: str, start: int = 0, length: int | None = None, what: str | None = None) -> int:
    """Read a ``torch.save`` archive (or one inside a file) in full and check every record's CRC-32."""
    what = what or path
    try:
        with Window(path, start, length) as window, zipfile.ZipFile(window) as archive:
            bad = archive.testzip()
            size = window.length
    except FileNotFoundError:
        raise CorruptShardError(f"{what}: the file is missing") from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CorruptShardError(f"{what}: not a readable torch.save archive ({exc})") from None
    if bad is not None:
        raise CorruptShardError(f"{what}: record {bad} fails its CRC-32 check; the file is corrupted")
    return size


def file_digest(path: str, chunk: int = 16 << 20) -> str:
    """xxh3-128 of a whole file, read ``chunk`` bytes at a time."""
    state = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            state.update(data)
    return state.hexdigest()


def run_jobs(jobs: list[tuple[Callable[[], int], int]], threads: int, progress: Progress | None) -> int:
    """Run ``(job, bytes)`` pairs ``threads`` at once; ``progress(done, total)`` in bytes; the bytes done."""
    total, done = sum(n for _, n in jobs), 0
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n in pool.map(lambda job: job[0](), jobs):
            done += n
            if progress:
                progress(done, total)
    return done


