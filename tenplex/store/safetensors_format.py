"""The safetensors file layout: headers written in a stream, and headers checked on read.

Why tenplex writes and reads the layout itself, and where it uses the
``safetensors`` package instead:

- **Writing.** ``safetensors.torch.save_file`` writes a whole file from a
  dict of tensors held in memory. A reshard streams each shard file tensor
  by tensor (the next leaf's target shards are built while this one's are
  written), so a file's tensors are never all in memory at once. tenplex
  therefore writes the documented layout itself: an 8-byte little-endian
  header length, a JSON header padded with spaces to a multiple of 8, then
  the tensor data at the header's ``data_offsets``.
- **Reading.** ``safetensors.safe_open`` maps a local file; a rank needs a
  few byte ranges of files that may live on object stores (``s3://``), read
  through fsspec with per-block checksums. tenplex reads those ranges itself
  and checks each file's header against the manifest (:func:`parse_header`,
  :func:`check_header`) before it uses any byte of the file.
- **Tests** read every file tenplex writes back with the ``safetensors``
  package (``safetensors.torch.load``), and compare the dtype codes here
  with the package's own.

Dtype codes are safetensors' (``F32``, ``BF16``, ``I64``, ``U8``, ``BOOL``...,
see the format's specification); they are derived from the dtype table of
:mod:`tenplex.ptree.tree`, the one place that names dtypes and their sizes.
"""

from __future__ import annotations

import json
import struct
from math import prod

from tenplex.errors import CorruptShardError
from tenplex.limits import MAX_SAFETENSORS_HEADER, short
from tenplex.ptree.tree import DTYPES
from tenplex.store.bounded_json import load_json

__all__ = ["ST_CODES", "MAX_HEADER", "Entry", "HeaderEntry", "header_bytes", "header_length",
           "parse_header", "check_header"]

MAX_HEADER = MAX_SAFETENSORS_HEADER
"""Largest JSON header accepted, in bytes (:data:`tenplex.limits.MAX_SAFETENSORS_HEADER`, 64 MiB)."""


def _code(name: str) -> str:
    """The safetensors dtype code of a tenplex dtype name: kind letter(s) and bits."""
    if name == "bool":
        return "BOOL"
    kind = "BF" if name == "bfloat16" else name[0].upper()  # float -> F, int -> I, uint -> U
    return f"{kind}{DTYPES[name].itemsize * 8}"


ST_CODES: dict[str, str] = {name: _code(name) for name in DTYPES}
"""``{tenplex dtype name: safetensors dtype code}``, e.g. ``"bfloat16": "BF16"``."""

_NAMES = {code: name for name, code in ST_CODES.items()}


class Entry(tuple):
    """``(name, dtype, shape)`` of one tensor in a file, in file order (shape in elements)."""

    def __new__(cls, name: str, dtype: str, shape: tuple[int, ...]):
        return super().__new__(cls, (name, dtype, tuple(shape)))

    @property
    def nbytes(self) -> int:
        """Bytes of data: elements times the dtype's itemsize."""
        return prod(self[2]) * DTYPES[self[1]].itemsize


class HeaderEntry(tuple):
    """``(name, dtype, shape, start, end)`` of one tensor in a file's header.

    ``start`` and ``end`` are absolute byte offsets in the file (the header's
    ``data_offsets`` plus the header's own length).
    """

    def __new__(cls, name: str, dtype: str, shape: tuple[int, ...], start: int, end: int):
        return super().__new__(cls, (name, dtype, tuple(shape), start, end))


