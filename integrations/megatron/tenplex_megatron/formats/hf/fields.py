"""The fields an export to Hugging Face needs beyond :class:`MegatronConfig`, read from Megatron's args.

Norm epsilon, rope settings, the router's settings and the features no
family maps (MLA, MTP). Each field has Megatron-LM's argparse default
(``megatron/training/arguments.py``, core_v0.16.1), which is also
megatron-core ``TransformerConfig``'s default.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from tenplex.errors import ConfigError

__all__ = ["ModelFields"]


@dataclass(frozen=True)
class ModelFields:
    """Megatron settings that change the maths of a GPT but not its tensors' shapes.

    Attributes:
        norm_epsilon: the norms' epsilon (``--norm-epsilon``; older args ``layernorm_epsilon``).
        apply_layernorm_1p: norms store ``weight - 1`` (the applied scale is ``1 + weight``).
        rotary_base: rope's base (``--rotary-base``), HF ``rope_theta``.
        rotary_interleaved: rope rotates pairs ``(2i, 2i+1)``, not halves ``(i, i + d/2)``.
        rotary_percent: the share of each head's channels rope rotates.
        rotary_seq_len_interpolation_factor: linear position interpolation, or None.
        use_rope_scaling: Llama-3.1 rope scaling, with ``rope_scaling_factor``
            (megatron-core ``apply_rope_scaling`` hard-codes ``low_freq_factor=1``,
            ``high_freq_factor=4``, ``original_max_position_embeddings=8192``).
        rope_scaling_factor: the scaling factor.
        moe_router_topk: experts per token.
        moe_router_pre_softmax: softmax over all experts before top-k (no renormalisation).
        moe_router_score_function: ``"softmax"`` or ``"sigmoid"``.
        moe_router_topk_scaling_factor: a factor on the top-k weights, or None.
        multi_latent_attention: MLA (DeepSeek) attention.
        mtp_num_layers: multi-token-prediction layers, or None.
        in_args: whether the values came from a checkpoint's args (else all defaults).
    """

    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False
    rotary_percent: float = 1.0
    rotary_seq_len_interpolation_factor: float | None = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    multi_latent_attention: bool = False
    mtp_num_layers: int | None = None
    in_args: bool = False

    @classmethod
    def from_args(cls, args: Any) -> "ModelFields":
        """Read the fields from Megatron's ``args`` (a Namespace, a mapping, or its JSON form).

        A field the args lack takes Megatron-LM's default; ``None`` args give
        every default with ``in_args=False``.

        Raises:
            ConfigError: a field of the wrong type.
        """
        if args is None:
            return cls()
        a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        out = {}
        for f in fields(cls):
            if f.name == "in_args":
                continue
            value = a.get(f.name)
            if value is None and f.name == "norm_epsilon":
                value = a.get("layernorm_epsilon")
            if value is None:
                continue
            out[f.name] = _typed(f.name, value, f.default)
        return cls(**out, in_args=True)

    @classmethod
    def from_json(cls, obj: Mapping) -> "ModelFields":
        """From :meth:`to_json`'s form.

        Raises:
            ConfigError: unknown fields.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ConfigError(f"ModelFields: unknown fields {unknown}")
        return cls(**dict(obj))

    def to_json(self) -> dict:
        return asdict(self)

    def to_args(self) -> dict:
        """The Megatron-LM args these fields are (``norm_epsilon`` and the rest, by name)."""
        out = asdict(self)
        out.pop("in_args")
        out["layernorm_epsilon"] = out["norm_epsilon"]
        return out


def _typed(name: str, value: Any, default: Any) -> Any:
    """``value`` as the type of ``default`` (bool, int, float or str); ``None`` defaults take numbers."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"Megatron args: {name}={value!r}; expected true or false")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"Megatron args: {name}={value!r}; expected a string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"Megatron args: {name}={value!r}; expected a number")
    whole = isinstance(default, int) or (default is None and isinstance(value, int))
    return int(value) if whole else float(value)
