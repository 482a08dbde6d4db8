"""``torch.save`` files written while their tensors are still being built, one storage at a time.

``torch.save`` pickles the object first (``data.pkl``: every tensor's shape,
dtype and storage key, no data), then writes one zip record per storage, in
the order the pickle met them. :func:`save_streamed` runs torch's own
``torch.serialization._save`` on the object with *placeholder* tensors:
allocated (``torch.empty``), never touched, so the operating system gives
them no memory. When the writer reaches a placeholder's record, the bytes
written are those of the next tensor from ``produced`` instead, which the
caller builds while the previous record is being written (the writer
releases the GIL). A writer then holds the record it writes and the ones
being built ahead, never the whole file, and building overlaps writing.

The file is byte for byte what ``torch.save`` writes for the object with the
produced tensors in place of the placeholders (same writer, same pickle,
same records, same CRC-32s); ``tests`` check this. On a torch whose
``torch.serialization`` lacks the private hooks, every tensor is produced
first and ``torch.save`` writes the object.
"""

from __future__ import annotations

import os
import pickle
from typing import Iterable, Iterator

import torch

__all__ = ["save_streamed"]


class _Records:
    """Wraps torch's zip writer: a placeholder's record gets the next produced tensor's bytes."""

    def __init__(self, writer, placeholders: list[torch.Tensor], produced: Iterator[torch.Tensor]):
        self.writer, self.produced = writer, produced
        self.index = {t.untyped_storage().data_ptr(): i for i, t in enumerate(placeholders)
                      if t.untyped_storage().data_ptr()}
        self.placeholders, self.next = placeholders, 0

    def write_record(self, name: str, data, size: int) -> None:
        if not isinstance(data, torch.UntypedStorage) or not name.startswith("data/"):
            return self.writer.write_record(name, data, size)
        i = self.index.get(data.data_ptr())
        if i is None and not (data.nbytes() == 0 and self._is_next_empty()):
            return self.writer.write_record(name, data, size)
        if i is not None and i != self.next:
            raise RuntimeError(f"placeholder {i} written before placeholder {self.next}: the "
                               "produced tensors would land in the wrong records")
        self.next += 1
        tensor = _own_storage(next(self.produced))
        if tensor.numel() * tensor.element_size() != size:
            raise RuntimeError(f"{name}: produced {tensor.numel() * tensor.element_size()} bytes "
                               f"for a placeholder of {size}")
        self.writer.write_record(name, tensor.untyped_storage(), size)

    def _is_next_empty(self) -> bool:
        return self.next < len(self.placeholders) and self.placeholders[self.next].numel() == 0


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous() \
            or t.storage_offset():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def save_streamed(obj, path: str, placeholders: list[torch.Tensor], produced: Iterable[torch.Tensor]
                  ) -> int:
    """``torch.save(obj, path)`` with each placeholder's bytes taken from ``produced``, in order.

    Args:
        obj: the object to save; it holds ``placeholders`` (each with its own
            storage, from ``torch.empty``) and possibly other tensors, saved as they are.
        path: the file to write.
        placeholders: the placeholder tensors, in the order ``obj``'s pickle
            meets them (dict insertion order, list order).
        produced: the tensors to write in their place, in the same order; each
            has its placeholder's shape, dtype and size in bytes. It is consumed
            as the file is written, so it may build them lazily (ahead, in
            other threads).

    Returns:
        The file's size in bytes.

    Raises:
        RuntimeError: a produced tensor whose size is not its placeholder's, or
            placeholders met in another order than given (a caller's bug).
        Whatever ``produced`` raises; the partly written file is left for the
        caller to remove (writers write into a temporary directory).
    """
    produced = iter(produced)
    save = getattr(torch.serialization, "_save", None)
    opener = getattr(torch.serialization, "_open_zipfile_writer", None)
    if save is None or opener is None:  # materialize, then save
        swap = {id(p): t for p, t in zip(placeholders, produced)}
        torch.save(_replace(obj, swap), path)
        return os.path.getsize(path)
    with opener(path) as writer:
        records = _Records(writer, placeholders, produced)
        save(obj, records, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    if records.next != len(placeholders):
        raise RuntimeError(f"{path}: {len(placeholders) - records.next} placeholders were never written")
    return os.path.getsize(path)


def _replace(obj, swap: dict):
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, dict):
        return type(obj)((k, _replace(v, swap)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, swap) for v in obj)
    return obj