def header_bytes(entries: list[Entry], metadata: dict | None = None) -> tuple[bytes, list[int]]:
    """The file prefix (length + JSON header) and each tensor's absolute byte offset."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for entry in entries:
        name, dtype, shape = Entry(*entry)
        n = Entry(name, dtype, shape).nbytes
        header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    starts, pos = [], len(prefix)
    for entry in entries:
        starts.append(pos)
        pos += Entry(*entry).nbytes
    return prefix, starts


def header_length(first8: bytes, file_size: int, where: str) -> int:
    """The JSON header's length in bytes, from a file's first 8 bytes.

    Raises:
        CorruptShardError: the file is shorter than 8 bytes, or the length is
            beyond the file or above :data:`MAX_HEADER`.
    """
    if file_size < 8 or len(first8) < 8:
        raise CorruptShardError(f"{where}: safetensors header: expected at least 8 bytes, "
                                f"the file has {file_size}")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > MAX_HEADER or 8 + n > file_size:
        raise CorruptShardError(f"{where}: safetensors header length: expected at most "
                                f"{min(MAX_HEADER, file_size - 8)} bytes (file of {file_size} bytes), "
                                f"found {n}")
    return n


def parse_header(text: bytes, file_size: int, where: str) -> list[HeaderEntry]:
    """Parse and check a safetensors JSON header (the bytes after the length).

    Checks that every tensor has a known dtype, a shape of non-negative
    integers and ``data_offsets`` inside the data; that ``end - start``
    equals the shape's elements times the dtype's itemsize; and that the
    tensors neither overlap nor leave holes (as the format requires).

    Args:
        text: the header's JSON bytes (``header_length`` of them).
        file_size: the file's size in bytes.
        where: the file, for messages.

    Returns:
        The tensors, ordered by offset.

    Raises:
        CorruptShardError: naming the file, the tensor and the field.
    """
    obj = load_json(bytes(text), f"{where}: safetensors header", max_bytes=MAX_HEADER,
                    error=CorruptShardError)
    if not isinstance(obj, dict):
        raise CorruptShardError(f"{where}: safetensors header: expected a JSON object, "
                                f"found {type(obj).__name__}")
    base = 8 + len(text)
    data = file_size - base
    out = [_entry(name, item, base, data, where) for name, item in obj.items()
           if name != "__metadata__"]
    out.sort(key=lambda e: (e[3], e[4]))
    pos = base
    for prev, entry in zip([None] + out[:-1], out):
        if entry[3] < pos:
            raise CorruptShardError(f"{where}: safetensors header: tensors {short(prev[0])} "
                                    f"[{prev[3] - base}, {prev[4] - base}) and {short(entry[0])} "
                                    f"[{entry[3] - base}, {entry[4] - base}) overlap")
        if entry[3] > pos:
            raise CorruptShardError(f"{where}: safetensors header: data_offsets leave bytes "
                                    f"[{pos - base}, {entry[3] - base}) unused before {short(entry[0])}")
        pos = entry[4]
    if pos != file_size:
        raise CorruptShardError(f"{where}: safetensors header: tensors end at byte {pos}, "
                                f"the file has {file_size}")
    return out


def _entry(name, item, base: int, data: int, where: str) -> HeaderEntry:
    what = f"{where}: safetensors header: tensor {short(name)}"
    if not isinstance(item, dict):
        raise CorruptShardError(f"{what}: expected an object, found {type(item).__name__}")
    code, shape, offsets = item.get("dtype"), item.get("shape"), item.get("data_offsets")
    if code not in _NAMES:
        raise CorruptShardError(f"{what}: dtype: expected one of {sorted(_NAMES)}, found {short(code)}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise CorruptShardError(f"{what}: shape: expected a list of non-negative integers, "
                                f"found {str(shape)[:100]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[0] <= offsets[1] <= data):
        raise CorruptShardError(f"{what}: data_offsets: expected [start, end] with "
                                f"0 <= start <= end <= {data} (the data's size), "
                                f"found {str(offsets)[:100]}")
    dtype = _NAMES[code]
    nbytes = prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptShardError(f"{what}: dtype {code} and shape {shape} make {nbytes} bytes, "
                                f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return HeaderEntry(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _plain(value) -> str:
    """A value for a message: strings unquoted (cut at 80 characters), others as :func:`short`."""
    return value[:80] if isinstance(value, str) else short(value)


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def check_header(entries: list[HeaderEntry], records, where: str) -> None:
    """Check that a file's header lists exactly the manifest's ``records`` for it.

    Args:
        entries: from :func:`parse_header`.
        records: the manifest's :class:`~tenplex.store.manifest.TensorRecord`s of the file.
        where: the file, for messages.

    Raises:
        CorruptShardError: a tensor missing from one side, or a dtype, shape
            or byte range that differs, naming the tensor and the field.
    """
    by_name = {e[0]: e for e in entries}
    names = {r.path for r in records}
    extra = sorted(set(by_name) - names)
    if extra:
        raise CorruptShardError(f"{where}: safetensors header lists tensor {short(extra[0])}, "
                                "which the manifest does not place in this file")
    for rec in records:
        e = by_name.get(rec.path)
        if e is None:
            raise CorruptShardError(f"{where}: safetensors header lacks tensor {rec.path!r}, "
                                    "which the manifest places in this file")
        found = (e[1], e[2], e[3], e[4] - e[3])
        expected = (rec.dtype, tuple(rec.shape), rec.offset, rec.nbytes)
        for field, want, got in zip(("dtype", "shape", "offset", "nbytes"), expected, found):
            if want != got:
                raise CorruptShardError(f"{where}: safetensors header, tensor {rec.path!r}: "
                                        f"{field}: the manifest says {_plain(want)}, the header {_plain(got)}")
