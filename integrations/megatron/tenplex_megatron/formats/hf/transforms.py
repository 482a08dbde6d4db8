"""Tensor transforms between megatron-core's global tensors and Hugging Face's (both directions).

Pure functions on whole (tp = 1) tensors. Each is one fact of
``docs/hf.md``'s table; the export applies ``*_out`` functions, the import
their inverses (``*_in``). Shapes: ``H`` hidden size, ``nh`` attention
heads, ``g`` query groups, ``d`` per-head channels (``kv_channels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tenplex.errors import ShardError

__all__ = ["Geometry", "qkv_out", "qkv_in", "gate_up_out", "gate_up_in", "rope_rows_out", "rope_rows_in",
           "norm_out", "norm_in", "vocab_out", "vocab_in"]


@dataclass(frozen=True)
class Geometry:
    """The attention geometry the QKV and rope transforms need.

    Attributes:
        heads: ``nh``. groups: ``g`` (key/value heads). d: per-head channels.
        interleaved: Megatron's ``rotary_interleaved`` (pairs ``(2i, 2i+1)``).
        layernorm_1p: Megatron's ``apply_layernorm_1p`` (stored weight = applied scale - 1).
        vocab: the logical vocabulary size (rows kept of a padded table).
    """

    heads: int
    groups: int
    d: int
    interleaved: bool = False
    layernorm_1p: bool = False
    vocab: int = 0


def _check(t: torch.Tensor, rows: int, what: str) -> None:
    if t.shape[0] != rows:
        raise ShardError(f"{what}: expected {rows} rows, found shape {tuple(t.shape)}")


def rope_rows_out(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Per-head rows of q or k (``[n * d, ...]``, or a ``[d]`` norm weight) from Megatron's rope order
    to HF's: with ``rotary_interleaved`` each head's rows become ``[even; odd]``
    (megatron-core ``_rotate_half`` pairs ``(2i, 2i+1)``, HF ``rotate_half`` pairs ``(i, i + d/2)``)."""
    if not geo.interleaved:
        return t
    heads = t.reshape(-1, geo.d, *t.shape[1:])
    return torch.cat([heads[:, 0::2], heads[:, 1::2]], dim=1).reshape(t.shape)


def rope_rows_in(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Inverse of :func:`rope_rows_out`."""
    if not geo.interleaved:
        return t
    heads = t.reshape(-1, geo.d, *t.shape[1:])
    half = geo.d // 2
    out = torch.empty_like(heads)
    out[:, 0::2], out[:, 1::2] = heads[:, :half], heads[:, half:]
    return out.reshape(t.shape)


def qkv_out(t: torch.Tensor, geo: Geometry) -> list[torch.Tensor]:
    """Megatron's fused ``linear_qkv`` weight ``[(nh + 2g) d, H]`` (or bias ``[(nh + 2g) d]``) as HF's
    ``[q ``[nh d, ...]``, k ``[g d, ...]``, v ``[g d, ...]``]``.

    Megatron orders rows per query group: ``nh/g`` query heads, then that
    group's key head, then its value head (``attention.py::get_query_key_value_tensors``).

    Raises:
        ShardError: the tensor's rows are not ``(nh + 2g) d``.
    """
    per = geo.heads // geo.groups
    _check(t, (geo.heads + 2 * geo.groups) * geo.d, "linear_qkv")
    grouped = t.reshape(geo.groups, (per + 2) * geo.d, *t.shape[1:])
    q = grouped[:, : per * geo.d].reshape(geo.heads * geo.d, *t.shape[1:])
    k = grouped[:, per * geo.d: (per + 1) * geo.d].reshape(geo.groups * geo.d, *t.shape[1:])
    v = grouped[:, (per + 1) * geo.d:].reshape(geo.groups * geo.d, *t.shape[1:])
    return [rope_rows_out(q, geo).contiguous(), rope_rows_out(k, geo).contiguous(), v.contiguous()]


def qkv_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Inverse of :func:`qkv_out`: HF's q, k, v as Megatron's fused, per-group rows.

    Raises:
        ShardError: q, k or v has the wrong number of rows.
    """
    per = geo.heads // geo.groups
    _check(q, geo.heads * geo.d, "q_proj")
    _check(k, geo.groups * geo.d, "k_proj")
    _check(v, geo.groups * geo.d, "v_proj")
    rest = q.shape[1:]
    q = rope_rows_in(q, geo).reshape(geo.groups, per * geo.d, *rest)
    k = rope_rows_in(k, geo).reshape(geo.groups, geo.d, *rest)
    v = v.reshape(geo.groups, geo.d, *rest)
    return torch.cat([q, k, v], dim=1).reshape((geo.heads + 2 * geo.groups) * geo.d, *rest)


def gate_up_out(t: torch.Tensor) -> list[torch.Tensor]:
    """SwiGLU ``linear_fc1`` ``[2F, ...]`` as ``[gate [F, ...], up [F, ...]]`` (Megatron stores ``[gate; up]``)."""
    if t.shape[0] % 2:
        raise ShardError(f"linear_fc1: a SwiGLU fc1 has an even number of rows, found {tuple(t.shape)}")
    gate, up = t.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def gate_up_in(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`gate_up_out`."""
    if gate.shape != up.shape:
        raise ShardError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def norm_out(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """A norm weight as HF applies it: ``stored + 1`` under ``apply_layernorm_1p``."""
    return t + 1 if geo.layernorm_1p else t


def norm_in(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Inverse of :func:`norm_out`."""
    return t - 1 if geo.layernorm_1p else t


def vocab_out(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """The logical rows ``[:vocab]`` of a vocab-padded table (padding is dropped).

    Raises:
        ShardError: the table has fewer rows than the vocabulary.
    """
    if t.shape[0] < geo.vocab:
        raise ShardError(f"vocabulary table: expected at least {geo.vocab} rows, found {tuple(t.shape)}")
    return t[: geo.vocab].contiguous() if t.shape[0] != geo.vocab else t


def vocab_in(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Inverse of :func:`vocab_out` at tp = 1 is the identity: the planner adds padding rows.

    Raises:
        ShardError: the table's rows are not the vocabulary size.
    """
    _check(t, geo.vocab, "vocabulary table")
    return t
