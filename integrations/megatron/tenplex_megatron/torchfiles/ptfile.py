"""Tensor bytes inside ``torch.save`` files, located from the files' metadata alone.

A ``torch.save`` file is an uncompressed zip: a pickle (``data.pkl``) that
describes the objects, and one record per tensor storage. Loading it with
``map_location="meta"`` and ``weights_only=True`` unpickles only the
description: every tensor comes back on the meta device, and no tensor byte
is read. Where each tensor lies is taken from tenplex's own validation of the
same pickle (the record's offset from the zip's local header, checked against
torch's reader: :mod:`~tenplex_megatron.torchfiles.ziprecords`), never from
``UntypedStorage._checkpoint_offset``, which torch *computes* for files of
``.format_version >= 1`` as if its own writer had laid them out (wrong for a
re-zipped file). :func:`load_refs` turns each tensor into a :class:`TensorRef`;
:meth:`TensorRef.read` then reads exactly the byte runs a caller needs.

The same works for a ``torch.save`` blob inside a larger file (a DCP
``.distcp`` item): :func:`load_refs` takes a byte window of the file.

Nothing read is trusted: a tensor must be contiguous, lie inside its
storage record and inside the file (or window); a short read is an error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.limits import Walk, short

from tenplex_megatron.torchfiles.safe_load import FileView, _Tensor, load_meta, open_regular, tensor_header

__all__ = ["TensorRef", "Window", "load_refs", "locate_tensor", "tensor_ref", "read_runs", "GAP"]

GAP = 1 << 18
"""Byte runs closer than this (256 KiB) are read in one request."""


@dataclass(frozen=True)
class TensorRef:
    """Where a stored tensor's bytes lie: row-major, contiguous, little-endian.

    Attributes:
        file: the file's path.
        offset: byte offset of element 0 in the file.
        shape: the tensor's shape, in elements.
        dtype: its torch dtype.
    """

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def narrow(self, start: int, numel: int, shape: tuple[int, ...]) -> "TensorRef":
        """Elements ``[start, start + numel)`` of this tensor (flattened), viewed as ``shape``.

        Raises:
            ManifestError: if the range lies outside the tensor or ``shape`` does not hold ``numel``.
        """
        if start < 0 or start + numel > self.numel or prod(shape) != numel:
            raise ManifestError(f"{self.file}: elements [{start}, {start + numel}) as {list(shape)} do "
                                f"not fit a stored tensor of {self.numel} elements")
        return TensorRef(self.file, self.offset + start * self.dtype.itemsize, tuple(shape), self.dtype)

    def read(self, starts: np.ndarray | None = None, ends: np.ndarray | None = None
             ) -> tuple[torch.Tensor, int]:
        """The tensor with at least bytes ``[starts[i], ends[i])`` read, and the bytes read.

        Offsets are relative to element 0; ``None`` reads every byte. Bytes
        outside the runs are undefined (the buffer is allocated, not filled).

        Raises:
            ManifestError: if the file is missing or shorter than recorded.
        """
        out = torch.empty(self.shape, dtype=self.dtype)
        if not self.nbytes:
            return out, 0
        if starts is None:
            starts, ends = np.array([0], dtype=np.int64), np.array([self.nbytes], dtype=np.int64)
        raw = out.view(-1).view(torch.uint8).numpy()
        return out, read_runs(self.file, self.offset, starts, ends, raw)


def _merged(starts: np.ndarray, ends: np.ndarray, gap: int) -> list[tuple[int, int]]:
    order = np.argsort(starts, kind="stable")
    runs: list[list[int]] = []
    for s, e in zip(starts[order].tolist(), ends[order].tolist()):
        if e <= s:
            continue
        if runs and s <= runs[-1][1] + gap:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    return [(a, b) for a, b in runs]


def read_runs(file: str, offset: int, starts: np.ndarray, ends: np.ndarray, out: np.ndarray,
              gap: int = GAP) -> int:
    """Read byte runs ``[starts[i], ends[i])`` (relative to ``offset``) of ``file`` into ``out``.

    ``out[a:b]`` receives file bytes ``[offset + a, offset + b)``; runs closer
    than ``gap`` are merged into one request. Returns the bytes read.

    Raises:
        ManifestError: a missing file, or a short read (a truncated file).
    """
    runs = _merged(np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64), gap)
    if runs and (runs[0][0] < 0 or runs[-1][1] > len(out)):
        raise ManifestError(f"{file}: byte runs [{runs[0][0]}, {runs[-1][1]}) fall outside a tensor "
                            f"of {len(out)} bytes")
    view, total = memoryview(out), 0
    try:
        f, _ = open_regular(file, file, buffering=0)
        with f:
            for a, b in runs:
                f.seek(offset + a)
                got = f.readinto(view[a:b])
                total += got or 0
                if got != b - a:
                    raise ManifestError(f"{file}: short read at bytes [{offset + a}, {offset + b}): got "
                                        f"{got}; the file is truncated or its metadata lies")
    except FileNotFoundError:
        raise ManifestError(f"{file}: the file is missing") from None
    return total


class Window(FileView):
    """Bytes ``[start, start + length)`` of the file at ``path`` as a seekable, read-only
    stream that owns its (unbuffered) file and counts the bytes read (``bytes_read``)."""

    def __init__(self, path: str, start: int = 0, length: int | None = None):
        f, size = open_regular(path, path, buffering=0)  # no FIFO or device can block us
        length = size - start if length is None else length
        if start < 0 or length < 0 or start + length > size:
            f.close()
            raise ManifestError(f"{path}: bytes [{start}, {start + length}) lie outside the "
                                f"file of {size} bytes")
        super().__init__(f, start, length)
        self.start = start
        self.bytes_read = 0

    def readinto(self, buf) -> int:
        got = super().readinto(buf) or 0
        self.bytes_read += got
        return got

    def close(self) -> None:
        self.f.close()
        super().close()


def load_refs(path: str, start: int = 0, length: int | None = None, what: str | None = None
              ) -> tuple[Any, int]:
    """The objects of a ``torch.save`` file (or of bytes ``[start, start + length)`` of one), tensors as refs.

    Returns:
        ``(obj, bytes_read)``: ``obj`` with every tensor replaced by a
        :class:`TensorRef`; only the zip directory and the pickle are read.

    Raises:
        ManifestError: an unsafe pickle, a file that is not a ``torch.save``
            archive, or a tensor that is not contiguous or lies outside its
            storage record or the window.
    """
    what = what or (path if not start and length is None else f"{path} [bytes {start}..]")
    try:
        window = Window(path, start, length)
    except FileNotFoundError:
        raise ManifestError(f"{path}: the file is missing") from None
    with window:
        obj, shadow = load_meta(window, what)
    return _to_refs(obj, shadow, path, start, start + window.length, what), window.bytes_read


def locate_tensor(path: str, start: int, length: int, what: str) -> tuple[TensorRef, int]:
    """Where the one tensor of the ``torch.save`` blob at bytes ``[start, start + length)`` of
    ``path`` (a DCP item) lies, and the bytes read to find it.

    Only the restricted unpickler reads the blob's pickle
    (:func:`~tenplex_megatron.torchfiles.safe_load.tensor_header` with ``locate``); the tensor's first
    byte is its storage record's offset plus its storage offset. This is what
    :func:`load_refs` finds, without its second pass through ``torch.load``.

    Raises:
        ManifestError: a missing file, an unsafe pickle, a blob that is not a
            ``torch.save`` archive, or a tensor that is not row-major or lies outside the blob.
    """
    try:
        window = Window(path, start, length)
    except FileNotFoundError:
        raise ManifestError(f"{path}: the file is missing") from None
    with window:
        header = tensor_header(window, what, locate=True)
    return tensor_ref(path, start, length, header, what), window.bytes_read


def tensor_ref(path: str, start: int, length: int, header: tuple, what: str) -> TensorRef:
    """The :class:`TensorRef` of a blob at bytes ``[start, start + length)`` of ``path`` from its
    ``tensor_header(..., locate=True)``: ``(dtype, shape, stride, first byte in the blob)``.

    Raises:
        ManifestError: the tensor is not row-major, or lies outside the blob.
    """
    dtype, shape, stride, first = header
    step, nbytes = 1, prod(shape) * dtype.itemsize
    for n, got in zip(reversed(shape), reversed(stride)):
        if n > 1 and got != step:
            raise ManifestError(f"{what}: a {list(shape)} {dtype} tensor with strides {list(stride)} is "
                                "not row-major; tenplex reads row-major tensors only")
        step *= n
    if first < 0 or first + nbytes > length:
        raise ManifestError(f"{what}: a {list(shape)} {dtype} tensor at byte {start + first} runs past "
                            f"the end of its data ({start + length}); the file is truncated or lies")
    return TensorRef(path, start + first, tuple(shape), dtype)


def _to_refs(obj: Any, shadow: Any, path: str, start: int, end: int, what: str) -> Any:
    """``obj`` (torch's meta load) with each tensor replaced by a :class:`TensorRef` placed by the
    same tensor in ``shadow`` (the restricted unpickler's build of the same pickle).

    Shared references stay shared (each object is converted once), and the walk visits at most
    :data:`~tenplex.limits.MAX_WALK` nodes.
    """
    done: dict[int, Any] = {}
    walk = Walk(what, ManifestError)

    def convert(o: Any, sh: Any) -> Any:
        walk.step()
        key = id(o)
        if key in done:
            return done[key]
        if isinstance(o, torch.Tensor):
            out = _ref(o, tensor_place(sh), path, start, end, what)
        elif isinstance(o, dict) and isinstance(sh, dict) and len(o) == len(sh):
            out = type(o)() if type(o) is not dict else {}
            for k, v in o.items():
                if k not in sh:
                    raise _differs(what, k)
                out[k] = convert(v, sh[k])
        elif isinstance(o, (list, tuple)) and type(sh) is type(o) and len(o) == len(sh):
            out = type(o)(convert(v, w) for v, w in zip(o, sh)) if isinstance(o, tuple) else \
                [convert(v, w) for v, w in zip(o, sh)]
        elif isinstance(o, argparse.Namespace) and isinstance(sh, argparse.Namespace):
            out = argparse.Namespace(**{k: convert(v, getattr(sh, k, None)) for k, v in vars(o).items()})
        elif isinstance(o, (dict, list, tuple, argparse.Namespace)):
            raise _differs(what, type(o).__name__)
        else:
            out = o
        done[key] = out
        return out

    try:
        return convert(obj, shadow)
    except RecursionError:
        raise ManifestError(f"{what}: objects nested too deeply") from None


def _differs(what: str, where: Any) -> ManifestError:
    return ManifestError(f"{what}: torch.load and tenplex's validation read different structures "
                         f"(at {short(where, 60)}); the pickle is inconsistent")


def _ref(t: torch.Tensor, place: tuple | None, path: str, start: int, end: int, what: str) -> TensorRef:
    """The ref of meta tensor ``t``, at the place the validated pickle gives (``tensor_place``)."""
    if place is None or place[0] != t.dtype or tuple(place[1]) != tuple(t.shape):
        raise ManifestError(f"{what}: a {list(t.shape)} {t.dtype} tensor has no matching validated "
                            "tensor; the pickle is inconsistent")
    dtype, shape, stride, first = place
    return tensor_ref(path, start, end - start, (dtype, shape, stride, first), what)


def tensor_place(t: Any) -> tuple[torch.dtype, tuple, tuple, int] | None:
    """``(dtype, shape, stride, first byte in the file)`` of a tensor in :func:`load_meta`'s
    shadow, or None if ``t`` is not one."""
    if not isinstance(t, _Tensor):
        return None
    return t.dtype, t.shape, t.stride, t.storage.offset + t.offset * t.dtype.itemsize
