"""Which Megatron tensor becomes which HF tensors, through which transform: the export's job list."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from tenplex.errors import ConfigError

from tenplex_megatron.formats.hf import transforms as tf
from tenplex_megatron.formats.hf.family import TRANSFORMS, Family, Transform, generic_key
from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.model.config import MegatronConfig

__all__ = ["Job", "jobs", "geometry", "apply", "out_shapes", "segments", "Segment"]


@dataclass(frozen=True)
class Job:
    """One Megatron tensor and the HF tensors made of it.

    Attributes:
        path: the tree path read (a model path, or an fp32 main param's optimizer path).
        names: the HF names, one per output of ``transform``.
        transform: what is done to it.
        nbytes: bytes of the outputs at the output dtype.
        shapes: the outputs' shapes, one per name.
    """

    path: str
    names: tuple[str, ...]
    transform: Transform
    nbytes: int
    shapes: tuple[tuple[int, ...], ...] = ()


def geometry(cfg: MegatronConfig, fields: ModelFields) -> tf.Geometry:
    return tf.Geometry(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                       fields.rotary_interleaved, fields.apply_layernorm_1p, cfg.vocab_size)


def jobs(tree, cfg: MegatronConfig, family: Family, itemsize: int, main_params: bool = False) -> list[Job]:
    """The export's jobs in tree order (HF's layer order); optimizer leaves are skipped.

    Args:
        tree: the source tree.
        cfg: the model config.
        family: the family.
        itemsize: bytes per element of the output dtype.
        main_params: read each parameter's fp32 main copy (``optimizer/param/...``) instead.

    Raises:
        ConfigError: a model tensor the family has no name for.
    """
    out = []
    for path, leaf in tree.tensors():
        if not path.startswith("model/"):
            continue
        key, layer, expert = generic_key(path)
        names = family.names.get(key)
        if names is None:
            raise ConfigError(f"{family.architecture} has no name for Megatron tensor {path}")
        fmt = {"i": layer, "e": expert}
        transform = TRANSFORMS.get(key, Transform.COPY)
        shapes = out_shapes(transform, tuple(leaf.shape), cfg)
        src = path
        if main_params:
            src = "optimizer/param/" + path.removeprefix("model/")
            if src not in tree.leaves:
                raise ConfigError(f"--dtype float32 from main params: the checkpoint has no fp32 main "
                                  f"param of {path}")
        out.append(Job(src, tuple(n.format(**fmt) for n in names), transform,
                       sum(prod(s) for s in shapes) * itemsize, shapes))
    return out


def out_shapes(transform: Transform, shape: tuple[int, ...], cfg: MegatronConfig) -> tuple[tuple[int, ...], ...]:
    """The HF tensors' shapes a transform makes of a Megatron tensor of ``shape`` (tp = 1, padded rows
    excluded: the tree's shapes are logical)."""
    rows, rest = shape[0], shape[1:]
    if transform is Transform.QKV:
        d = cfg.kv_channels
        return ((cfg.num_attention_heads * d,) + rest, (cfg.num_query_groups * d,) + rest,
                (cfg.num_query_groups * d,) + rest)
    if transform is Transform.GATE_UP:
        return ((rows // 2,) + rest,) * 2
    if transform is Transform.VOCAB:
        return ((cfg.vocab_size,) + rest,)
    return (shape,)


def apply(job: Job, tensor: torch.Tensor, geo: tf.Geometry, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{HF name: tensor}`` of one job, at ``dtype``, each with its own storage.

    Raises:
        ShardError: a tensor of the wrong shape for its transform.
        ConfigError: outputs and names disagree in number.
    """
    t = job.transform
    if t is Transform.VOCAB:
        parts = [tf.vocab_out(tensor, geo)]
    elif t is Transform.NORM:
        parts = [tf.norm_out(tensor, geo)]
    elif t is Transform.HEAD_NORM:
        parts = [tf.rope_rows_out(tf.norm_out(tensor, geo), geo)]
    elif t is Transform.QKV:
        parts = tf.qkv_out(tensor, geo)
    elif t is Transform.GATE_UP:
        parts = tf.gate_up_out(tensor)
    else:
        parts = [tensor]
    if len(parts) != len(job.names):
        raise ConfigError(f"{job.path}: {t.value} gives {len(parts)} tensors, the family names {len(job.names)}")
    return {n: _own(p.to(dtype)) for n, p in zip(job.names, parts)}


Segment = tuple[int, int, str, int]
"""``(source element, elements, HF name, element in that HF tensor)``: one run the export copies as is."""


def segments(job: Job, shape: tuple[int, ...], geo: tf.Geometry, same_dtype: bool) -> list[Segment] | None:
    """:func:`apply` of ``job`` as runs of a global tensor of ``shape`` copied unchanged into the HF
    tensors (elements, flat order), or None where a value changes (a dtype change, ``+ 1``
    norms, rope's row order under ``rotary_interleaved``): then :func:`apply` it.

    Every transform but those moves whole rows (``transforms.py``): COPY all rows, VOCAB the
    first ``vocab``, GATE_UP the halves, QKV per query group ``nh/g`` query heads, one key
    head, one value head. The export writes each run straight from the read buffers.
    """
    if not shape:
        return None
    t, rows = job.transform, shape[0]
    expect = {Transform.QKV: ((geo.heads + 2 * geo.groups) * geo.d, 3), Transform.GATE_UP: (rows - rows % 2, 2),
              Transform.VOCAB: (max(rows, geo.vocab), 1)}.get(t, (rows, 1))
    if (rows, len(job.names)) != expect:  # apply() raises its error
        return None
    if not same_dtype or t in (Transform.NORM, Transform.HEAD_NORM) and (geo.layernorm_1p or geo.interleaved) \
            or t is Transform.QKV and geo.interleaved:
        return None
    row = prod(shape[1:])
    if t is Transform.QKV:
        per, d = geo.heads // geo.groups, geo.d
        q, k, v = job.names
        out = []
        for g in range(geo.groups):
            base = g * (per + 2) * d
            out += [(base * row, per * d * row, q, g * per * d * row),
                    ((base + per * d) * row, d * row, k, g * d * row),
                    ((base + (per + 1) * d) * row, d * row, v, g * d * row)]
        return out
    if t is Transform.GATE_UP:
        half = rows // 2 * row
        return [(0, half, job.names[0], 0), (half, half, job.names[1], 0)]
    return [(0, (geo.vocab if t is Transform.VOCAB else rows) * row, job.names[0], 0)]


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, with storage of exactly its bytes (no view of a larger buffer)."""
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t
