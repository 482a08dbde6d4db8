"""Qwen2: Llama with a bias on q, k and v only (Megatron's add_qkv_bias)."""

from tenplex_megatron.formats.hf.family import DENSE_NAMES, Family, register

QWEN2 = register(Family(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    names=DENSE_NAMES,
    config={"use_sliding_window": lambda m: False},
    supports=frozenset({"qkv_bias"}),
    requires=frozenset({"qkv_bias"}),
))
