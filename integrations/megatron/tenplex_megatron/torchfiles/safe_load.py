"""Load Megatron ``.pt`` files without running code from them.

``model_optim_rng.pt``, ``distrib_optim.pt`` and ``common.pt`` are
``torch.save`` zip archives: a pickle (``data.pkl``) plus one record per
tensor storage. Every file goes through two gates:

1. **Validation.** The archive is opened with torch's own zip reader, every
   record tenplex reads is at most the file's size, and ``data.pkl`` is
   interpreted by :mod:`tenplex_megatron.torchfiles.restricted_unpickler` under the
   allow-list :data:`TORCH_GLOBALS`: exact ``(module, name)`` pairs, each
   with the one call shape it is allowed (argument types and values
   checked). Each storage a tensor names must be a record of exactly
   ``numel * itemsize`` bytes, and each tensor must lie inside its storage.
2. **Loading.** ``torch.load(weights_only=True)`` then loads the validated
   file, with :data:`TORCH_SAFE_GLOBALS` (the same globals) added to torch's
   own weights-only allow-list, optionally memory-mapped (``mmap=True``).

Legacy (pre-zip) ``torch.save`` files and TorchScript archives are refused.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import threading
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from tenplex.errors import CorruptShardError, TenplexError, UnsafePickleError
from tenplex.limits import SAFE_REPR, short
from tenplex.ptree.tree import DTYPES
from tenplex.store.paths import open_regular, regular_size as regular_file_size  # the one path rule

from tenplex_megatron.torchfiles.restricted_unpickler import MAX_PICKLE_BYTES, Profile, Refused, Rule, unpickle
from tenplex_megatron.torchfiles.ziprecords import check_stored, record_sizes

__all__ = ["safe_load", "load_tensor", "tensor_header", "load_meta", "FileView", "TORCH_GLOBALS",
           "TORCH_SAFE_GLOBALS", "MAX_NDIM", "TORCH_DTYPES", "regular_file_size", "open_regular"]

MAX_NDIM = 32
"""The most dimensions a tensor or array may claim."""

TORCH_DTYPES = {**DTYPES, **{name: getattr(torch, name) for name in (
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
    if isinstance(getattr(torch, name, None), torch.dtype)}}
"""``torch.<name>`` dtypes a file may name, as values (they cannot be called): the one dtype table of
tenplex_megatron, core's :data:`tenplex.ptree.tree.DTYPES` plus what files may also hold."""

_NP_CODES = ("u4",)  # np.random.get_state()'s MT19937 key: the only NumPy array in a Megatron file
_STORAGE_TYPES = {  # torch.save names a storage's dtype by its legacy storage class
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128}


class _StorageType:
    """What ``GLOBAL torch.FloatStorage`` pushes: only a dtype, for persistent ids."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Storage:
    def __init__(self, dtype: torch.dtype, numel: int, record: str = "", offset: int = 0):
        self.dtype, self.numel, self.record, self.offset = dtype, numel, record, offset


class _Tensor:
    def __init__(self, dtype: torch.dtype, shape: tuple, storage: _Storage, offset: int, stride: tuple):
        self.dtype, self.shape, self.storage, self.offset, self.stride = dtype, shape, storage, offset, stride


class _NpDtype:
    def __init__(self, code: str):
        self.code, self.itemsize = code, int(code[1:])


class _NpArray:
    pass


class _ValueOnly:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


SAFE_REPR.update({_ValueOnly, torch.dtype, torch.layout, torch.memory_format})
_NDARRAY = _ValueOnly("numpy.ndarray")  # what GLOBAL numpy.ndarray pushes: only _reconstruct takes it


def _ints(value: Any, what: str, low: int = 0) -> tuple:
    if type(value) not in (tuple, list) or len(value) > MAX_NDIM:
        raise Refused(f"{what} must be a tuple of at most {MAX_NDIM} ints, got {short(value, 80)}")
    if not all(type(v) is int and low <= v < 1 << 62 for v in value):
        raise Refused(f"{what} must hold ints in [{low}, 2**62), got {short(value, 80)}")
    return tuple(value)


def _rebuild_tensor(args: tuple) -> _Tensor:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])``."""
    if len(args) not in (6, 7):
        raise Refused(f"{len(args)} arguments (expected 6 or 7)")
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if not isinstance(storage, _Storage):
        raise Refused(f"the storage is a {type(storage).__name__}, not a storage record")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or type(offset) is not int or offset < 0:
        raise Refused(f"size {size}, stride {stride}, offset {short(offset, 40)} do not fit together")
    if type(requires_grad) is not bool or type(hooks) is not OrderedDict or hooks:
        raise Refused("requires_grad must be a bool and backward hooks an empty OrderedDict")
    if len(args) == 7 and args[6] not in (None, {}):
        raise Refused("tensor metadata must be empty")
    end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if math.prod(size) else offset
    if end > storage.numel:
        raise Refused(f"a tensor of size {size}, stride {stride}, offset {offset} reaches element "
                      f"{end} of a storage of {storage.numel} elements")
    if not _distinct(size, stride):
        raise Refused(f"a tensor of size {size}, stride {stride} is an expanded or overlapping view "
                      "(elements share storage); tenplex reads tensors whose elements are distinct")
    return _Tensor(storage.dtype, size, storage, offset, stride)


