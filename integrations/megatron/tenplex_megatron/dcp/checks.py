"""Checks on DCP metadata after it is unpickled: types, paths, byte ranges, chunk coverage.

The restricted unpickler guarantees that only DCP's records were built; this
module checks that what they say is possible, before any byte is read:

- every field has its record's type (``torch.Size`` of ints, ``str`` keys...);
- every ``relative_path`` is a plain file name (no ``/``, ``\\``, ``..`` or
  absolute path) of a regular file that, with symlinks resolved, stays in
  the checkpoint directory;
- every item's ``[offset, offset + length)`` lies inside its file, no two
  items share a byte, ``transform_descriptors`` is empty (tenplex reads
  plain items only), and a byte object is at most :data:`MAX_OBJECT_BYTES`;
- every tensor's chunks lie inside the tensor, are disjoint and cover it
  (so DCP fills every element), each has a storage item, and each item is
  at least as long as its chunk's raw bytes (so a small file cannot claim
  a huge tensor);
- every tensor item is a ``torch.save`` archive whose pickle passes the
  tensor allow-list (:func:`tenplex_megatron.torchfiles.safe_load.tensor_header`) and
  holds a row-major tensor of its chunk's shape and dtype (DCP would cast
  a different dtype silently). This reads each item's zip directory and
  pickle, not its data: about 0.1 ms per item. Where each tensor's data
  lies is returned, so readers do not parse the item again.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from tenplex.errors import CorruptShardError, ManifestError, PathError
from tenplex.limits import short
from tenplex.store.paths import resolve_inside

from tenplex_megatron.dcp.records import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                          MetadataIndex, StorageInfo, StorageMeta, TensorProperties,
                                          TensorStorageMetadata)
from tenplex_megatron.torchfiles.ptfile import TensorRef, tensor_ref
from tenplex_megatron.torchfiles.safe_load import (MAX_NDIM, FileView, open_regular, regular_file_size,
                                        tensor_header)

__all__ = ["MAX_OBJECT_BYTES", "MAX_CHUNK_PAIRS", "check_metadata", "item_file"]

MAX_OBJECT_BYTES = 256 << 20
"""The largest DCP byte object tenplex reads into memory (256 MiB; megatron-core's are KiB)."""

MAX_CHUNK_PAIRS = 1 << 22
"""The most chunk pairs whose first-axis ranges overlap that the disjointness check compares
per tensor; a tensor needing more is refused."""


MAX_KEY = 1024
"""Longest key a DCP checkpoint may name (megatron-core's are under 200 characters)."""


def item_file(root: str, relative_path: object) -> tuple[str, int]:
    """The path and size of an item's file, ``relative_path`` taken from DCP metadata.

    Raises:
        PathError: not a plain file name, or it resolves (through symlinks)
            outside ``root``.
        CorruptShardError: the file is missing or not a regular file.
    """
    what = f"{root}/.metadata: relative_path {short(relative_path, 120)}"
    if type(relative_path) is not str or not relative_path:
        raise PathError(f"{what} is not a file name")
    if os.path.isabs(relative_path) or relative_path.startswith(("/", "\\")):
        raise PathError(f"{what} is absolute; DCP items are files in the checkpoint directory")
    if ".." in relative_path.replace("\\", "/").split("/"):
        raise PathError(f"{what} contains '..'; DCP items are files in the checkpoint directory")
    if "/" in relative_path or "\\" in relative_path or "\0" in relative_path or relative_path == ".":
        raise PathError(f"{what} is not a plain file name in the checkpoint directory")
    path = os.path.join(root, relative_path)
    real = resolve_inside(root, path, what)  # the one path rule (tenplex.store.paths)
    return path, regular_file_size(real, path)


def _is_size(value: object, ndim: int | None = None) -> bool:
    return type(value) is torch.Size and len(value) <= MAX_NDIM and \
        (ndim is None or len(value) == ndim) and all(0 <= n < 1 << 62 for n in value)


def _check_types(md: Metadata, what: str) -> None:
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        raise ManifestError(f"{what}: state_dict_metadata and storage_data must be dicts")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta or \
            md.version is not None and type(md.version) is not str:
        raise ManifestError(f"{what}: storage_meta or version has the wrong type")
    if md.planner_data is not None and type(md.planner_data) is not dict:
        raise ManifestError(f"{what}: planner_data is a {type(md.planner_data).__name__}, not a dict")
    for key, item in md.state_dict_metadata.items():
        if type(key) is not str or len(key) > MAX_KEY:
            raise ManifestError(f"{what}: state_dict_metadata key {short(key, 80)} is not a str of at most "
                                f"{MAX_KEY} characters")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata or type(item.properties) is not TensorProperties \
                or not _is_size(item.size) or type(item.chunks) is not list:
            raise ManifestError(f"{what}: {key}: expected TensorStorageMetadata(properties, size, chunks), "
                                f"got {short(item, 120)}")
        for c in item.chunks:
            if type(c) is not ChunkStorageMetadata or not _is_size(c.offsets, len(item.size)) or \
                    not _is_size(c.sizes, len(item.size)):
                raise ManifestError(f"{what}: {key}: chunk {short(c, 120)} is not a chunk of a "
                                    f"{len(item.size)}-d tensor")
    for index, info in md.storage_data.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or \
                not (index.offset is None or _is_size(index.offset)):
            raise ManifestError(f"{what}: storage_data key {short(index, 120)} is not a MetadataIndex")
        if type(info) is not StorageInfo or type(info.offset) is not int or \
                type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise ManifestError(f"{what}: storage_data[{index.fqn}] is not (relative_path, offset, "
                                f"length): {short(info, 120)}")
        if info.transform_descriptors:
            raise ManifestError(f"{what}: storage_data[{index.fqn}] has transforms "
                                f"{short(info.transform_descriptors, 80)}; tenplex reads plain items only")


def _check_chunks(key: str, item: TensorStorageMetadata, what: str) -> None:
    """Chunks inside the tensor, disjoint, covering it: DCP leaves gaps as uninitialized memory."""
    shape = tuple(item.size)
    for c in item.chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
            raise ManifestError(f"{what}: {key}: chunk at {tuple(c.offsets)} of size {tuple(c.sizes)} "
                                f"lies outside the tensor {shape}")
    total = sum(math.prod(c.sizes) for c in item.chunks)
    if total != math.prod(shape):
        raise ManifestError(f"{what}: {key}: chunks hold {total} elements, the tensor {shape} has "
                            f"{math.prod(shape)} (a gap or an overlap)")
    chunks = [c for c in item.chunks if math.prod(c.sizes)]
    if len(chunks) < 2:
        return
    lo = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64)
    hi = lo + np.array([tuple(c.sizes) for c in chunks], dtype=np.int64)
    order = np.argsort(lo[:, 0], kind="stable")
    lo, hi = lo[order], hi[order]
    ends = np.searchsorted(lo[:, 0], hi[:, 0], side="left")  # chunks j < ends[i] start before i ends
    pairs = int(np.maximum(ends - np.arange(len(chunks)) - 1, 0).sum())
    if pairs > MAX_CHUNK_PAIRS:
        raise ManifestError(f"{what}: {key}: {len(chunks)} chunks whose first-axis ranges overlap "
                            f"{pairs} times (at most {MAX_CHUNK_PAIRS} are checked)")
    for i in range(len(chunks)):
        j = slice(i + 1, max(i + 1, int(ends[i])))
        hit = np.all(lo[j] < hi[i], axis=1) & np.all(lo[i] < hi[j], axis=1)
        if hit.any():
            k = i + 1 + int(np.argmax(hit))
            raise ManifestError(f"{what}: {key}: chunks at {tuple(lo[i].tolist())} and "
                                f"{tuple(lo[k].tolist())} overlap")


