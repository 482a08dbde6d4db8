"""Load Megatron ``.pt`` files without running code from them.

``model_optim_rng.pt``, ``distrib_optim.pt`` and ``common.pt`` are
``torch.save`` zip archives: a pickle (``data.pkl``) plus one record per
tensor storage. Every file goes through two gates:

1. **Validation.** The archive is opened with torch's own zip reader, every
   record tenplex reads is at most the file's size, and ``data.pkl`` is
   interpreted by :mod:`tenplex_megatron.torchfiles.restricted_unpickler` under the
   allow-list :data:`~tenplex_megatron.torchfiles.torch_rules.TORCH_GLOBALS`: exact ``(module, name)`` pairs, each
   with the one call shape it is allowed (argument types and values
   checked). Each storage a tensor names must be a record of exactly
   ``numel * itemsize`` bytes, and each tensor must lie inside its storage.
2. **Loading.** ``torch.load(weights_only=True)`` then loads the validated
   file, with :data:`TORCH_SAFE_GLOBALS` (the same globals) added to torch's
   own weights-only allow-list, optionally memory-mapped (``mmap=True``).

Legacy (pre-zip) ``torch.save`` files and TorchScript archives are refused.
"""

from __future__ import annotations

import io
import os
import re
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch

from tenplex.errors import CorruptShardError, TenplexError, UnsafePickleError
from tenplex.limits import short
from tenplex.store.paths import open_regular, regular_size as regular_file_size  # the one path rule

from tenplex_megatron.torchfiles.restricted_unpickler import MAX_PICKLE_BYTES, Profile, Refused, unpickle
from tenplex_megatron.torchfiles.torch_rules import (_BUILDERS, _OPCODES, _TENSOR_RULES, MAX_NDIM, TORCH_DTYPES,
                                                     TORCH_GLOBALS, TORCH_SAFE_GLOBALS, _NpArray, _NpDtype,
                                                     _Storage, _StorageType, _Tensor)
from tenplex_megatron.torchfiles.ziprecords import check_stored, record_sizes

__all__ = ["safe_load", "load_tensor", "tensor_header", "load_meta", "FileView", "TORCH_GLOBALS",
           "TORCH_SAFE_GLOBALS", "MAX_NDIM", "TORCH_DTYPES", "regular_file_size", "open_regular"]


_globals_lock = threading.Lock()
_globals_users = 0


class _torch_globals:
    """``torch.serialization.safe_globals``, reference-counted so that concurrent loads
    in threads do not remove the globals from under each other."""

    def __enter__(self):
        global _globals_users
        with _globals_lock:
            if _globals_users == 0:
                torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
            _globals_users += 1

    def __exit__(self, *exc):
        global _globals_users
        with _globals_lock:
            _globals_users -= 1
            if _globals_users == 0:
                from torch._weights_only_unpickler import _remove_safe_globals
                _remove_safe_globals(TORCH_SAFE_GLOBALS)