def _distinct(size: tuple, stride: tuple) -> bool:
    """Whether a view's elements lie at distinct storage positions: sorted by stride, each axis
    steps past everything the axes before it span (a stride-0 axis of length > 1 never does)."""
    extent = 1
    for n, s in sorted(((n, s) for n, s in zip(size, stride) if n > 1), key=lambda p: p[1]):
        if s < extent:
            return False
        extent = s * (n - 1) + extent
    return True


def _ordered_dict(args: tuple) -> OrderedDict:
    if args != ():
        raise Refused("OrderedDict is built empty, then filled")
    return OrderedDict()


def _build_ordered_dict(inst: OrderedDict, state: Any) -> None:
    """``torch.nn.Module.state_dict`` keeps ``_metadata`` (versions per module) as an attribute."""
    if type(state) is not dict or set(state) - {"_metadata"} or \
            type(state.get("_metadata", {})) not in (dict, OrderedDict):
        raise Refused(f"only a _metadata dict may be set, got {short(state, 80)}")


def _namespace(args: tuple) -> argparse.Namespace:
    if args != ():
        raise Refused("Namespace is created empty, then given its fields")
    return argparse.Namespace()


def _build_namespace(inst: argparse.Namespace, state: Any) -> None:
    if type(state) is not dict:
        raise Refused(f"the state is a {type(state).__name__}, not a dict of fields")
    bad = [k for k in state if type(k) is not str or not k.isidentifier() or k.startswith("__")]
    if bad:
        raise Refused(f"field name {short(bad[0], 60)} (expected identifiers, no dunder names)")
    for k, v in state.items():  # plain identifiers; read back by ptfile to pair tensors with records
        setattr(inst, k, v)


def _encode(args: tuple) -> bytes:
    """Protocol 2 writes ``bytes`` as ``_codecs.encode(text, "latin1")``."""
    if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
        raise Refused(f"only encode(str, 'latin1') is allowed, got {short(args, 80)}")
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:
        raise Refused("text outside latin-1") from None


def _np_dtype(args: tuple) -> _NpDtype:
    if args not in tuple((code, False, True) for code in _NP_CODES):
        raise Refused(f"only numpy.dtype(code, False, True) with a code in {_NP_CODES}, got {short(args, 80)}")
    return _NpDtype(args[0])


def _build_np_dtype(inst: _NpDtype, state: Any) -> None:
    order = "|" if inst.itemsize == 1 else "<>="
    if type(state) is not tuple or len(state) != 8 or state[0] != 3 or state[1] not in order or \
            state[2:] != (None, None, None, -1, -1, 0):
        raise Refused(f"a plain {inst.code} dtype state is (3, byteorder, None, None, None, -1, -1, 0), "
                      f"got {short(state, 80)}")


