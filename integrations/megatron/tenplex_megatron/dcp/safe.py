"""Read PyTorch DCP metadata and byte objects without arbitrary unpickling.

DCP's ``.metadata`` file is a pickle (protocol 4), and DCP's own reader
loads it with ``pickle.load``, which runs whatever the file names. tenplex
interprets it with :mod:`tenplex_megatron.torchfiles.restricted_unpickler` under
:data:`DCP_GLOBALS`: the exact ``(module, name)`` pairs of the records
that torch 2.13's ``FileSystemWriter`` and megatron-core 0.13.1, 0.15.2, 0.16.1 and 0.19.2 write
(found by unpickling real ``.metadata`` files), each created empty by
``NEWOBJ`` and given its fields once by ``BUILD``, plus ``torch.Size``,
``torch.serialization._get_layout``, two enums and the torch dtypes, each
called only with the arguments it takes. Each record is built as tenplex's
copy of it (:mod:`tenplex_megatron.dcp.records`), so reading imports no DCP
module.

The result is then checked (:func:`tenplex_megatron.dcp.checks.check_metadata`):
every field's type; every ``relative_path`` a plain file name in the
checkpoint directory that does not resolve outside it; every item's bytes
inside its file and not shared with another item; every tensor's chunks
inside the tensor, disjoint, and covering it whole. Byte objects are read
by :func:`read_objects` and loaded through
:func:`tenplex_megatron.torchfiles.safe_load.safe_load`; tensor items through
:func:`tenplex_megatron.torchfiles.safe_load.load_tensor` (tensor globals only), by
tenplex's readers or by :class:`tenplex_megatron.dcp.load.SafeReader`.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch

from tenplex.errors import CorruptShardError, ManifestError, UnsafePickleError
from tenplex.limits import short

from tenplex_megatron.dcp.checks import MAX_OBJECT_BYTES, check_metadata, item_file
from tenplex_megatron.dcp.records import (TORCH_NAMES, BytesStorageMetadata, ChunkStorageMetadata,
                                          MemoryFormat, Metadata, MetadataIndex, SavePlan, StorageInfo,
                                          StorageMeta, TensorProperties, TensorStorageMetadata,
                                          TensorWriteData, WriteItem, WriteItemType)
from tenplex_megatron.torchfiles.restricted_unpickler import MAX_PICKLE_BYTES, Profile, Refused, Rule, unpickle
from tenplex_megatron.torchfiles.safe_load import MAX_NDIM, TORCH_DTYPES, open_regular, safe_load

__all__ = ["read_objects", "read_metadata", "read_checked", "DCP_GLOBALS"]

_EXTRA = {Metadata: {"all_local_plans", "mcore_data"},  # set on Metadata by megatron-core; dropped
          SavePlan: {"mcore_data"}}  # megatron-core 0.13 to 0.15's MCoreSavePlan; dropped
_MEMORY_FORMATS = {MemoryFormat.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                   MemoryFormat.TORCH_CHANNELS_LAST: torch.channels_last,
                   MemoryFormat.TORCH_PRESERVE_FORMAT: torch.preserve_format}


def _new_record(cls: type):
    def new(args: tuple) -> Any:
        if args != ():
            raise Refused(f"{cls.__name__} is created empty, then given its fields by BUILD")
        return object.__new__(cls)
    return new


def _build_record(inst: Any, state: Any) -> None:
    """Set a dataclass record's fields from a ``{field: value}`` state, once; fill defaults."""
    cls = type(inst)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if type(state) is not dict:
        raise Refused(f"the state is a {type(state).__name__}, not a dict of fields")
    extra = _EXTRA.get(cls, set())
    unknown = [k for k in state if k not in fields and k not in extra]
    if unknown:
        raise Refused(f"field {short(unknown[0], 60)} is not one of {sorted(fields)}")
    for name, f in fields.items():
        if name in state:
            value = state[name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise Refused(f"required field {name!r} is missing")
        object.__setattr__(inst, name, value)


def _build_properties(inst: TensorProperties, state: Any) -> None:
    """``TensorProperties.__getstate__`` writes ``(dtype, layout, requires_grad, memory format, pin_memory)``."""
    if type(state) is not tuple or len(state) != 5:
        raise Refused(f"the state is not (dtype, layout, requires_grad, memory format, pin_memory): "
                      f"{short(state, 80)}")
    dtype, layout, requires_grad, encoding, pin = state
    if dtype not in TORCH_DTYPES.values() or layout is not torch.strided or \
            type(requires_grad) is not bool or encoding not in _MEMORY_FORMATS or type(pin) is not bool:
        raise Refused(f"expected a dtype, torch.strided, a bool, a memory format and a bool, got {short(state, 80)}")
    for name, value in (("dtype", dtype), ("layout", layout), ("requires_grad", requires_grad),
                        ("memory_format", _MEMORY_FORMATS[encoding]), ("pin_memory", pin)):
        object.__setattr__(inst, name, value)


def _size(args: tuple) -> torch.Size:
    if len(args) != 1 or type(args[0]) is not tuple or len(args[0]) > MAX_NDIM or \
            not all(type(n) is int and 0 <= n < 1 << 62 for n in args[0]):
        raise Refused(f"torch.Size takes one tuple of at most {MAX_NDIM} ints in [0, 2**62), "
                      f"got {short(args, 80)}")
    return torch.Size(args[0])


def _layout(args: tuple) -> torch.layout:
    if args != ("torch.strided",):
        raise Refused(f"only _get_layout('torch.strided') is allowed, got {short(args, 80)}")
    return torch.strided


def _enum(cls: type):
    members = {m.value: m for m in cls}

    def reduce(args: tuple) -> Any:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in members:
            raise Refused(f"{cls.__name__} takes one of {sorted(members)}, got {short(args, 80)}")
        return members[args[0]]
    return reduce


_RECORDS = (Metadata, TensorStorageMetadata, ChunkStorageMetadata, BytesStorageMetadata,
            MetadataIndex, StorageMeta, StorageInfo, SavePlan, WriteItem, TensorWriteData)
_RECORD_WHY = {
    Metadata: "the file's root record", TensorStorageMetadata: "a tensor's dtype, size and chunks",
    ChunkStorageMetadata: "one chunk of a tensor", BytesStorageMetadata: "a byte object (common state)",
    MetadataIndex: "the key of storage_data", StorageMeta: "save ids (ignored)",
    StorageInfo: "where an item's bytes are (file, offset, length)",
    SavePlan: "megatron-core's all_local_plans (dropped)", WriteItem: "inside all_local_plans",
    TensorWriteData: "inside all_local_plans"}

DCP_GLOBALS = {(r.module, r.name): r for r in (
    *(Rule(*TORCH_NAMES[cls], new=_new_record(cls), reason=_RECORD_WHY[cls]) for cls in _RECORDS),
    Rule("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan", new=_new_record(SavePlan),
         reason="megatron-core 0.13 to 0.15's all_local_plans entries (a SavePlan and its mcore_data; dropped)"),
    Rule("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata", new=_new_record(Metadata),
         reason="megatron-core 0.15's root record (a Metadata and its mcore_data; dropped)"),
    Rule(*TORCH_NAMES[TensorProperties], new=_new_record(TensorProperties),
         reason="a tensor's dtype and layout (state is a 5-tuple)"),
    Rule(*TORCH_NAMES[MemoryFormat], reduce=_enum(MemoryFormat), reason="TensorProperties' memory format"),
    Rule(*TORCH_NAMES[WriteItemType], reduce=_enum(WriteItemType), reason="inside all_local_plans"),
    Rule("torch", "Size", reduce=_size, reason="tensor sizes and chunk offsets"),
    Rule("torch.serialization", "_get_layout", reduce=_layout, reason="TensorProperties' layout"),
    *(Rule("torch", name, value=dtype, reason="TensorProperties' dtype")
      for name, dtype in TORCH_DTYPES.items()),
)}
"""Every global a DCP ``.metadata`` file may name: ``{(module, name): Rule}``."""

_PROFILE = Profile(
    "DCP metadata", DCP_GLOBALS,
    builders={**{cls: _build_record for cls in _RECORDS}, TensorProperties: _build_properties},
    must_build=(*(cls for cls in _RECORDS if dataclasses.fields(cls)), TensorProperties),
    opcodes=frozenset({
        "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
        "LONG_BINGET", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND",
        "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
        "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
        "SHORT_BINBYTES", "BINBYTES", "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}))


def read_metadata(root: str) -> Metadata:
    """Read and check ``root/.metadata`` (:func:`read_checked` without the tensors' places)."""
    return read_checked(root)[0]


def read_checked(root: str) -> tuple[Metadata, dict]:
    """Read and check ``root/.metadata``.

    Returns:
        ``(metadata, refs)``: ``refs`` is where each tensor item's data lies,
        ``{MetadataIndex(key, chunk offsets): TensorRef}``
        (:func:`tenplex_megatron.dcp.checks.check_metadata`).

    Raises:
        UnsafePickleError: the pickle names or does what the allow-list refuses.
        ManifestError: the file is missing, or its records are inconsistent
            (wrong types, chunks that overlap or leave a gap, a missing item).
        PathError: a ``relative_path`` that is not a file name inside ``root``.
        CorruptShardError: an item's bytes lie past its file's end, overlap
            another item's, or are longer than the stated maxima; a tensor item
            of another shape or dtype than its chunk.
    """
    path = os.path.join(root, ".metadata")
    if not os.path.lexists(path):
        raise ManifestError(f"{path}: DCP metadata is missing")
    f, size = open_regular(path, path, root=root)
    with f:
        if size > MAX_PICKLE_BYTES:
            raise UnsafePickleError(f"{path}: {size} bytes (at most {MAX_PICKLE_BYTES} are read)")
        data = f.read(size + 1)
    md = unpickle(data, _PROFILE, path)
    if type(md) is not Metadata:
        raise ManifestError(f"{path}: not DCP metadata (the pickle holds a {type(md).__name__})")
    for name in _EXTRA[Metadata]:
        md.__dict__.pop(name, None)
    refs = check_metadata(md, root, path)
    if md.storage_meta is None:
        md.storage_meta = StorageMeta()
    return md, refs


def read_objects(root: str, md: Metadata, prefix: str = "") -> dict:
    """The byte objects under ``prefix``, each loaded with :func:`safe_load`.

    Args:
        root: the DCP directory.
        md: its metadata, from :func:`read_metadata`.
        prefix: keep only keys that start with it.

    Returns:
        ``{key: object}``.

    Raises:
        ManifestError: a byte object without a storage record.
        PathError: its ``relative_path`` is not a file name inside ``root``.
        CorruptShardError: its bytes lie past the file's end, or it is longer
            than :data:`~tenplex_megatron.dcp.checks.MAX_OBJECT_BYTES`.
        UnsafePickleError: as :func:`safe_load`.
    """
    out = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata) or not key.startswith(prefix):
            continue
        info = md.storage_data.get(MetadataIndex(key)) if isinstance(md.storage_data, dict) else None
        if not isinstance(info, StorageInfo):
            raise ManifestError(f"{root}/.metadata: byte object {short(key)} has no storage record")
        path, size = item_file(root, info.relative_path)
        what = f"{path} [{key}]"
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or \
                info.length < 0 or info.offset + info.length > size:
            raise CorruptShardError(f"{what}: bytes at offset {short(info.offset, 30)} length "
                                    f"{short(info.length, 30)} lie outside the file ({size} bytes)")
        if info.length > MAX_OBJECT_BYTES:
            raise CorruptShardError(f"{what}: a byte object of {info.length} bytes (at most "
                                    f"{MAX_OBJECT_BYTES})")
        f, _ = open_regular(path, path)
        with f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CorruptShardError(f"{what}: read {len(data)} of {info.length} bytes")
        out[key] = safe_load(io.BytesIO(data), what)
    return out
