"""Read only the needed bytes of a Megatron tensor made from Hugging Face tensors (the import).

A target rank needs part of a Megatron tensor: its tensor-parallel rows of
a fused ``linear_qkv`` or ``linear_fc1``, or its columns of ``linear_proj``.
The Megatron writers then built their files rank by rank, so reading every
HF tensor whole for each rank read the checkpoint ``tp`` times over (hf ->
megatron-legacy at tp 4 read 1.77 GB for 443 MB needed). They now build a
leaf once for a stage's ``tp`` ranks (:mod:`tenplex_megatron.formats.siblings`),
within a bound; ranks past the bound, and the processes of a reshard under
torchrun, still ask for their own parts.

The transforms the import applies to large tensors (:class:`Transform`
``COPY``, ``VOCAB``, ``QKV``, ``GATE_UP``) only move rows: each row of the
Megatron tensor is one row of one HF tensor (or a padding row), with the
same columns. So the row map is found by applying the transform itself to
row numbers (no second copy of its maths), and each needed run of the
Megatron tensor's bytes is read from the HF row it comes from. ``NORM`` and
``HEAD_NORM`` (1-D norm weights, which change values) are read whole.
"""

from __future__ import annotations

import os
from math import prod

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.tree import torch_dtype
from tenplex.store.blocks import union_runs

from tenplex_megatron.formats.hf import transforms as tf
from tenplex_megatron.formats.hf.family import Transform
from tenplex_megatron.formats.hf.hfdir import hf_open

__all__ = ["row_map", "segments", "read_runs", "read_exact", "PARTIAL_MIN_BYTES", "ROW_TRANSFORMS"]

PARTIAL_MIN_BYTES = 64 << 10
"""A record whose HF tensors hold fewer bytes than this is read whole (one read is cheaper)."""

ROW_TRANSFORMS = frozenset({Transform.COPY, Transform.VOCAB, Transform.QKV, Transform.GATE_UP})
"""The transforms that only move rows (see the module docstring)."""

_SHIFT = 40  # a row code: part index << _SHIFT | row (rows < 2**40)


def row_map(record, geo: tf.Geometry) -> np.ndarray | None:
    """For each row of ``record``'s Megatron tensor, ``part << 40 | row`` of the HF row it is, or -1 (padding).

    Returns None where the record is not a pure row move (a ``NORM``, parts whose
    columns or dtypes differ): the caller reads it whole, and the transform checks it.
    """
    parts = record.parts
    if record.transform not in ROW_TRANSFORMS or len({(p.shape[1:], p.dtype) for p in parts}) != 1:
        return None
    if not all(p.shape for p in parts) or any(p.shape[0] >= 1 << _SHIFT for p in parts):
        return None
    codes = [torch.arange(p.shape[0], dtype=torch.int64) + (i << _SHIFT) for i, p in enumerate(parts)]
    t = record.transform
    if t is Transform.QKV:
        out = tf.qkv_in(*codes, geo)
    elif t is Transform.GATE_UP:
        if parts[0].shape != parts[1].shape:
            return None  # gate_up_in names the mismatch
        out = tf.gate_up_in(*codes)
    elif t is Transform.VOCAB:
        table = tf.vocab_in(codes[0], geo)
        out = torch.full((record.rows,), -1, dtype=torch.int64)
        out[: table.shape[0]] = table
    else:
        out = codes[0]
    return out.numpy()


