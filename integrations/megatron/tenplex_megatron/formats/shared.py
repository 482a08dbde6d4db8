"""An opened Megatron source handed from one process to the others as JSON (``share``, ``open_shared``).

Under torchrun (:mod:`tenplex.distributed_reshard`) process 0 opens the
source once, with every check of the single-process reader (the restricted
unpickler, the bounds, the tied copies compared, the values read), and
sends the others what they need to read tensor bytes: plain JSON, never a
pickle. The others rebuild their source from it without opening the
checkpoint's metadata files (legacy: the rank files' pickles; torch_dist:
``.metadata``, ``common.pt`` and each item's header), then read only the
tensor bytes of their own target files.

What is sent (:func:`share_common`): the model config, the parallel config,
the description's values, meta and notes, the size of every file a tensor
lies in, and each stored tensor as ``[file, offset, shape, dtype]`` (the
format adds which tensor it is, and where the values it reads on demand
lie: RNG states, the Adam step). The tree and its sharding are rebuilt from
the model config, not sent. A value is read by the process that needs it,
as in one process: none is read for the others.

What arrives is checked as untrusted input (it crossed a process boundary):
every field's type and size, every file a plain relative path inside the
checkpoint, on disk with the size process 0 saw (``os.stat``: no byte of it
is read), and every tensor inside its file, of a known dtype, with the shape
and dtype the model gives its leaf. A read then fails on a short read, as
the single-process reader does.
"""

from __future__ import annotations

import os
from typing import Any

from tenplex.errors import ManifestError, TenplexError
from tenplex.limits import short
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import torch_dtype
from tenplex.store.paths import regular_size, resolve_inside

from tenplex_megatron.formats.description import Description
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import megatron_tree
from tenplex_megatron.model.limits import SCALARS, check_scalars
from tenplex_megatron.torchfiles.jsonable import to_jsonable
from tenplex_megatron.torchfiles.ptfile import TensorRef
from tenplex_megatron.torchfiles.safe_load import TORCH_DTYPES

__all__ = ["VERSION", "share_common", "description_from", "ref_json", "ref_from", "field", "check_leaf",
           "encode_refs", "decode_refs"]

VERSION = 1
"""The shared form's version; a process refuses another."""

MAX_DIMS = 8
"""Most dimensions a shared tensor may have (Megatron's have at most 3)."""


def field(obj: Any, key: str, kind: type | tuple, what: str) -> Any:
    """``obj[key]``, which must be a ``kind``.

    Raises:
        ManifestError: ``obj`` is not a dict, or the field is missing or of another type.
    """
    if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind) or \
            (kind is int and isinstance(obj[key], bool)):
        found = type(obj.get(key)).__name__ if isinstance(obj, dict) else type(obj).__name__
        raise ManifestError(f"{what}: field {key!r} is {found}; expected {getattr(kind, '__name__', kind)}")
    return obj[key]


def _relative(base: str, path: str) -> str:
    rel = os.path.relpath(path, base)
    if rel.startswith(".."):
        raise ManifestError(f"{path}: outside the checkpoint {base}; cannot share it")
    return rel


def ref_json(ref: TensorRef, base: str) -> list:
    """``[file relative to base, offset, shape, dtype name]`` of a stored tensor."""
    return [_relative(base, ref.file), ref.offset, list(ref.shape), str(ref.dtype).removeprefix("torch.")]


def share_common(source, base: str, files: set[str]) -> dict:
    """The shared form's common part (see the module docstring).

    Args:
        source: the opened :class:`~tenplex_megatron.formats.source.MegatronSource`.
        base: the folder every shared path is relative to (its data folder).
        files: the files tensors and values lie in (absolute).
    """
    desc = source.desc
    return {"version": VERSION, "format": desc.meta["megatron"]["format"], "cfg": desc.cfg.to_json(),
            "config": desc.config.to_json(), "values": dict(desc.values), "meta": desc.meta,
            "notes": list(desc.notes), "files": {_relative(base, f): os.path.getsize(f) for f in sorted(files)}}


def encode_refs(obj: Any, base: str, files: set[str]) -> Any:
    """A value as read from a file's pickle (tensors as :class:`TensorRef`) in JSON: each tensor as
    ``{"__ref__": [file, offset, shape, dtype]}`` (its file added to ``files``), tuples as
    ``{"__tuple__": [...]}`` and other leaves as :func:`~tenplex_megatron.torchfiles.jsonable.to_jsonable`
    writes them, so the receiver's ``to_jsonable`` of the read value is the sender's."""
    if isinstance(obj, TensorRef):
        files.add(obj.file)
        return {"__ref__": ref_json(obj, base)}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise ManifestError(f"a shared value: a mapping with keys {short(list(obj))} cannot be JSON")
        return {str(k): encode_refs(v, base, files) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_refs(v, base, files) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_refs(v, base, files) for v in obj]}
    return to_jsonable(obj, "a shared value")


def decode_refs(obj: Any, base: str, sizes: dict[str, int], what: str) -> Any:
    """:func:`encode_refs`'s form with each ``{"__ref__": ...}`` a checked :class:`TensorRef` again
    (:func:`ref_from`); the other JSON is kept as it is.

    Raises:
        ManifestError: a malformed tensor, or nesting too deep.
    """
    try:
        if isinstance(obj, dict):
            if "__ref__" in obj:
                return ref_from(obj["__ref__"], base, sizes, what)
            return {k: decode_refs(v, base, sizes, what) for k, v in obj.items()}
        if isinstance(obj, list):
            return [decode_refs(v, base, sizes, what) for v in obj]
        return obj
    except RecursionError:
        raise ManifestError(f"{what}: a value nested too deeply") from None


