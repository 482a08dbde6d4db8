"""A Hugging Face model directory on disk: ``config.json``, weight files, their index; read safely.

Every safetensors header is parsed and checked here (``safetensors``'
format: an 8-byte little-endian header length, a JSON header of
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` with offsets
from the end of the header), so a tensor is read by its byte range and a
file that lies about sizes or offsets is refused before any read.

A directory without safetensors files may hold ``pytorch_model.bin`` (and
``pytorch_model.bin.index.json``): ``torch.save`` of the state dict, as
transformers wrote before safetensors became its default (v4.35). Such a
file's pickle goes through tenplex's restricted unpickler only
(:func:`tenplex_megatron.torchfiles.ptfile.load_refs`: allow-listed globals, no
code runs); it places every tensor by byte range, and the bytes are read
like a safetensors tensor's. Names that share their bytes exactly (tied
embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight``) are
aliases; any other overlap is refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from typing import Callable

from tenplex.errors import CorruptShardError, ManifestError, PathError
from tenplex.limits import MAX_JSON_BYTES, short
from tenplex.store.bounded_json import load_json
from tenplex.store.paths import open_regular, resolve_inside

__all__ = ["StoredTensor", "is_hf_dir", "hf_fault", "hf_open", "resolve", "read_config", "tensors", "verify_hf",
           "INDEX", "SINGLE", "BIN_INDEX", "BIN"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN = "pytorch_model.bin"
_WEIGHTS = ((INDEX, SINGLE), (BIN_INDEX, BIN))
"""(index, single file) pairs, in the order transformers looks for them."""
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_DTYPE = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file.

    Attributes:
        file: the file's path. name: the tensor's name. dtype: e.g. ``"float32"``.
        shape: its shape. start, end: its bytes in the file (absolute offsets).
    """

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a directory with ``config.json`` and ``model.safetensors`` or its index (or
    ``pytorch_model.bin`` or its index)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, n)) for pair in _WEIGHTS for n in pair))


_OTHER_WEIGHTS = {".h5": "TensorFlow weights", ".msgpack": "Flax weights", ".gguf": "GGUF weights"}


