"""Read PyTorch DCP directories without arbitrary unpickling.

DCP's ``.metadata`` file is a pickle, and DCP's default loader unpickles
byte objects with ``weights_only=False``. tenplex reads the metadata with an
unpickler that allows only DCP's own metadata records (and torch sizes and
dtypes). It reads byte objects as raw bytes from their recorded file range,
then loads them through :func:`safe_load`'s allow-list. Tensors go through
DCP, which loads them with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from tenplex.errors import ManifestError

from tenplex_megatron.safe_load import safe_load

__all__ = ["SafeReader", "read_objects"]

_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                    "torch.distributed.checkpoint.filesystem"}
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        ok = (module in _ALLOWED_MODULES and not name.startswith("__")) or (module, name) in _ALLOWED \
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not ok:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ManifestError(f"{path}: DCP metadata is missing") from None
        except pickle.UnpicklingError as exc:
            raise ManifestError(f"{path}: refusing unsafe unpickling ({exc})") from None
        if not isinstance(md, Metadata):
            raise ManifestError(f"{path}: not DCP metadata ({type(md).__name__})")
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


def read_objects(root: str, md: Metadata, prefix: str = "") -> dict:
    """The byte objects under ``prefix``, each loaded with :func:`safe_load`."""
    out = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata) or not key.startswith(prefix):
            continue
        info = md.storage_data[MetadataIndex(key)]
        with open(os.path.join(root, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        out[key] = safe_load(io.BytesIO(data), f"{root}/{info.relative_path} [{key}]")
    return out
