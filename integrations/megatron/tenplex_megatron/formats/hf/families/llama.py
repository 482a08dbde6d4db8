"""Llama: GQA, SwiGLU, RMSNorm, rope (llama3 scaling); optional biases on every linear."""

from tenplex_megatron.formats.hf.family import DENSE_NAMES, Family, register

LLAMA = register(Family(
    name="llama",
    architecture="LlamaForCausalLM",
    names=DENSE_NAMES,
    config={"attention_bias": lambda m: m.cfg.add_bias_linear, "mlp_bias": lambda m: m.cfg.add_bias_linear},
    supports=frozenset({"linear_bias"}),
))
