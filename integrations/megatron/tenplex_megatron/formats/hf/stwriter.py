"""A safetensors file written tensor by tensor from its declared header.

``safetensors.torch.save_file`` needs every tensor of a file in memory at
once. The export knows each tensor's name, dtype and shape before it reads
anything, so it writes the header first (the format: an 8-byte
little-endian length, a JSON header of ``{name: {"dtype", "shape",
"data_offsets"}}`` padded with spaces to a multiple of 8 bytes, then the
data; safetensors' own writer lays tensors out the same way), and then each
tensor, or each run of a tensor (:meth:`ShardFile.write_range`), at its
offset (``os.pwrite``) as soon as it is built. The export writes them in
file order, so the file grows front to back: on ext4, writing into a file
sized first (``ftruncate``), or out of order, cost 3 to 10 times the kernel
time of appending the same bytes (measured here, 2 GB in 256 MB writes). The
process holds a few tensors instead of a shard. The finished file is opened
with the ``safetensors`` package, which checks its header against its size.
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
        self._left = {name: slot[1] for name, slot in self.slots.items() if slot[1]}
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write ``tensor`` (CPU) as ``name``; returns the bytes written. Thread-safe.

        Raises:
            ShardError: an undeclared or repeated name, or a dtype or shape other than declared.
        """
        slot = self.slots.get(name)
        if slot is None or tensor.dtype != slot[2] or tuple(tensor.shape) != slot[3]:
            raise ShardError(f"{self.path}: {name} {tensor.dtype}{list(tensor.shape)} is not a declared tensor "
                             f"({slot and (slot[2], list(slot[3]))})")
        return self.write_range(name, 0, tensor.contiguous())

    def write_range(self, name: str, start: int, data: torch.Tensor) -> int:
        """Write the elements of ``data`` (CPU, contiguous, flat order, the declared dtype) as elements
        ``[start, start + data.numel())`` of tensor ``name``; returns the bytes written. Thread-safe;
        the ranges of one name must not overlap (each is counted once towards the tensor's bytes).

        Raises:
            ShardError: an undeclared name, another dtype, a range outside the tensor, or more
                bytes than declared.
        """
        slot = self.slots.get(name)
        if slot is None or data.dtype != slot[2] or not data.is_contiguous():
            raise ShardError(f"{self.path}: {name}: {data.dtype} elements (contiguous: {data.is_contiguous()}) "
                             f"are not a part of a declared tensor ({slot and slot[2]})")
        offset, n = slot[0] + start * data.element_size(), data.numel() * data.element_size()
        if start < 0 or offset + n > slot[0] + slot[1]:
            raise ShardError(f"{self.path}: {name}: bytes [{offset - slot[0]}, {offset - slot[0] + n}) fall "
                             f"outside its {slot[1]} bytes")
        if not n:
            return 0
        with self._lock:
            if self._left.get(name, 0) < n:
                raise ShardError(f"{self.path}: {name} written twice")
            self._left[name] -= n
            if not self._left[name]:
                del self._left[name]
        data = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < n:
            done += os.pwrite(self.fd, data[done:], self.base + offset + done)
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
