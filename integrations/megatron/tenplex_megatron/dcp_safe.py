"""Read PyTorch DCP directories without arbitrary unpickling.

DCP's ``.metadata`` file is a pickle (protocol 4), and DCP's own reader
loads it with ``pickle.load``, which runs whatever the file names. tenplex
interprets it with :mod:`tenplex_megatron.restricted_unpickler` under
:data:`ALLOWED_GLOBALS`: the exact ``(module, name)`` pairs of the records
that torch 2.13's ``FileSystemWriter`` and megatron-core 0.16.1 write
(found by unpickling real ``.metadata`` files), each created empty by
``NEWOBJ`` and given its fields once by ``BUILD``, plus ``torch.Size``,
``torch.serialization._get_layout``, two enums and the torch dtypes, each
called only with the arguments it takes.

The result is then checked (:func:`tenplex_megatron.dcp_checks.check_metadata`):
every field's type; every ``relative_path`` a plain file name in the
checkpoint directory that does not resolve outside it; every item's bytes
inside its file and not shared with another item; every tensor's chunks
inside the tensor, disjoint, and covering it whole. Tensor items are loaded
through :func:`tenplex_megatron.safe_load.load_tensor` (tensor globals only)
and must have the shape and dtype their chunk records; byte objects are read
by :func:`read_objects` and loaded through
:func:`tenplex_megatron.safe_load.safe_load`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata,
                                                   ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.futures import Future

from tenplex.errors import CorruptShardError, ManifestError, UnsafePickleError

from tenplex_megatron.dcp_checks import MAX_OBJECT_BYTES, check_metadata, item_file
from tenplex_megatron.restricted_unpickler import MAX_PICKLE_BYTES, Profile, Refused, Rule, unpickle
from tenplex_megatron.safe_load import (MAX_NDIM, TORCH_DTYPES, FileView, load_tensor,
                                        open_regular, safe_load)

__all__ = ["SafeReader", "read_objects", "read_metadata", "ALLOWED_GLOBALS"]

_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_EXTRA = {Metadata: {"all_local_plans", "mcore_data"}}  # set on Metadata by megatron-core; dropped
_MEMORY_FORMATS = {_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                   _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
                   _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format}


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
        raise Refused(f"field {unknown[0]!r:.60} is not one of {sorted(fields)}")
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
                      f"{state!r:.80}")
    dtype, layout, requires_grad, encoding, pin = state
    if dtype not in TORCH_DTYPES.values() or layout is not torch.strided or \
            type(requires_grad) is not bool or encoding not in _MEMORY_FORMATS or type(pin) is not bool:
        raise Refused(f"expected a dtype, torch.strided, a bool, a memory format and a bool, got {state!r:.80}")
    for name, value in (("dtype", dtype), ("layout", layout), ("requires_grad", requires_grad),
                        ("memory_format", _MEMORY_FORMATS[encoding]), ("pin_memory", pin)):
        object.__setattr__(inst, name, value)


def _size(args: tuple) -> torch.Size:
    if len(args) != 1 or type(args[0]) is not tuple or len(args[0]) > MAX_NDIM or \
            not all(type(n) is int and 0 <= n < 1 << 62 for n in args[0]):
        raise Refused(f"torch.Size takes one tuple of at most {MAX_NDIM} ints in [0, 2**62), "
                      f"got {args!r:.80}")
    return torch.Size(args[0])


def _layout(args: tuple) -> torch.layout:
    if args != ("torch.strided",):
        raise Refused(f"only _get_layout('torch.strided') is allowed, got {args!r:.80}")
    return torch.strided


def _enum(cls: type):
    members = {m.value: m for m in cls}

    def reduce(args: tuple) -> Any:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in members:
            raise Refused(f"{cls.__name__} takes one of {sorted(members)}, got {args!r:.80}")
        return members[args[0]]
    return reduce


_RECORDS = (Metadata, TensorStorageMetadata, ChunkStorageMetadata, BytesStorageMetadata,
            MetadataIndex, StorageMeta, _StorageInfo, SavePlan, WriteItem, TensorWriteData)
_RECORD_WHY = {
    Metadata: "the file's root record", TensorStorageMetadata: "a tensor's dtype, size and chunks",
    ChunkStorageMetadata: "one chunk of a tensor", BytesStorageMetadata: "a byte object (common state)",
    MetadataIndex: "the key of storage_data", StorageMeta: "save ids (ignored)",
    _StorageInfo: "where an item's bytes are (file, offset, length)",
    SavePlan: "megatron-core's all_local_plans (dropped)", WriteItem: "inside all_local_plans",
    TensorWriteData: "inside all_local_plans"}

ALLOWED_GLOBALS = {(r.module, r.name): r for r in (
    *(Rule(cls.__module__, cls.__name__, new=_new_record(cls), reason=_RECORD_WHY[cls])
      for cls in _RECORDS),
    Rule(_METADATA, "TensorProperties", new=_new_record(TensorProperties),
         reason="a tensor's dtype and layout (state is a 5-tuple)"),
    Rule(_METADATA, "_MEM_FORMAT_ENCODING", reduce=_enum(_MEM_FORMAT_ENCODING),
         reason="TensorProperties' memory format"),
    Rule(_PLANNER, "WriteItemType", reduce=_enum(WriteItemType), reason="inside all_local_plans"),
    Rule("torch", "Size", reduce=_size, reason="tensor sizes and chunk offsets"),
    Rule("torch.serialization", "_get_layout", reduce=_layout, reason="TensorProperties' layout"),
    *(Rule("torch", name, value=dtype, reason="TensorProperties' dtype")
      for name, dtype in TORCH_DTYPES.items()),
)}
"""Every global a DCP ``.metadata`` file may name: ``{(module, name): Rule}``."""

_PROFILE = Profile(
    "DCP metadata", ALLOWED_GLOBALS,
    builders={**{cls: _build_record for cls in _RECORDS}, TensorProperties: _build_properties},
    must_build=(*(cls for cls in _RECORDS if dataclasses.fields(cls)), TensorProperties),
    opcodes=frozenset({
        "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
        "LONG_BINGET", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND",
        "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
        "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
        "SHORT_BINBYTES", "BINBYTES", "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}))


def read_metadata(root: str) -> Metadata:
    """Read and check ``root/.metadata``.

    Raises:
        UnsafePickleError: the pickle names or does what the allow-list refuses.
        ManifestError: the file is missing, or its records are inconsistent
            (wrong types, chunks that overlap or leave a gap, a missing item).
        PathError: a ``relative_path`` that is not a file name inside ``root``.
        CorruptShardError: an item's bytes lie past its file's end, overlap
            another item's, or are longer than the stated maxima.
    """
    path = os.path.join(root, ".metadata")
    if not os.path.lexists(path):
        raise ManifestError(f"{path}: DCP metadata is missing")
    f, size = open_regular(path, path)
    with f:
        if size > MAX_PICKLE_BYTES:
            raise UnsafePickleError(f"{path}: {size} bytes (at most {MAX_PICKLE_BYTES} are read)")
        data = f.read(size + 1)
    md = unpickle(data, _PROFILE, path)
    if type(md) is not Metadata:
        raise ManifestError(f"{path}: not DCP metadata (the pickle holds a {type(md).__name__})")
    for name in _EXTRA[Metadata]:
        md.__dict__.pop(name, None)
    check_metadata(md, root, path)
    if md.storage_meta is None:
        md.storage_meta = StorageMeta()
    return md


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles nothing outside the allow-lists.

    ``read_metadata`` is :func:`read_metadata` (checked once per reader, then
    cached). ``read_data`` loads each tensor item through
    :func:`~tenplex_megatron.safe_load.load_tensor` and checks its shape and
    dtype again; byte items are refused here (read them with
    :func:`read_objects`): DCP's planner would load them with
    ``weights_only=False``. Use :meth:`load` rather than ``dcp.load``: DCP
    wraps every error raised while reading in a ``CheckpointException``, a
    ``BaseException`` whose message is a traceback.
    """

    _metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(str(self.path))
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def load(self, state_dict: dict) -> None:
        """``dcp.load(state_dict)`` from this directory, in this process only.

        Raises:
            The tenplex error that stopped the read (see :func:`read_metadata`
            and ``read_data``), not DCP's ``CheckpointException``.
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            try:
                dcp.load(state_dict, storage_reader=self, no_dist=True)
            except CheckpointException as exc:
                for error, _ in exc.failures.values():
                    if isinstance(error, Exception):
                        raise error from None
                raise

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {MetadataIndex(fqn, c.offsets): (c.sizes, item.properties.dtype)
                        for fqn, item in metadata.state_dict_metadata.items()
                        if isinstance(item, TensorStorageMetadata) for c in item.chunks}

    def read_data(self, plan, planner) -> Future:
        root = str(self.path)
        per_file: dict[str, list] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise ManifestError(f"{root}: byte item {req.storage_index.fqn} requested through "
                                    "dcp.load; tenplex reads byte objects with read_objects")
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append((req, info))
        for relative_path, reqs in per_file.items():
            path, _ = item_file(root, relative_path)
            f, size = open_regular(path, path)
            with f:
                for req, info in reqs:
                    _load_item(f, path, size, req, info, self._chunks[req.storage_index], planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _load_item(f, path: str, size: int, req, info, chunk: tuple, planner) -> None:
    what = f"{path} [{req.storage_index.fqn}]"
    if info.offset + info.length > size:
        raise CorruptShardError(f"{what}: bytes [{info.offset}, {info.offset + info.length}) lie "
                                f"past the end of the file ({size} bytes)")
    tensor = load_tensor(FileView(f, info.offset, info.length), what)
    sizes, dtype = chunk
    if tuple(tensor.shape) != tuple(sizes) or tensor.dtype != dtype:
        raise CorruptShardError(f"{what}: the item holds a {tuple(tensor.shape)} {tensor.dtype} "
                                f"tensor, the metadata says {tuple(sizes)} {dtype}")
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
        tensor = tensor.narrow(dim, start, length)
    target = planner.resolve_tensor(req).detach()
    if target.shape != tensor.shape:
        raise CorruptShardError(f"{what}: a {tuple(tensor.shape)} region for a "
                                f"{tuple(target.shape)} destination")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


def read_objects(root: str, md: Metadata, prefix: str = "") -> dict:
    """The byte objects under ``prefix``, each loaded with :func:`safe_load`.

    Args:
        root: the DCP directory.
        md: its metadata, from :func:`read_metadata` (or ``SafeReader.read_metadata``).
        prefix: keep only keys that start with it.

    Returns:
        ``{key: object}``.

    Raises:
        ManifestError: a byte object without a storage record.
        PathError: its ``relative_path`` is not a file name inside ``root``.
        CorruptShardError: its bytes lie past the file's end, or it is longer
            than :data:`~tenplex_megatron.dcp_checks.MAX_OBJECT_BYTES`.
        UnsafePickleError: as :func:`safe_load`.
    """
    out = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata) or not key.startswith(prefix):
            continue
        info = md.storage_data.get(MetadataIndex(key)) if isinstance(md.storage_data, dict) else None
        if not isinstance(info, _StorageInfo):
            raise ManifestError(f"{root}/.metadata: byte object {key!r} has no storage record")
        path, size = item_file(root, info.relative_path)
        what = f"{path} [{key}]"
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or \
                info.length < 0 or info.offset + info.length > size:
            raise CorruptShardError(f"{what}: bytes at offset {info.offset!r:.30} length "
                                    f"{info.length!r:.30} lie outside the file ({size} bytes)")
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