def _file_sizes(shared: dict, base: str, what: str) -> dict[str, int]:
    """``{relative path: size}`` of the shared files, each checked on disk (no byte read).

    Raises:
        ManifestError: a path that is not relative or leaves ``base``, a size that is not a
            non-negative int, or a file whose size on disk differs.
    """
    out = {}
    for rel, size in field(shared, "files", dict, what).items():
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.split("/") or "\0" in rel:
            raise ManifestError(f"{what}: file {short(rel, 120)} is not a relative path inside {base}")
        if type(size) is not int or size < 0:
            raise ManifestError(f"{what}: file {rel} has size {short(size, 30)}; expected a byte count")
        path = os.path.join(base, rel)
        resolve_inside(base, path, what)
        on_disk = regular_size(path, f"{what}: {rel}")
        if on_disk != size:
            raise ManifestError(f"{what}: {path} is {on_disk} bytes; process 0 read {size} (the file changed, "
                                "or this process sees other storage than process 0)")
        out[rel] = size
    return out


def ref_from(item: Any, base: str, sizes: dict[str, int], what: str) -> TensorRef:
    """A stored tensor from ``[file, offset, shape, dtype]``, checked to lie inside its file.

    Raises:
        ManifestError: a malformed item, an unknown file or dtype, or bytes past the file's end.
    """
    if not isinstance(item, list) or len(item) != 4:
        raise ManifestError(f"{what}: a tensor is {short(item, 80)}; expected [file, offset, shape, dtype]")
    rel, offset, shape, dtype = item
    if not isinstance(rel, str) or rel not in sizes:
        raise ManifestError(f"{what}: a tensor lies in {short(rel, 120)}, which is not a shared file")
    if type(offset) is not int or offset < 0:
        raise ManifestError(f"{what}: {rel}: offset {short(offset, 30)}; expected a non-negative int")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
            not all(type(n) is int and n >= 0 for n in shape):
        raise ManifestError(f"{what}: {rel}: shape {short(shape, 80)}; expected at most {MAX_DIMS} "
                            "non-negative ints")
    stored = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if stored is None:
        raise ManifestError(f"{what}: {rel}: dtype {short(dtype, 30)} is not a torch dtype tenplex reads")
    ref = TensorRef(os.path.join(base, rel), offset, tuple(shape), stored)
    if offset + ref.nbytes > sizes[rel]:
        raise ManifestError(f"{what}: {rel}: a {shape} {dtype} tensor at offset {offset} ends at byte "
                            f"{offset + ref.nbytes}, past the file's {sizes[rel]} bytes")
    return ref


def check_leaf(ref: TensorRef, sharding: Sharding, path: str, split: int, what: str) -> TensorRef:
    """``ref`` if it has the local shape and the dtype the model gives ``path`` at split rank ``split``.

    Raises:
        ManifestError: naming the leaf, what the model gives and what was sent.
    """
    leaf = sharding.tree[path] if path in sharding.tree else None
    if leaf is None or not hasattr(leaf, "layout"):
        raise ManifestError(f"{what}: {short(path, 120)} is not a tensor leaf of the model")
    shape = sharding.tp_local(leaf, split)[0]
    if ref.shape != tuple(shape) or ref.dtype != torch_dtype(leaf.dtype):
        raise ManifestError(f"{what}: {path} at split rank {split} is sent as {list(ref.shape)} {ref.dtype}; "
                            f"the model gives {list(shape)} torch.{leaf.dtype}")
    return ref


def description_from(shared: Any, fmt: str, root: str, what: str) -> tuple[Description, dict[str, int]]:
    """The description a shared form carries, and its files' sizes (checked on disk).

    Args:
        shared: the shared form (untrusted).
        fmt: ``"legacy"`` or ``"dist"``: the format it must be.
        root: the checkpoint's data folder as this process finds it (``meta["megatron"]["root"]``).
        what: how to name the form in errors.

    Raises:
        ManifestError, ConfigError: a malformed form, another format or root, or a file that
            differs on disk.
    """
    if field(shared, "version", int, what) != VERSION:
        raise ManifestError(f"{what}: version {shared['version']}; this process reads version {VERSION}")
    meta = field(shared, "meta", dict, what)
    megatron = field(meta, "megatron", dict, what)
    if field(shared, "format", str, what) != fmt or megatron.get("format") != fmt:
        raise ManifestError(f"{what}: a {short(shared['format'], 30)} source; expected {fmt}")
    if megatron.get("root") != root:
        raise ManifestError(f"{what}: describes {short(megatron.get('root'), 200)}; this process reads {root}")
    try:  # built as the reader built them, from the configs alone
        cfg = MegatronConfig.from_json(field(shared, "cfg", dict, what))
        config = ParallelConfig.from_json(field(shared, "config", dict, what))
        tree = megatron_tree(cfg, optimizer=megatron.get("optimizer") is not None)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        if isinstance(exc, TenplexError):
            raise
        raise ManifestError(f"{what}: its model or parallel config is malformed "
                            f"({type(exc).__name__}: {short(str(exc), 200)})") from None
    if megatron.get("config") != cfg.to_json():
        raise ManifestError(f"{what}: meta's model config differs from the model config sent")
    notes = field(shared, "notes", list, what)
    if not all(isinstance(n, str) for n in notes):
        raise ManifestError(f"{what}: notes must be strings")
    values = dict(field(shared, "values", dict, what))
    check_scalars(values, SCALARS, what)  # as the reader checked them
    rng = values.get("megatron/rng_state")
    if not isinstance(rng, list) or not all(isinstance(k, str) for k in rng):
        raise ManifestError(f"{what}: megatron/rng_state is {short(rng, 80)}; expected a list of coordinates")
    desc = Description(cfg, config, tree, values, meta, list(notes), Sharding(tree, config))
    return desc, _file_sizes(shared, root, what)
