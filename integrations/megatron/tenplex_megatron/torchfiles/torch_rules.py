"""The allow-list of globals a ``torch.save`` file may name, and what a stream may do with each.

:data:`TORCH_GLOBALS` is checked by :mod:`tenplex_megatron.torchfiles.restricted_unpickler`
before :func:`tenplex_megatron.torchfiles.safe_load.safe_load` lets torch load a file:
exact ``(module, name)`` pairs, each with the one call shape it is allowed
(argument types and values checked), building inert records (``_Storage``,
``_Tensor``) instead of torch objects.
"""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from tenplex.limits import SAFE_REPR, short
from tenplex.ptree.tree import DTYPES

from tenplex_megatron.torchfiles.restricted_unpickler import Refused, Rule

__all__ = ["TORCH_GLOBALS", "TORCH_SAFE_GLOBALS", "TORCH_DTYPES", "MAX_NDIM", "MAX_ATTRIBUTES"]

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


_PLAIN_TENSOR = _ValueOnly("torch.Tensor")  # what GLOBAL torch.Tensor pushes: only _rebuild_from_type takes it
_ATTRIBUTE_TYPES = (bool, int, float, str, type(None))
MAX_ATTRIBUTES = 64
"""The most Python attributes a pickled tensor may carry."""


def _rebuild_from_type(args: tuple) -> _Tensor:
    """``torch._tensor._rebuild_from_type_v2(func, new_type, args, state)``: how ``torch.save``
    pickles a tensor whose ``__dict__`` is not empty (``Tensor.__reduce_ex__``). megatron-core's
    fp32 main params of bf16/fp16 params (``Float16OptimizerWithFloat16Params``,
    ``fp32_from_fp16_params`` in a legacy ``model_optim_rng.pt``) carry the attributes
    ``copy_tensor_model_parallel_attributes`` gives them (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``). ``func`` must be ``_rebuild_tensor_v2``, the
    type ``torch.Tensor`` (no subclass), and ``state`` a dict of at most :data:`MAX_ATTRIBUTES`
    string keys to bools, ints, floats, strings or None; the attributes are not kept."""
    if len(args) != 4:
        raise Refused(f"{len(args)} arguments (expected func, type, args, state)")
    func, new_type, inner, state = args
    if func is not _TENSOR_RULES[("torch._utils", "_rebuild_tensor_v2")]:
        raise Refused(f"the rebuild function is {short(func, 60)}, not torch._utils._rebuild_tensor_v2")
    if new_type is not _PLAIN_TENSOR:
        raise Refused(f"the type is {short(new_type, 60)}, not torch.Tensor")
    if type(inner) is not tuple:
        raise Refused(f"the tensor's arguments are a {type(inner).__name__}, not a tuple")
    if type(state) is not dict or len(state) > MAX_ATTRIBUTES or any(
            type(k) is not str or type(v) not in _ATTRIBUTE_TYPES for k, v in state.items()):
        raise Refused(f"the attributes must be a dict of at most {MAX_ATTRIBUTES} names to bools, ints, "
                      f"floats, strings or None, got {short(state, 80)}")
    return _rebuild_tensor(inner)


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
_TENSOR_RULES.update(_rules(
    Rule("torch._tensor", "_rebuild_from_type_v2", reduce=_rebuild_from_type,
         reason="a tensor with Python attributes (megatron-core's fp32 main params of 16-bit params)"),
    Rule("torch", "Tensor", value=_PLAIN_TENSOR, reason="only as _rebuild_from_type_v2's type"),
))

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