def _reconstruct(args: tuple) -> _NpArray:
    if len(args) != 3 or args[0] is not _NDARRAY or args[1] != (0,) or args[2] != b"b":
        raise Refused(f"only _reconstruct(numpy.ndarray, (0,), b'b') is allowed, got {short(args, 80)}")
    return _NpArray()


def _build_np_array(inst: _NpArray, state: Any) -> None:
    if type(state) is not tuple or len(state) != 5 or state[0] != 1:
        raise Refused(f"an array state is (1, shape, dtype, fortran, bytes), got {short(state, 80)}")
    _, shape, dtype, fortran, raw = state
    shape = _ints(shape, "shape")
    if not isinstance(dtype, _NpDtype) or type(fortran) is not bool or type(raw) is not bytes:
        raise Refused("an array needs a plain dtype, a bool and raw bytes (no object arrays)")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise Refused(f"{len(raw)} bytes of data for shape {shape} of {dtype.code}")


def _rules(*rules: Rule) -> dict:
    return {(r.module, r.name): r for r in rules}


_TENSOR_RULES = _rules(
    Rule("torch._utils", "_rebuild_tensor_v2", reduce=_rebuild_tensor,
         reason="every tensor: a view (offset, size, stride) of a storage record"),
    Rule("collections", "OrderedDict", reduce=_ordered_dict,
         reason="state dicts, and the (empty) backward hooks of every tensor"),
    *(Rule("torch", name, value=_StorageType(dtype),
           reason="the dtype of a storage record, in its persistent id")
      for name, dtype in _STORAGE_TYPES.items()),
    *(Rule("torch", name, value=dtype, reason="a dtype value (args.params_dtype)")
      for name, dtype in TORCH_DTYPES.items()),
)

TORCH_GLOBALS = {
    **_TENSOR_RULES,
    **_rules(
        Rule("argparse", "Namespace", new=_namespace,
             reason="Megatron-LM's args; created empty, then given identifier fields once"),
        Rule("_codecs", "encode", reduce=_encode,
             reason="protocol 2 bytes (the raw data of NumPy arrays)"),
        Rule("numpy", "dtype", reduce=_np_dtype,
             reason="dtype of a NumPy array in the RNG state (np.random.get_state: uint32)"),
        Rule("numpy", "ndarray", value=_NDARRAY,
             reason="only as _reconstruct's first argument"),
        *(Rule(module, "_reconstruct", reduce=_reconstruct,
               reason="NumPy arrays (numpy 2 and numpy 1.x module names), empty until BUILD")
          for module in ("numpy._core.multiarray", "numpy.core.multiarray")),
    ),
}
"""Every global a Megatron ``.pt`` file may name: ``{(module, name): Rule}``; each
rule's ``reason`` says what needs it."""

_OPCODES = frozenset({
    "PROTO", "STOP", "MARK", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "EMPTY_TUPLE",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT",
    "SETITEM", "SETITEMS", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",
    "BINFLOAT", "BINUNICODE", "GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "BINPERSID"})
_BUILDERS = {OrderedDict: _build_ordered_dict, argparse.Namespace: _build_namespace,
             _NpDtype: _build_np_dtype, _NpArray: _build_np_array}


def _np_globals() -> list:
    try:
        from numpy._core.multiarray import _reconstruct as reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct as reconstruct
    dtype_types = [type(np.dtype(code)) for code in _NP_CODES]
    return [argparse.Namespace, np.dtype, np.ndarray, *dtype_types,
            (reconstruct, "numpy._core.multiarray._reconstruct"),
            (reconstruct, "numpy.core.multiarray._reconstruct")]


TORCH_SAFE_GLOBALS = _np_globals()
"""What :func:`safe_load` adds to torch's weights-only allow-list while it loads: the
non-torch globals of :data:`TORCH_GLOBALS` (and NumPy's dtype classes, which
torch's ``BUILD`` checks by type)."""

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


def _validate(f, size: int, what: str, rules: dict) -> Any:
    """Interpret ``f``'s ``data.pkl`` under ``rules`` (storages carry their record's offset in ``f``)."""
    start = f.tell()
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