def segments(codes: np.ndarray, cols: int, starts: np.ndarray, ends: np.ndarray):
    """Element runs ``[starts, ends)`` of the Megatron tensor as reads from the HF parts.

    Args:
        codes: :func:`row_map` (``R`` rows). cols: elements per row.
        starts, ends: element runs, within ``R * cols``.

    Returns:
        ``(part, src, dst, n)`` arrays: ``n`` elements of part ``part`` from element
        ``src`` go to element ``dst`` of the Megatron tensor (``part`` -1: zeros).
        Runs next to each other at both ends are merged.
    """
    s, e = union_runs(starts, ends)
    first, last = s // cols, (e - 1) // cols
    counts = last - first + 1
    run = np.repeat(np.arange(len(s)), counts)
    row = first[run] + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = np.maximum(s[run], row * cols)
    hi = np.minimum(e[run], (row + 1) * cols)
    code = codes[row]
    part = np.where(code < 0, -1, code >> _SHIFT)
    src = np.where(code < 0, 0, (code & ((1 << _SHIFT) - 1)) * cols) + (lo - row * cols)
    n = hi - lo
    keep = np.ones(len(n), dtype=bool)  # merge a segment into the one before where both ends continue
    keep[1:] = ~((part[1:] == part[:-1]) & (src[1:] == src[:-1] + n[:-1]) & (lo[1:] == lo[:-1] + n[:-1]))
    heads = np.flatnonzero(keep)
    return part[heads], src[heads], lo[heads], np.add.reduceat(n, heads)


def read_exact(f, view: memoryview, p, at: int) -> None:
    """Fill ``view`` from the unbuffered file ``f``, stored tensor ``p``'s bytes from ``at`` on (a read may
    return less than asked: Linux stops one at about 2 GiB).

    Raises:
        ManifestError: the file ends first.
    """
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ManifestError(f"{p.file}: tensor {p.name} should have {p.end - p.start} bytes, the file "
                                f"ends {at + done} bytes into it")
        done += got


def read_runs(record, codes: np.ndarray, starts: np.ndarray, ends: np.ndarray, dtype: torch.dtype
              ) -> tuple[torch.Tensor, int]:
    """``record``'s Megatron tensor (``dtype``) with at least the byte runs ``[starts, ends)`` read.

    Args:
        record: the HF record (its ``parts`` share one dtype and row shape; see :func:`row_map`).
        codes: its :func:`row_map`.
        starts, ends: byte runs of the Megatron tensor in ``dtype`` (int64 arrays).
        dtype: the Megatron tensor's dtype (the parts are converted to it).

    Returns:
        ``(tensor, bytes read)``; bytes outside the runs are unspecified.

    Raises:
        ManifestError: a run outside the tensor, or a file shorter than its header says.
        CorruptShardError: a file missing or not a regular file.
        PathError: a file that resolves outside its directory (:func:`~tenplex_megatron.formats.hf.hfdir.resolve`).
    """
    parts = record.parts
    rest = tuple(parts[0].shape[1:])
    cols, rows = prod(rest), len(codes)
    out_item = torch.empty((), dtype=dtype).element_size()
    lo, hi = starts // out_item, -(-ends // out_item)
    if len(lo) == 0 or lo.min() < 0 or hi.max() > rows * cols:
        raise ManifestError(f"{record.path}: byte runs outside the tensor's {rows * cols * out_item} bytes")
    part, src, dst, n = segments(codes, cols, lo, hi)
    stage = torch.empty(rows * cols, dtype=torch_dtype(parts[0].dtype))
    item = stage.element_size()
    raw = stage.view(torch.uint8).numpy() if stage.numel() else np.empty(0, np.uint8)
    read = 0
    for i, p in enumerate(parts):
        mine = np.flatnonzero(part == i)
        if not len(mine):
            continue
        # every segment lies inside part ``p``: its rows come from arange(p.shape[0]) and
        # hfdir checked the header's shape against the byte range and the file's size
        f, _ = hf_open(p.file, buffering=0)
        with f:
            for a, b, m in zip((src[mine] * item).tolist(), (dst[mine] * item).tolist(), (n[mine] * item).tolist()):
                f.seek(p.start + a)
                read_exact(f, memoryview(raw[b:b + m]), p, a)
                read += m
    for b, m in zip(dst[part < 0].tolist(), n[part < 0].tolist()):
        stage[b:b + m].zero_()
    return stage.view(rows, *rest).to(dtype), read
