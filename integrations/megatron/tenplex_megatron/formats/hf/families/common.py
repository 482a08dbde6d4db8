"""``config.json`` keys every family shares, read from the model config and the extra fields."""

from __future__ import annotations

from typing import Any

from tenplex_megatron.formats.hf.family import Model

__all__ = ["common_config", "rope_parameters"]


def rope_parameters(m: Model) -> dict:
    """transformers v5's ``rope_parameters``: the base, and Llama-3.1 scaling with megatron-core's
    hard-coded factors (``rope_utils.py::apply_rope_scaling``)."""
    out: dict[str, Any] = {"rope_theta": float(m.fields.rotary_base), "rope_type": "default"}
    if m.fields.use_rope_scaling:
        out.update(rope_type="llama3", factor=float(m.fields.rope_scaling_factor), low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
    return out


def common_config(m: Model) -> dict:
    """The keys of a decoder-only HF config that follow from the Megatron model alone."""
    c = m.cfg
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": float(m.fields.norm_epsilon),
        "rope_parameters": rope_parameters(m), "tie_word_embeddings": c.tied, "attention_dropout": 0.0,
        "use_cache": True,
    }
