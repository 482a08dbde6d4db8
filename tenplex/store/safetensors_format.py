"""The safetensors file layout, for writing a file in a stream.

The safetensors library writes a whole file from a dict held in memory. A
reshard streams a shard file tensor by tensor, so tenplex writes the
header itself, in the format's documented layout (an 8-byte little-endian
header length, a JSON header padded with spaces to a multiple of 8, then the
tensor data at the header's ``data_offsets``). The tests read every file
tenplex writes back with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import struct
from math import prod

from tenplex.errors import CorruptShardError

__all__ = ["ST_DTYPES", "Entry", "header_bytes", "parse_header"]

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
             "bool": "BOOL"}
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class Entry(tuple):
    """``(name, dtype, shape)`` of one tensor in a file, in file order."""

    def __new__(cls, name: str, dtype: str, shape: tuple[int, ...]):
        return super().__new__(cls, (name, dtype, tuple(shape)))

    @property
    def nbytes(self) -> int:
        return prod(self[2]) * _ITEMSIZE[self[1]]


def header_bytes(entries: list[Entry], metadata: dict | None = None) -> tuple[bytes, list[int]]:
    """The file prefix (length + JSON header) and each tensor's absolute byte offset."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in entries:
        n = Entry(name, dtype, shape).nbytes
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
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


def parse_header(prefix: bytes, where: str) -> dict:
    """The JSON header of a safetensors file from its first bytes.

    Raises:
        CorruptShardError: if the prefix is too short or the header is not JSON.
    """
    if len(prefix) < 8:
        raise CorruptShardError(f"{where}: truncated safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if len(prefix) < 8 + n:
        raise CorruptShardError(f"{where}: truncated safetensors header ({n} bytes expected)")
    try:
        return json.loads(prefix[8:8 + n])
    except json.JSONDecodeError as exc:
        raise CorruptShardError(f"{where}: bad safetensors header: {exc}") from exc
