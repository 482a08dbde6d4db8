"""``tenplex verify`` for megatron-core ``torch_dist`` directories, without loading them into memory.

The directory is first described with every check the reader makes. Then
every DCP item's ``torch.save`` archive inside its ``.distcp`` file is read
in full and each record's CRC-32 checked, files in parallel; the DCP
metadata must be complete (every item has a byte range inside its file, and
the chunks of every tensor tile it exactly); the tied embedding's copies are
compared.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from math import prod

from tenplex.errors import CorruptShardError, ManifestError
from tenplex.ptree.region import Box, intersect

from tenplex_megatron.dcp.records import MetadataIndex, TensorStorageMetadata
from tenplex_megatron.formats.checks import Progress, archive_crc, file_digest, run_jobs
from tenplex_megatron.formats.dist.read import describe_dist
from tenplex_megatron.formats.dist.source import DistSource, chunk_path
from tenplex_megatron.model.tied import check_tied

__all__ = ["verify_dist"]


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


def verify_dist(path: str, model_config: dict | None = None, *, checksums: bool = False,
                threads: int = 8, progress: Progress | None = None, iteration: int | str | None = None) -> dict:
    """Verify a ``torch_dist`` directory on disk (see the module docstring).

    Returns:
        ``{"files", "bytes", "tensors", "checksums"}``.

    Raises:
        ManifestError, ConfigError: see :func:`tenplex_megatron.formats.dist.read.describe_dist`;
            also incomplete metadata or a byte range outside its file.
        CorruptShardError: an item whose CRC-32 fails, or a missing or truncated file.
    """
    source = DistSource(describe_dist(path, model_config, iteration))
    root = source.root  # the iteration folder under a --save root
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
        jobs.append(((lambda p=path, s=start, n=length, w=what: archive_crc(p, s, n, w)), length))
    for key, item in md.state_dict_metadata.items():  # each blob holds what the metadata says
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                source.chunk_ref(key, Box(tuple(chunk.offsets), tuple(chunk.sizes)), item.properties.dtype)
    nbytes = run_jobs(jobs, threads, progress)
    source.check_objects()
    check_tied(source)
    files = sorted(sizes)
    sums = None
    if checksums:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            sums = dict(zip((os.path.basename(f) for f in files), pool.map(file_digest, files)))
    tensors = sum(len(i.chunks) for i in md.state_dict_metadata.values() if isinstance(i, TensorStorageMetadata))
    return {"files": len(files), "bytes": nbytes, "tensors": tensors, "checksums": sums}