def _check_items(md: Metadata, root: str, what: str) -> None:
    """Every referenced item exists, fits in its file, and shares no byte with another."""
    files: dict[str, tuple[str, int]] = {}
    ranges: dict[str, list] = {}
    for index, info in md.storage_data.items():
        if info.relative_path not in files:
            files[info.relative_path] = item_file(root, info.relative_path)
        path, size = files[info.relative_path]
        if info.offset + info.length > size:
            raise CorruptShardError(f"{path} [{index.fqn}]: bytes [{info.offset}, "
                                    f"{info.offset + info.length}) lie past the end of the file "
                                    f"({size} bytes)")
        ranges.setdefault(path, []).append((info.offset, info.length, index.fqn))
    for path, items in ranges.items():
        items.sort()
        for (a, n, key), (b, _, other) in zip(items, items[1:]):
            if b < a + n:
                raise CorruptShardError(f"{path}: items {key} [{a}, {a + n}) and {other} (from {b}) "
                                        "share bytes")
    for key, item in md.state_dict_metadata.items():
        if type(item) is BytesStorageMetadata:
            info = md.storage_data.get(MetadataIndex(key))
            if info is None:
                raise ManifestError(f"{what}: byte object {key} has no storage item")
            if info.length > MAX_OBJECT_BYTES:
                raise CorruptShardError(f"{what}: byte object {key} is {info.length} bytes (at "
                                        f"most {MAX_OBJECT_BYTES})")
            continue
        itemsize = item.properties.dtype.itemsize
        for c in item.chunks:
            info = md.storage_data.get(MetadataIndex(key, c.offsets))
            if info is None:
                raise ManifestError(f"{what}: {key}: chunk at {tuple(c.offsets)} has no storage item")
            if math.prod(c.sizes) * itemsize > info.length:
                raise CorruptShardError(f"{what}: {key}: chunk at {tuple(c.offsets)} of size "
                                        f"{tuple(c.sizes)} needs {math.prod(c.sizes) * itemsize} "
                                        f"bytes, its item has {info.length}")


