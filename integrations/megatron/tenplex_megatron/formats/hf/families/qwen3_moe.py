"""Qwen3-MoE: Qwen3's attention (q/k norms) with top-k experts; ``norm_topk_prob`` is Megatron's
``not moe_router_pre_softmax``. Experts by global id, per-expert keys (``mlp.experts.{e}.*_proj``)."""

from tenplex_megatron.formats.hf.families.qwen3 import QWEN3_NAMES
from tenplex_megatron.formats.hf.family import Family, register

_M = "model.layers.{i}.mlp"
_DENSE_MLP = ("linear_fc1", "linear_fc2")
QWEN3_MOE_NAMES = {**{k: v for k, v in QWEN3_NAMES.items() if not any(f"mlp/{x}" in k for x in _DENSE_MLP)},
                   "decoder/layers/{i}/mlp/router/weight": (f"{_M}.gate.weight",),
                   "decoder/layers/{i}/mlp/experts/{e}/linear_fc1/weight": (f"{_M}.experts.{{e}}.gate_proj.weight",
                                                                            f"{_M}.experts.{{e}}.up_proj.weight"),
                   "decoder/layers/{i}/mlp/experts/{e}/linear_fc2/weight": (f"{_M}.experts.{{e}}.down_proj.weight",)}

QWEN3_MOE = register(Family(
    name="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    names=QWEN3_MOE_NAMES,
    config={"moe_intermediate_size": lambda m: m.cfg.moe_ffn_hidden_size,
            "intermediate_size": lambda m: m.cfg.moe_ffn_hidden_size,
            "num_experts": lambda m: m.cfg.num_moe_experts,
            "num_experts_per_tok": lambda m: m.fields.moe_router_topk,
            "norm_topk_prob": lambda m: not m.fields.moe_router_pre_softmax,
            "decoder_sparse_step": lambda m: 1, "mlp_only_layers": lambda m: [],
            "attention_bias": lambda m: False, "use_sliding_window": lambda m: False,
            "output_router_logits": lambda m: False},
    supports=frozenset({"experts", "qk_norm", "router_pre_softmax"}),
    requires=frozenset({"experts", "qk_norm"}),
))
