"""A Hugging Face ``config.json`` as Megatron-LM args (the import's model config).

The inverse of ``families/common.py`` and the families' ``config`` entries:
each key the families write is read back, and a setting Megatron cannot
run (a non-SiLU activation, sliding windows, a rope type other than
default or llama3 with megatron-core's factors, dense layers between MoE
layers) is refused in one line that names it.
"""

from __future__ import annotations

from typing import Any

from tenplex.errors import ConfigError
from tenplex.limits import check_count, short

from tenplex_megatron.formats.hf.family import Family
from tenplex_megatron.model.limits import ARG_LIMITS

__all__ = ["args_from_config"]

_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's hard-coded llama3 rope-scaling constants (``rope_utils.py::apply_rope_scaling``)."""


_COUNTS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
           "intermediate_size": "ffn_hidden_size", "num_attention_heads": "num_attention_heads",
           "num_key_value_heads": "num_query_groups", "head_dim": "kv_channels",
           "max_position_embeddings": "max_position_embeddings", "vocab_size": "vocab_size",
           "num_experts": "num_experts", "num_local_experts": "num_experts",
           "moe_intermediate_size": "moe_ffn_hidden_size", "num_experts_per_tok": "num_experts"}
"""``{config.json key: the Megatron args field whose bound (model/limits.ARG_LIMITS) it obeys}``."""


def _get(config: dict, key: str, where: str, kind=int, default: Any = ...) -> Any:
    """``config[key]`` as ``kind``; a count is checked against its bound under its own name.

    Raises:
        ConfigError: the key is missing, of another type, or a count past its bound, naming
            ``where`` (the file) and ``key``.
    """
    value = config.get(key, default)
    if value is ...:
        raise ConfigError(f"{where}: no {key!r}; expected it in a {kind.__name__} field")
    if value is None or (kind is float and isinstance(value, int) and not isinstance(value, bool)):
        return value if value is None else float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {key}={short(value)}; expected a {kind.__name__}")
    if key in _COUNTS:
        check_count(value, f"{where}: {key}", ARG_LIMITS[_COUNTS[key]], error=ConfigError)
    return value


def _rope(config: dict, where: str) -> dict:
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0),
                                             **(config.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rotary_base": float(rope.get("rope_theta", 10000.0)), "use_rope_scaling": False,
           "rope_scaling_factor": 8.0}
    if kind == "llama3":
        for key, value in _LLAMA3.items():
            if float(rope.get(key, value)) != value:
                raise ConfigError(f"{where}: llama3 rope scaling with {key}={rope.get(key)}; megatron-core "
                                  f"hard-codes {value}")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif kind != "default":
        raise ConfigError(f"{where}: rope_type {short(kind)}; megatron-core GPTs here run default or llama3 rope")
    return out


def _refuse(config: dict, where: str) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={short(config['hidden_act'])}; Megatron's SwiGLU is SiLU-gated")
    if config.get("use_sliding_window") or config.get("sliding_window") and config.get("use_sliding_window", True):
        raise ConfigError(f"{where}: sliding-window attention; megatron-core GPTs here attend to all tokens")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{where}: dense layers between MoE layers (mlp_only_layers, decoder_sparse_step)")


def args_from_config(config: dict, family: Family, where: str) -> dict:
    """Megatron-LM args (by their names) for ``config.json`` of ``family``.

    Raises:
        ConfigError: a missing or mistyped key, or a setting Megatron cannot run.
    """
    _refuse(config, where)
    heads = _get(config, "num_attention_heads", where)
    hidden = _get(config, "hidden_size", where)
    groups = _get(config, "num_key_value_heads", where, default=heads)
    experts = _get(config, "num_experts", where, default=None) or _get(config, "num_local_experts", where,
                                                                       default=None)
    ffn = _get(config, "intermediate_size", where)
    moe_ffn = _get(config, "moe_intermediate_size", where, default=ffn) if experts else None
    bias = bool(config.get("attention_bias", False))
    if family.name == "llama" and bias != bool(config.get("mlp_bias", False)):
        raise ConfigError(f"{where}: attention_bias={bias}, mlp_bias={config.get('mlp_bias')}; Megatron's "
                          "add_bias_linear puts biases on every linear or on none")
    if bias and family.name != "llama":
        raise ConfigError(f"{where}: attention_bias=true in {family.name}, whose biases Megatron cannot place "
                          "(add_bias_linear also biases the MLP)")
    out = {
        "num_layers": _get(config, "num_hidden_layers", where), "hidden_size": hidden,
        "ffn_hidden_size": ffn, "num_attention_heads": heads, "group_query_attention": groups != heads,
        "num_query_groups": groups, "kv_channels": _get(config, "head_dim", where, default=None) or hidden // heads,
        "max_position_embeddings": _get(config, "max_position_embeddings", where, default=4096),
        "position_embedding_type": "rope", "use_rotary_position_embeddings": True, "rotary_percent": 1.0,
        "rotary_interleaved": False, "swiglu": True, "normalization": "RMSNorm",
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
        "add_bias_linear": bias and family.name == "llama", "add_qkv_bias": family.name == "qwen2",
        "qk_layernorm": "qk_norm" in family.requires, "vocab_size": _get(config, "vocab_size", where),
        "make_vocab_size_divisible_by": 128, "norm_epsilon": _get(config, "rms_norm_eps", where, float, 1e-6),
        "apply_layernorm_1p": False, **_rope(config, where),
    }
    if experts:
        topk = _get(config, "num_experts_per_tok", where)
        pre_softmax = family.name == "qwen3_moe" and not config.get("norm_topk_prob", False)
        out.update(num_experts=experts, moe_ffn_hidden_size=moe_ffn, moe_router_topk=topk,
                   moe_router_pre_softmax=pre_softmax, moe_router_score_function="softmax",
                   moe_router_topk_scaling_factor=None, moe_layer_freq=1, ffn_hidden_size=moe_ffn)
    return out
