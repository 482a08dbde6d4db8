"""``tenplex verify`` for Megatron checkpoints: what is on disk, checked without loading it into memory.

Both formats are first described with every check the readers make (safe
unpickling, every key known, every shape and dtype the model config's).
Then every stored ``torch.save`` archive (a legacy ``.pt`` file, or a DCP
item inside a ``.distcp`` file) is read in full and each of its records
checked against the CRC-32 the archive stores, files in parallel; then the
tied embedding's copies are compared. For ``torch_dist`` the DCP metadata must also be complete: every
item has a byte range inside its file, and the chunks of every tensor tile
it exactly. With ``checksums``, an xxh3-128 digest of every file is
returned too, for a later comparison.
"""

from __future__ import annotations

import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from math import prod
from typing import Callable

import xxhash

from tenplex.errors import CorruptShardError, ManifestError
from tenplex.ptree.region import Box, intersect

from tenplex_megatron.dcp_read import describe_dist
from tenplex_megatron.dcp_records import MetadataIndex, TensorStorageMetadata
from tenplex_megatron.dcp_source import DistSource, chunk_path
from tenplex_megatron.legacy import LegacySource, describe_legacy
from tenplex_megatron.ptfile import Window
from tenplex_megatron.tied import check_tied

__all__ = ["verify_legacy", "verify_dist"]

Progress = Callable[[int, int], None]


def _crc(path: str, start: int = 0, length: int | None = None, what: str | None = None) -> int:
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


def _digest(path: str, chunk: int = 16 << 20) -> str:
    """xxh3-128 of a whole file, read ``chunk`` bytes at a time."""
    state = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            state.update(data)
    return state.hexdigest()


def _run(jobs: list[tuple[Callable[[], int], int]], threads: int, progress: Progress | None) -> int:
    total, done = sum(n for _, n in jobs), 0
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n in pool.map(lambda job: job[0](), jobs):
            done += n
            if progress:
                progress(done, total)
    return done


def verify_legacy(root: str, model_config: dict | None = None, *, checksums: bool = False,
                  threads: int = 8, progress: Progress | None = None) -> dict:
    """Verify a Megatron-LM per-rank checkpoint on disk.

    Returns:
        ``{"files", "bytes", "tensors", "checksums"}`` (``checksums``:
        ``{relative path: xxh3-128}`` when asked, else None).

    Raises:
        ManifestError, ConfigError: a file that is unsafe, unreadable, or does
            not fit the model (see :func:`tenplex_megatron.legacy.describe_legacy`).
        CorruptShardError: a record whose CRC-32 fails, or a truncated file.
    """
    source = LegacySource(describe_legacy(root, model_config, threads))
    files = sorted({ref.file for ref in source.refs.values()})
    jobs = [((lambda f=f: _crc(f)), os.path.getsize(f)) for f in files]
    nbytes = _run(jobs, threads, progress)
    check_tied(source)
    sums = None
    if checksums:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            sums = dict(zip((os.path.relpath(f, root) for f in files), pool.map(_digest, files)))
    return {"files": len(files), "bytes": nbytes, "tensors": len(source.refs), "checksums": sums}


def _check_tiling(root: str, key: str, item: TensorStorageMetadata) -> None:
    size = tuple(item.size)
    boxes = [Box(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
    for box in boxes:
        if len(box.sizes) != len(size) or any(o < 0 or o + s > n for o, s, n in zip(box.offsets, box.sizes, size)):
            raise ManifestError(f"{root}/.metadata: chunk {box} of {key} lies outside {list(size)}")
    groups: dict = {}
    for box in boxes:
        groups.setdefault(box.offsets[0] if box.sizes and box.sizes[0] == 1 else None, []).append(box)
    for group in groups.values():
        others = group + (groups.get(None, []) if group is not groups.get(None) else [])
        for i, a in enumerate(group):
            for b in others[i + 1:]:
                if intersect(a, b) is not None:
                    raise ManifestError(f"{root}/.metadata: chunks {a} and {b} of {key} overlap")
    covered = sum(prod(b.sizes) for b in boxes)
    if covered != prod(size):
        raise ManifestError(f"{root}/.metadata: the chunks of {key} cover {covered} of its "
                            f"{prod(size)} elements; the metadata is incomplete")


def verify_dist(root: str, model_config: dict | None = None, *, checksums: bool = False,
                threads: int = 8, progress: Progress | None = None) -> dict:
    """Verify a ``torch_dist`` directory on disk (see the module docstring).

    Returns:
        ``{"files", "bytes", "tensors", "checksums"}``.

    Raises:
        ManifestError, ConfigError: see :func:`tenplex_megatron.dcp_read.describe_dist`;
            also incomplete metadata or a byte range outside its file.
        CorruptShardError: an item whose CRC-32 fails, or a missing or truncated file.
    """
    source = DistSource(describe_dist(root, model_config))
    md, jobs, sizes = source.md, [], {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            _check_tiling(root, key, item)
            for chunk in item.chunks:
                if MetadataIndex(key, chunk.offsets) not in md.storage_data:
                    raise ManifestError(f"{root}/.metadata: chunk {list(chunk.offsets)} of {key} has no "
                                        "storage record")
        elif MetadataIndex(key) not in md.storage_data:
            raise ManifestError(f"{root}/.metadata: object {key} has no storage record")
    for index, info in md.storage_data.items():
        path = chunk_path(root, info.relative_path)
        if path not in sizes:
            if not os.path.exists(path):
                raise CorruptShardError(f"{path}: the file is missing")
            sizes[path] = os.path.getsize(path)
        start, length = int(info.offset), int(info.length)
        if start < 0 or length < 0 or start + length > sizes[path]:
            raise CorruptShardError(f"{path}: item {index.fqn} at bytes [{start}, {start + length}) lies "
                                    f"outside the file of {sizes[path]} bytes")
        what = f"{path} [{index.fqn} {list(index.offset) if index.offset is not None else ''}]"
        jobs.append(((lambda p=path, s=start, n=length, w=what: _crc(p, s, n, w)), length))
    for key, item in md.state_dict_metadata.items():  # each blob holds what the metadata says
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                source.chunk_ref(key, Box(tuple(chunk.offsets), tuple(chunk.sizes)), item.properties.dtype)
    nbytes = _run(jobs, threads, progress)
    source.check_objects()
    check_tied(source)
    files = sorted(sizes)
    sums = None
    if checksums:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            sums = dict(zip((os.path.basename(f) for f in files), pool.map(_digest, files)))
    tensors = sum(len(i.chunks) for i in md.state_dict_metadata.values() if isinstance(i, TensorStorageMetadata))
    return {"files": len(files), "bytes": nbytes, "tensors": tensors, "checksums": sums}