class FileView(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open binary file, as a seekable file of its own."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _stream_size(f) -> int:
    here = f.tell()
    size = f.seek(0, io.SEEK_END)
    f.seek(here)
    return size


LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
"""The first bytes of a ``torch.save`` file in the format before torch 1.6 (or saved with
``_use_new_zipfile_serialization=False``): the pickled magic number 0x1950a86a20f9469cfc6c
(``torch/serialization.py``, ``MAGIC_NUMBER``)."""


def _validate(f, size: int, what: str, rules: dict) -> Any:
    """Interpret ``f``'s ``data.pkl`` under ``rules`` (storages carry their record's offset in ``f``)."""
    start = f.tell()
    if f.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
        raise CorruptShardError(f"{what}: a torch.save file in the format before torch 1.6 "
                                "(_use_new_zipfile_serialization=False); tenplex reads the zip format only: "
                                "load it and torch.save it again with torch >= 1.6, where you trust the file")
    f.seek(start)
    try:
        archive = torch._C.PyTorchFileReader(f)
        return _validate_archive(archive, f, start, size, what, rules)
    except (RuntimeError, OSError, ValueError) as exc:  # torch's zip reader: a cut or corrupt archive
        if isinstance(exc, TenplexError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CorruptShardError(f"{what}: not a torch zip archive ({first}); tenplex "
                                "reads torch.save's zip format only") from None


def _validate_archive(archive, f, start: int, size: int, what: str, rules: dict) -> Any:
    if archive.has_record("constants.pkl"):
        raise UnsafePickleError(f"{what}: refusing a TorchScript archive")
    if not archive.has_record("data.pkl"):
        raise CorruptShardError(f"{what}: the archive has no data.pkl")

    sizes = record_sizes(f, start, what)

    def record_size(name: str) -> int:
        n = sizes.get(name)
        if n is None:
            raise CorruptShardError(f"{what}: record {name} is not in the zip directory")
        if n > size:
            raise CorruptShardError(f"{what}: record {name} claims {n} bytes in a file of {size}")
        return n

    for name in archive.get_all_records():  # torch.load reads several; none may be a zip bomb
        record_size(name)
    if record_size("data.pkl") > MAX_PICKLE_BYTES:
        raise UnsafePickleError(f"{what}: data.pkl is larger than {MAX_PICKLE_BYTES} bytes")
    if archive.has_record("byteorder") and archive.get_record("byteorder") != b"little":
        raise CorruptShardError(f"{what}: record byteorder is {short(archive.get_record('byteorder'), 20)}; "
                                "tenplex reads little-endian tensor records in place")
    storages: dict[str, _Storage] = {}

    def persistent_load(pid: Any) -> _Storage:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Refused("expected ('storage', type, key, location, numel)")
        _, kind, key, location, numel = pid
        if not isinstance(kind, _StorageType) or type(key) is not str or not key.isdigit() or \
                type(location) is not str or not re.fullmatch(r"[a-z]+(:\d+)?", location) or \
                type(numel) is not int or numel < 0:
            raise Refused("expected a storage type, a numeric key, a device and a count")
        name = f"data/{key}"
        if key in storages:
            if (storages[key].dtype, storages[key].numel) != (kind.dtype, numel):
                raise Refused(f"storage {key} is named twice with different types or sizes")
            return storages[key]
        if not archive.has_record(name):
            raise Refused(f"record {name} does not exist")
        nbytes = numel * kind.dtype.itemsize
        if record_size(name) != nbytes:
            raise Refused(f"record {name} holds {record_size(name)} bytes, "
                          f"{numel} x {kind.dtype} needs {nbytes}")
        storages[key] = _Storage(kind.dtype, numel, name, archive.get_record_offset(name))
        return storages[key]

    profile = Profile("torch file", rules, builders=_BUILDERS,
                      must_build=(_NpDtype, _NpArray), opcodes=_OPCODES,
                      persistent_load=persistent_load, dict_types=(dict, OrderedDict))
    result = unpickle(archive.get_record("data.pkl"), profile, what)
    check_stored(f, start, {s.record: (s.offset, s.numel * s.dtype.itemsize) for s in storages.values()}, what)
    f.seek(start)
    return result


def _torch_load(source, what: str, mmap: bool, device: str = "cpu") -> Any:
    try:
        with _torch_globals(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's warning on pickle protocols other than 2
            return torch.load(source, map_location=device, weights_only=True, mmap=mmap)
    except Exception as exc:  # validated, so any failure here is a file torch reads differently
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise UnsafePickleError(f"{what}: refusing unsafe unpickling (torch.load refused a file "
                                f"tenplex had validated: {type(exc).__name__}: {first})") from None


def safe_load(path, what: str | None = None, *, mmap: bool = False) -> Any:
    """Load a Megatron ``.pt`` file with nothing but :data:`TORCH_GLOBALS`.

    Args:
        path: a file path, or a seekable binary file object (an in-memory
            ``io.BytesIO`` holding a whole ``torch.save`` archive).
        what: how to name the file in errors (default: ``path``).
        mmap: memory-map the tensor storages instead of reading them
            (``torch.load(mmap=True)``); needs a path.

    Returns:
        What ``torch.load`` returns: dicts, lists, tensors, ``argparse.Namespace``
        and NumPy arrays.

    Raises:
        UnsafePickleError (a ManifestError): a global outside the allow-list,
            a call, state or opcode it refuses, or a truncated pickle, naming the
            file, the byte offset and the global or field.
        CorruptShardError: the file is missing, not a regular file, not a torch
            zip archive, or a record is larger than the file.
        ValueError: ``mmap=True`` with a file object.
    """
    what = what or str(path)
    if isinstance(path, (str, os.PathLike)):
        f, size = open_regular(os.fspath(path), what)
        with f:
            _validate(f, size, what, TORCH_GLOBALS)
            return _torch_load(os.fspath(path) if mmap else f, what, mmap)
    if mmap:
        raise ValueError(f"{what}: mmap=True needs a file path, not a file object")
    _validate(path, _stream_size(path), what, TORCH_GLOBALS)
    return _torch_load(path, what, False)


def load_meta(f, what: str) -> tuple[Any, Any]:
    """:func:`safe_load` of the seekable file ``f`` with every tensor on the ``meta`` device
    (no tensor byte is read), beside what the restricted unpickler built from the same pickle.

    Returns:
        ``(obj, shadow)``: ``obj`` as ``torch.load(map_location="meta")`` returns it; ``shadow``
        the same structure where each tensor is a checked view whose storage carries the real
        offset of its record (from the zip's own headers, see
        :mod:`~tenplex_megatron.torchfiles.ziprecords`). torch's computed ``_checkpoint_offset``
        assumes torch's own writer's layout and is wrong for a re-zipped file: use the shadow.

    Raises:
        UnsafePickleError, CorruptShardError: as :func:`safe_load`.
    """
    shadow = _validate(f, _stream_size(f), what, TORCH_GLOBALS)
    return _torch_load(f, what, False, "meta"), shadow


def tensor_header(f, what: str, *, locate: bool = False) -> tuple:
    """The dtype and shape of the one tensor saved alone with ``torch.save`` (a DCP item)
    in the seekable file ``f``, checked without reading its data; with ``locate``, also its
    strides and the offset in ``f`` of its first byte (its storage record's offset from
    torch's zip reader, as ``torch.load(mmap=True)`` finds it): no ``torch.load`` runs.

    Only the tensor globals are allowed (no args, no NumPy).

    Raises:
        UnsafePickleError: as :func:`safe_load`, or the file holds something other than a tensor.
        CorruptShardError: as :func:`safe_load`.
    """
    obj = _validate(f, _stream_size(f), what, _TENSOR_RULES)
    if not isinstance(obj, _Tensor):
        raise UnsafePickleError(f"{what}: refusing unsafe unpickling (a tensor item holds a "
                                f"{type(obj).__name__}, not a tensor)")
    where = (obj.stride, obj.storage.offset + obj.offset * obj.dtype.itemsize) if locate else ()
    return (obj.dtype, obj.shape, *where)


def load_tensor(f, what: str) -> torch.Tensor:
    """Load the tensor that :func:`tensor_header` checks, from the seekable file ``f``.

    Raises:
        UnsafePickleError, CorruptShardError: as :func:`tensor_header`.
    """
    tensor_header(f, what)
    return _torch_load(f, what, False)
