"""Qwen3: Llama with per-head query/key RMSNorms (Megatron's qk_layernorm)."""

from tenplex_megatron.formats.hf.family import DENSE_NAMES, Family, register

_L = "model.layers.{i}.self_attn"
QWEN3_NAMES = {**DENSE_NAMES,
               "decoder/layers/{i}/self_attention/q_layernorm/weight": (f"{_L}.q_norm.weight",),
               "decoder/layers/{i}/self_attention/k_layernorm/weight": (f"{_L}.k_norm.weight",)}

QWEN3 = register(Family(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    names=QWEN3_NAMES,
    config={"attention_bias": lambda m: False, "use_sliding_window": lambda m: False},
    supports=frozenset({"qk_norm"}),
    requires=frozenset({"qk_norm"}),
))