def _check_tensor_items(md: Metadata, root: str) -> dict[MetadataIndex, TensorRef]:
    per_file: dict[str, list] = {}
    refs = {}
    for key, item in md.state_dict_metadata.items():
        if type(item) is TensorStorageMetadata:
            for c in item.chunks:
                info = md.storage_data[MetadataIndex(key, c.offsets)]
                per_file.setdefault(info.relative_path, []).append((key, item, c, info))
    for relative_path, items in per_file.items():
        path, _ = item_file(root, relative_path)
        f, _ = open_regular(path, path)
        with f:
            for key, item, c, info in sorted(items, key=lambda x: x[3].offset):
                what = f"{path} [{key} at {tuple(c.offsets)}]"
                # unbuffered (f.raw): read only the header bytes, not 8 KiB of read-ahead per item
                header = tensor_header(FileView(f.raw, info.offset, info.length), what, locate=True)
                dtype, shape = header[:2]
                if shape != tuple(c.sizes) or dtype != item.properties.dtype:
                    raise CorruptShardError(f"{what}: the item holds a {shape} {dtype} tensor, the "
                                            f"metadata says {tuple(c.sizes)} {item.properties.dtype}")
                refs[MetadataIndex(key, c.offsets)] = tensor_ref(path, info.offset, info.length, header, what)
    return refs


def check_metadata(md: Metadata, root: str, what: str) -> dict[MetadataIndex, TensorRef]:
    """Check unpickled DCP metadata against the files in ``root`` (see the module docstring).

    Returns:
        Where each tensor item's data lies: ``{MetadataIndex(key, chunk offsets): TensorRef}``
        (found while checking its header, so a reader never parses it again).

    Raises:
        ManifestError: wrong field types, transforms, chunks outside their
            tensor, overlapping or leaving a gap, an item that is missing.
        PathError: a ``relative_path`` that is not a file name inside ``root``.
        CorruptShardError: an item past its file's end, items sharing bytes, an
            item shorter than its chunk, a tensor item of another shape or dtype,
            or a byte object over :data:`MAX_OBJECT_BYTES`.
        UnsafePickleError: a tensor item whose pickle the tensor allow-list refuses.
        ManifestError: also a tensor item that is not row-major or lies outside its blob.
    """
    _check_types(md, what)
    for key, item in md.state_dict_metadata.items():
        if type(item) is TensorStorageMetadata:
            _check_chunks(key, item, what)
    _check_items(md, root, what)
    return _check_tensor_items(md, root)
