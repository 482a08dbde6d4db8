"""tenplex's own copies of the records in a PyTorch DCP ``.metadata`` file.

DCP pickles its ``Metadata`` with the classes of
``torch.distributed.checkpoint.metadata``, ``.filesystem`` and ``.planner``
(torch 2.13). Importing those modules imports all of DCP and DTensor (about
0.6-0.9 s of a CLI run that only reads a checkpoint), so the allow-listed
unpickler (:mod:`tenplex_megatron.dcp.safe`) builds these plain records
instead, with the same field names, defaults and equality. :data:`TORCH_NAMES`
maps each to the ``(module, name)`` a file names it by.
:mod:`tenplex_megatron.dcp.load` turns them into torch's classes where DCP's
own ``dcp.load`` needs them; writers pickle torch's classes
(:mod:`tenplex_megatron.dcp.write`), so that DCP and megatron-core can read
what tenplex writes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
           "StorageMeta", "Metadata", "MetadataIndex", "StorageInfo", "TensorWriteData", "WriteItem",
           "SavePlan", "MemoryFormat", "WriteItemType", "TORCH_NAMES"]

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"


@dataclass
class ChunkStorageMetadata:
    """One stored chunk of a tensor: its ``offsets`` in the tensor and its ``sizes`` (elements)."""

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    """A tensor's dtype and layout (DCP pickles it as a 5-tuple: see ``dcp_safe``)."""

    dtype: torch.dtype = torch.float32
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False


@dataclass
class TensorStorageMetadata:
    """A tensor: ``size`` (elements per dimension) and the ``chunks`` it is stored in."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A byte object (a ``torch.save`` blob)."""


@dataclass
class StorageMeta:
    """Save and load ids (tenplex ignores them)."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """The root record: ``state_dict_metadata`` ``{key: tensor or bytes record}`` and
    ``storage_data`` ``{MetadataIndex: StorageInfo}``."""

    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """The key of ``storage_data``: a tensor chunk's ``(fqn, offset)`` or a byte object's ``fqn``.

    As in DCP, ``index`` (a hint) takes no part in equality or hashing, and
    ``offset`` is a ``torch.Size`` (which hashes and compares as a tuple).
    """

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset=None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "offset", None if offset is None else torch.Size(offset))
        object.__setattr__(self, "index", index)


@dataclass
class StorageInfo:
    """Where an item's bytes are: ``length`` bytes at ``offset`` of file ``relative_path``
    (DCP's ``_StorageInfo``)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclass
class TensorWriteData:
    """Inside megatron-core's ``all_local_plans`` (read, then dropped)."""

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass
class WriteItem:
    """Inside megatron-core's ``all_local_plans`` (read, then dropped)."""

    index: MetadataIndex
    type: Any
    bytes_io_data: Any = None
    tensor_data: TensorWriteData | None = None


@dataclass
class SavePlan:
    """megatron-core's ``all_local_plans`` entries (read, then dropped)."""

    items: list
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


class MemoryFormat(enum.Enum):
    """DCP's ``_MEM_FORMAT_ENCODING``: how ``TensorProperties`` pickles its memory format."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class WriteItemType(enum.Enum):
    """DCP's ``WriteItemType``."""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


TORCH_NAMES: dict[type, tuple[str, str]] = {
    ChunkStorageMetadata: (_METADATA, "ChunkStorageMetadata"),
    TensorProperties: (_METADATA, "TensorProperties"),
    TensorStorageMetadata: (_METADATA, "TensorStorageMetadata"),
    BytesStorageMetadata: (_METADATA, "BytesStorageMetadata"),
    StorageMeta: (_METADATA, "StorageMeta"),
    Metadata: (_METADATA, "Metadata"),
    MetadataIndex: (_METADATA, "MetadataIndex"),
    MemoryFormat: (_METADATA, "_MEM_FORMAT_ENCODING"),
    StorageInfo: (_FILESYSTEM, "_StorageInfo"),
    TensorWriteData: (_PLANNER, "TensorWriteData"),
    WriteItem: (_PLANNER, "WriteItem"),
    SavePlan: (_PLANNER, "SavePlan"),
    WriteItemType: (_PLANNER, "WriteItemType"),
}
"""Each record's ``(module, name)`` in torch 2.13, as a ``.metadata`` pickle names it."""
