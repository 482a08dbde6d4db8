"""DCP's own ``dcp.load`` from a checkpoint, through tenplex's allow-listed reads.

:class:`SafeReader` is a ``FileSystemReader`` whose metadata comes from
:func:`tenplex_megatron.dcp.safe.read_metadata` (converted to torch's record
classes by :func:`to_torch`, since DCP's planner uses them) and whose tensor
items are loaded by :func:`tenplex_megatron.torchfiles.safe_load.load_tensor`. This
module imports DCP (0.6-0.9 s of start-up); tenplex's own readers do not need it.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from tenplex.errors import CorruptShardError, ManifestError

from tenplex_megatron.dcp.checks import item_file
from tenplex_megatron.dcp.records import TORCH_NAMES
from tenplex_megatron.dcp.safe import read_metadata
from tenplex_megatron.torchfiles.safe_load import FileView, load_tensor, open_regular

__all__ = ["SafeReader", "to_torch"]


def to_torch(value: Any) -> Any:
    """``value`` with every :mod:`tenplex_megatron.dcp.records` record (in dicts and lists
    too) replaced by an equal instance of torch's class of the same name."""
    cls = type(value)
    if cls in TORCH_NAMES and dataclasses.is_dataclass(value):
        module, name = TORCH_NAMES[cls]
        torch_cls = getattr(importlib.import_module(module), name)
        return torch_cls(**{f.name: to_torch(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {to_torch(k): to_torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_torch(v) for v in value]
    return value


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles nothing outside the allow-lists.

    ``read_metadata`` is :func:`~tenplex_megatron.dcp.safe.read_metadata` as
    torch's records (checked once per reader, then cached). ``read_data`` loads each tensor item through
    :func:`~tenplex_megatron.torchfiles.safe_load.load_tensor` and checks its shape and
    dtype again; byte items are refused here (read them with
    :func:`~tenplex_megatron.dcp.safe.read_objects`): DCP's planner would load them with
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
            self._metadata = to_torch(read_metadata(str(self.path)))
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
