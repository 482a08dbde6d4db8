"""A safetensors file written tensor by tensor, in any order, from several threads.

``safetensors.torch.save_file`` needs every tensor of a file in memory at
once. The export knows each tensor's name, dtype and shape before it reads
anything, so it writes the header first (the format: an 8-byte
little-endian length, a JSON header of ``{name: {"dtype", "shape",
"data_offsets"}}`` padded with spaces to a multiple of 8 bytes, then the
data; safetensors' own writer lays tensors out the same way), sizes the
file, and then writes each tensor at its offset (``os.pwrite``) as soon as
it is built. Reads, transforms and writes overlap, and the process holds a
few tensors instead of a shard. The finished file is opened with the
``safetensors`` package, which checks its header against its size.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from math import prod

import torch

from tenplex.errors import CorruptShardError, ShardError

__all__ = ["ShardFile", "ST_DTYPES"]

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class ShardFile:
    """One safetensors file whose tensors are declared up front and written in any order.

    Args:
        path: the file to create.
        entries: ``[(name, dtype, shape)]`` in file order.
        metadata: the header's ``__metadata__`` (strings).

    Raises:
        ShardError: a dtype safetensors has no code for, or a name given twice.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.slots: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in ST_DTYPES or name in self.slots:
                raise ShardError(f"{path}: tensor {name}: dtype {dtype} or a repeated name")
            n = prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.slots[name] = (offset, n, dtype, tuple(shape))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.base, self.size = path, 8 + len(raw), 8 + len(raw) + offset
        self._left = set(self.slots)
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write ``tensor`` (contiguous, CPU) as ``name``; returns the bytes written. Thread-safe.

        Raises:
            ShardError: an undeclared or repeated name, or a dtype or shape other than declared.
        """
        slot = self.slots.get(name)
        if slot is None or tensor.dtype != slot[2] or tuple(tensor.shape) != slot[3]:
            raise ShardError(f"{self.path}: {name} {tensor.dtype}{list(tensor.shape)} is not a declared tensor "
                             f"({slot and (slot[2], list(slot[3]))})")
        with self._lock:
            if name not in self._left:
                raise ShardError(f"{self.path}: {name} written twice")
            self._left.discard(name)
        data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        offset, n = self.base + slot[0], slot[1]
        done = 0
        while done < n:
            done += os.pwrite(self.fd, data[done:], offset + done)
        return n

    def close(self) -> None:
        """Close the file and check it with ``safetensors``.

        Raises:
            CorruptShardError: a declared tensor was never written, or safetensors
                does not read the file back with the declared names.
        """
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._left:
            raise CorruptShardError(f"{self.path}: {len(self._left)} tensors never written, e.g. "
                                    f"{sorted(self._left)[0]}")
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(self.path, "pt") as f:
            if sorted(f.keys()) != sorted(self.slots):
                raise CorruptShardError(f"{self.path}: safetensors reads other names than were written")