def hf_fault(path: str) -> str | None:
    """What keeps the directory ``path`` with a ``config.json`` from being read as a model directory, or
    None (no ``config.json``: not one); for a hub cache's model folder (``models--<org>--<name>``), which
    snapshot folders to name instead. Raises nothing; lists folders, reads no file.

    The ``hf`` format reads safetensors files and ``pytorch_model.bin`` (with its index when sharded);
    TensorFlow, Flax and GGUF weights are named as such.
    """
    try:
        snapshots = os.path.join(path, "snapshots")
        if os.path.basename(os.path.realpath(path)).startswith("models--") and os.path.isdir(snapshots):
            revisions = sorted(os.listdir(snapshots))
            return (f"{path}: a Hugging Face hub cache folder; name one of its snapshot folders, "
                    f"{snapshots}/<revision> (found {', '.join(short(r, 48) for r in revisions[:4]) or 'none'}"
                    f"{' and more' if len(revisions) > 4 else ''})")
        if not os.path.isfile(os.path.join(path, "config.json")):
            return None
        names = sorted(os.listdir(path))
    except OSError:
        return None
    other = sorted({kind for n in names for ext, kind in _OTHER_WEIGHTS.items() if n.endswith(ext)})
    listing = ", ".join(short(n, 40) for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    said = (f"; its weights are {' and '.join(other)}, which the hf format does not read: where you trust "
            "the files, load the model with transformers and save_pretrained it again (safetensors)") \
        if other else ""
    return (f"{path}: a Hugging Face model directory (config.json) without weights tenplex reads: expected "
            f"{SINGLE}, {INDEX}, {BIN} or {BIN_INDEX}, found {listing}{said}")


def _hub_blobs(folder: str) -> str | None:
    """The ``blobs`` folder of the Hugging Face hub cache that ``folder`` is a snapshot of, or None.

    ``huggingface_hub`` (``snapshot_download``, transformers' cache) keeps a model as
    ``<cache>/models--<org>--<name>/snapshots/<revision>/<file>``, each file a symlink to
    ``../../blobs/<hash>`` (its "Manage the cache" guide); a snapshot folder is what users name.
    """
    real = os.path.realpath(folder)
    snapshots, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith("models--"):
        return None
    blobs = os.path.join(repo, "blobs")
    return blobs if os.path.isdir(blobs) else None


def resolve(file: str) -> str:
    """``file`` (in a model directory) resolved through symlinks, checked to lie inside its directory
    or, for a hub cache snapshot, inside that model's ``blobs`` folder (:func:`_hub_blobs`).

    Raises:
        PathError: it resolves anywhere else.
    """
    folder = os.path.dirname(file)
    try:
        return resolve_inside(folder, file)
    except PathError:
        blobs = _hub_blobs(folder)
        if blobs is None:
            raise
        try:
            return resolve_inside(blobs, file)
        except PathError:
            raise PathError(f"{file}: resolves to {os.path.realpath(file)}, outside the model directory "
                            f"{os.path.realpath(folder)} and its hub cache's {blobs}; tenplex reads no file "
                            "outside them") from None


def hf_open(file: str, buffering: int = -1):
    """``(binary file, size)`` of a file of the model directory, under the one path rule (:func:`resolve`,
    then :func:`tenplex.store.paths.open_regular`: a regular file, never a FIFO or device).

    Raises:
        PathError: see :func:`resolve`. CorruptShardError: missing or not a regular file.
    """
    return open_regular(resolve(file), file, buffering=buffering)



def _json(file: str):
    """A JSON file of the model directory, opened under the path rule and parsed within the limits
    of :mod:`tenplex.store.bounded_json` (size checked before anything is read)."""
    f, size = hf_open(file)
    with f:
        if size > MAX_JSON_BYTES:
            raise ManifestError(f"{file}: {size} bytes; a JSON file here may have at most {MAX_JSON_BYTES}")
        return load_json(f.read(size), file)


def read_config(path: str) -> dict:
    """``config.json`` as a dict.

    Raises:
        ManifestError: missing or not a JSON object.
    """
    where = os.path.join(path, "config.json")
    out = _json(where)
    if not isinstance(out, dict):
        raise ManifestError(f"{where}: expected a JSON object, found {type(out).__name__}")
    return out


def _files(path: str) -> tuple[str | None, list[str]]:
    """``(index file or None, weight files)`` of the model directory: safetensors where there are any."""
    for index_name, single in _WEIGHTS:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            obj = _json(index)
            weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
            names = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None
            if not names or any(not isinstance(n, str) or os.path.basename(n) != n or n.startswith(".")
                                for n in names):
                raise ManifestError(f"{index}: weight_map must map names to plain file names in the directory")
            return index, names
        if os.path.isfile(os.path.join(path, single)):
            return None, [single]
    return None, [SINGLE]


def _header(file: str) -> list[StoredTensor]:
    """The tensors of one safetensors file, each checked against the file's size.

    Raises:
        CorruptShardError: a truncated file, a header that is not JSON, or a
            tensor whose offsets do not fit its dtype and shape or the file.
    """
    f, size = hf_open(file)
    with f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptShardError(f"{file}: {size} bytes; a safetensors file starts with an 8-byte length")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CorruptShardError(f"{file}: header of {n} bytes in a file of {size}")
        header = load_json(f.read(n), f"{file}: header", error=CorruptShardError)
    if not isinstance(header, dict):
        raise CorruptShardError(f"{file}: header is a {type(header).__name__}; expected an object")
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out.append(_entry(file, name, entry, 8 + n, size))
    _no_overlaps(file, out)
    return out


def _no_overlaps(file: str, entries: list[StoredTensor], aliases: bool = False) -> None:
    """Refuse two tensors that share bytes (one would be read as the other's values).

    The safetensors library refuses them too (its ``Metadata::validate`` requires each tensor to
    start where the previous one ends); this checks the part that matters for what is read. With
    ``aliases`` (a ``torch.save`` file), two names of the same bytes, dtype and shape are allowed.
    """
    last = None
    for t in sorted(entries, key=lambda t: (t.start, t.end)):
        same = last is not None and (t.start, t.end, t.dtype, t.shape) == (last.start, last.end, last.dtype, last.shape)
        if last is not None and t.start < last.end and t.end > t.start and not (aliases and same):
            raise CorruptShardError(f"{file}: tensors {short(last.name)} [{last.start}, {last.end}) and "
                                    f"{short(t.name)} [{t.start}, {t.end}) share bytes; expected each "
                                    "tensor in bytes of its own")
        if last is None or t.end > last.end:
            last = t


def _entry(file: str, name: str, entry, base: int, size: int) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        ok = (dtype in _ITEMSIZE and all(type(s) is int and s >= 0 for s in shape)
              and type(begin) is int and type(end) is int)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CorruptShardError(f"{file}: tensor {short(name)} has a malformed header entry {short(entry)}")
    expected = prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected or begin < 0 or base + end > size:
        raise CorruptShardError(f"{file}: tensor {name!r} {dtype}{list(shape)} needs {expected} bytes; its "
                                f"offsets [{begin}, {end}) give {end - begin} in a file of {size}")
    if dtype not in _DTYPE:
        raise CorruptShardError(f"{file}: tensor {name!r} is {dtype}; expected a floating-point weight")
    return StoredTensor(file, name, _DTYPE[dtype], shape, base + begin, base + end)


def _pickled(file: str) -> list[StoredTensor]:
    """The tensors of one ``torch.save`` state dict (``pytorch_model.bin``), placed by the restricted
    unpickler (:func:`~tenplex_megatron.torchfiles.ptfile.load_refs`: only the zip directory and the
    pickle are read; each tensor must lie inside its storage record and be row-major).

    Raises:
        ManifestError: an unsafe or inconsistent pickle, or not a ``{name: tensor}`` mapping.
        CorruptShardError: a tensor that is not floating-point, or tensors that partly share bytes.
    """
    from tenplex_megatron.torchfiles.ptfile import TensorRef, load_refs  # noqa: PLC0415 (torch)

    obj, _ = load_refs(resolve(file), what=file)
    if not isinstance(obj, dict):
        raise ManifestError(f"{file}: expected a state dict ({{name: tensor}}), found {type(obj).__name__}")
    out = []
    for name, ref in obj.items():
        if not isinstance(name, str) or not isinstance(ref, TensorRef):
            raise ManifestError(f"{file}: expected a state dict of tensors, found {short(name)}: {short(ref)}")
        dtype = str(ref.dtype).removeprefix("torch.")
        if dtype not in _DTYPE.values():
            raise CorruptShardError(f"{file}: tensor {name!r} is {dtype}; expected a floating-point weight")
        out.append(StoredTensor(file, name, dtype, tuple(ref.shape), ref.offset, ref.offset + ref.nbytes))
    _no_overlaps(file, out, aliases=True)
    return out


def tensors(path: str) -> dict[str, StoredTensor]:
    """Every tensor of the model directory ``path`` by name (safetensors files, or ``pytorch_model.bin``).

    Raises:
        ManifestError: an unreadable index, a name in two files, or a tensor the
            index places in another file than the one holding it; an unsafe pickle (:func:`_pickled`).
        CorruptShardError: see :func:`_header` and :func:`_pickled`.
    """
    out: dict[str, StoredTensor] = {}
    for name in _files(path)[1]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ManifestError(f"{path}: the index names {name}, which is missing")
        for t in (_header(file) if name.endswith(".safetensors") else _pickled(file)):
            if t.name in out:
                raise ManifestError(f"{path}: tensor {t.name} is in {out[t.name].file} and {file}")
            out[t.name] = t
    return out


def verify_hf(path: str, checksums: bool = False, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every file's header against its size, and the index against the headers.

    Returns:
        ``{"files", "bytes", "tensors", "checksums"}`` (``checksums``: ``{file: xxh3-128}``
        when asked, else None).

    Raises:
        ManifestError, CorruptShardError: see :func:`tensors`.
    """
    found = tensors(path)
    files = sorted({t.file for t in found.values()})
    index = _files(path)[0]
    if index is not None:
        weight_map = _json(index)["weight_map"]  # checked by tensors() above
        wrong = sorted(n for n, t in found.items() if weight_map.get(n) != os.path.basename(t.file))
        extra = sorted(set(weight_map) - set(found))
        if wrong or extra:
            raise ManifestError(f"{index}: the index and the files disagree on {(wrong + extra)[:3]}")
    total = sum(os.path.getsize(f) for f in files)
    digests = None
    if checksums:
        import xxhash  # noqa: PLC0415

        digests, done = {}, 0
        for f in files:
            h = xxhash.xxh3_128()
            fh, _ = hf_open(f)
            with fh:
                for block in iter(lambda fh=fh: fh.read(1 << 24), b""):
                    h.update(block)
                    done += len(block)
                    if progress:
                        progress(done, total)
            digests[os.path.basename(f)] = h.hexdigest()
    return {"files": len(files), "bytes": total, "tensors": len(found), "checksums": digests}
