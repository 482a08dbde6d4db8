"""A PyTorch DCP directory written item by item, the way DCP's own ``FileSystemWriter`` lays it out.

Each item (a tensor chunk, or a byte object) is appended to the open
``.distcp`` file as DCP's ``_write_item`` writes it: a tensor as a
``torch.save`` blob of a tensor with minimal storage, a byte object as its
bytes. Its byte range is recorded in ``Metadata.storage_data``
(``_StorageInfo(relative_path, offset, length)``), its box in
``state_dict_metadata``; :meth:`DcpWriter.finish` pickles the
``Metadata`` to ``.metadata`` as ``FileSystemWriter.finish`` does. Only the
item being written is in memory.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from tenplex.errors import ShardError

__all__ = ["DcpWriter"]


class DcpWriter:
    """Writes a DCP directory's ``.distcp`` files and ``.metadata`` into ``root``.

    Args:
        root: an existing, empty directory.

    Attributes:
        bytes_written: bytes written to ``.distcp`` files so far.
    """

    def __init__(self, root: str):
        self.root = root
        self.items: dict[str, Any] = {}
        self.storage: dict = {}
        self.bytes_written = 0
        self._file = None
        self._name = ""

    def open(self, name: str) -> None:
        """Start the ``.distcp`` file ``name`` (closing the current one)."""
        self.close()
        self._name = name
        self._file = open(os.path.join(self.root, name), "wb")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, write) -> tuple[int, int]:
        if self._file is None:
            raise ShardError(f"{self.root}: no .distcp file is open")
        start = self._file.tell()
        write(self._file)
        length = self._file.tell() - start
        self.bytes_written += length
        return start, length

    def tensor(self, key: str, size: tuple[int, ...], offsets: tuple[int, ...], data: torch.Tensor) -> None:
        """Append chunk ``data`` of global tensor ``key`` (global ``size``) at ``offsets``.

        Raises:
            ShardError: a chunk outside ``size``, or a dtype or size that differs
                from earlier chunks of ``key``.
        """
        if len(offsets) != len(size) or any(o < 0 or o + s > n for o, s, n in
                                            zip(offsets, data.shape, size)):
            raise ShardError(f"{key}: chunk at {list(offsets)} of {list(data.shape)} lies outside "
                             f"{list(size)}")
        item = self.items.get(key)
        if item is None:
            item = self.items[key] = TensorStorageMetadata(TensorProperties(dtype=data.dtype),
                                                           torch.Size(size), [])
        elif tuple(item.size) != tuple(size) or item.properties.dtype != data.dtype:
            raise ShardError(f"{key}: chunk of {list(size)} {data.dtype}; earlier chunks say "
                             f"{list(item.size)} {item.properties.dtype}")
        if data.untyped_storage().nbytes() != data.numel() * data.element_size() or not data.is_contiguous():
            data = data.clone(memory_format=torch.contiguous_format)
        start, length = self._append(lambda f: torch.save(data, f))
        item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(data.shape)))
        self.storage[MetadataIndex(key, offsets)] = _StorageInfo(self._name, start, length)

    def raw_tensor(self, key: str, size, dtype, offsets, sizes, blob) -> None:
        """Append an already serialized chunk (``blob``: bytes or a callable writing them)."""
        item = self.items.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                                torch.Size(size), []))
        start, length = self._append(blob if callable(blob) else (lambda f: f.write(blob)))
        item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        self.storage[MetadataIndex(key, offsets)] = _StorageInfo(self._name, start, length)

    def object(self, key: str, obj: Any = None, raw: bytes | None = None) -> None:
        """Append a byte object: ``obj`` serialized as megatron-core does (``torch.save``), or ``raw``."""
        if raw is None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            raw = buf.getvalue()
        start, length = self._append(lambda f: f.write(raw))
        self.items[key] = BytesStorageMetadata()
        self.storage[MetadataIndex(key)] = _StorageInfo(self._name, start, length)

    def to_json(self) -> dict:
        """The items and byte ranges written so far, as JSON (for a write in parts; see :meth:`add_json`).

        ``{"tensors": {key: [dtype, size, [[offsets, sizes], ...]]}, "objects": [key, ...],
        "storage": [[key, offsets | None, file, start, length], ...]}``.
        """
        tensors, objects = {}, []
        for key, item in self.items.items():
            if isinstance(item, TensorStorageMetadata):
                tensors[key] = [str(item.properties.dtype).removeprefix("torch."), list(item.size),
                                [[list(c.offsets), list(c.sizes)] for c in item.chunks]]
            else:
                objects.append(key)
        storage = [[i.fqn, None if i.offset is None else list(i.offset), s.relative_path, s.offset, s.length]
                   for i, s in self.storage.items()]
        return {"tensors": tensors, "objects": objects, "storage": storage}

    def add_json(self, part: dict) -> None:
        """Add another writer's :meth:`to_json` (a part written by another process).

        Raises:
            ShardError: a tensor whose dtype or size differs from the same key's in an
                earlier part, an unknown dtype, or an item recorded twice.
        """
        for key, (dtype, size, chunks) in part["tensors"].items():
            dt = getattr(torch, str(dtype), None)
            if not isinstance(dt, torch.dtype):
                raise ShardError(f"{key}: dtype {dtype!r} is not a torch dtype")
            item = self.items.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=dt),
                                                                    torch.Size(size), []))
            if not isinstance(item, TensorStorageMetadata) or tuple(item.size) != tuple(size) \
                    or item.properties.dtype != dt:
                raise ShardError(f"{key}: a part's chunks are {list(size)} {dt}; another part's item "
                                 f"says {getattr(item, 'size', 'bytes')}")
            item.chunks.extend(ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in chunks)
        for key in part["objects"]:
            if key in self.items:
                raise ShardError(f"{key}: object written by two parts")
            self.items[key] = BytesStorageMetadata()
        for key, offsets, name, start, length in part["storage"]:
            index = MetadataIndex(key) if offsets is None else MetadataIndex(key, torch.Size(offsets))
            if index in self.storage:
                raise ShardError(f"{key} at {offsets}: written by two parts")
            self.storage[index] = _StorageInfo(name, int(start), int(length))

    def finish(self) -> None:
        """Close the open file and write ``.metadata`` (DCP's ``Metadata``, pickled)."""
        self.close()
        md = Metadata(state_dict_metadata=self.items, planner_data=None, storage_data=self.storage,
                      version=CURRENT_DCP_VERSION)
        with open(os.path.join(self.root, ".metadata"), "wb") as f:
            pickle.dump(md, f)
