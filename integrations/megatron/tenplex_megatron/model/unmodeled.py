"""Megatron-LM args that give the model parameters tenplex does not model: refused by name.

Without this, such a checkpoint fails on its first tensor tenplex does not expect ("unknown key
decoder.layers.self_attention.linear_q_down_proj.weight"), which does not say why. The flags are
megatron-core ``TransformerConfig`` fields (Megatron-LM 0.16 makes its args from them, same names).
"""

from __future__ import annotations

from typing import Any, Callable

from tenplex.errors import ConfigError
from tenplex.limits import short

__all__ = ["UNMODELED", "check_modeled"]

UNMODELED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("multi_latent_attention", bool, "multi-latent attention (linear_q_down_proj, linear_kv_down_proj, ...)"),
    ("mtp_num_layers", bool, "multi-token prediction layers (mtp.layers.*)"),
    ("softmax_type", lambda v: v == "learnable", "a learnable softmax offset per attention head"),
    ("attention_output_gate", bool, "a gate on the attention output (a wider linear_qkv)"),
    ("experimental_attention_variant", bool, "an experimental attention variant"),
    ("linear_attention_freq", bool, "linear-attention (gated delta net) layers"),
    ("moe_shared_expert_gate", bool, "a gate on the shared expert"),
    ("moe_latent_size", bool, "latent projections around the experts"),
    ("moe_use_legacy_grouped_gemm", bool, "the legacy GroupedMLP (mlp.experts.weight1, weight2)"),
    ("heterogeneous_layers_config_path", bool, "heterogeneous layers"),
    ("hybrid_override_pattern", bool, "a hybrid (Mamba) model"),
)
"""``(arg, is_set, what it adds)``: each arg that, set, gives the model what tenplex does not model."""


def check_modeled(args: dict) -> None:
    """Refuse Megatron args whose model tenplex does not model (:data:`UNMODELED`).

    Raises:
        ConfigError: naming the first such arg, its value and what it adds.
    """
    for name, is_set, what in UNMODELED:
        value = args.get(name)
        if value is not None and is_set(value):
            raise ConfigError(f"Megatron args: {name}={short(value, 40)} gives the model {what}, which "
                              "tenplex does not model; it reshards GPT models with standard attention, "
                              "dense or MoE MLPs (docs/megatron.md)")
