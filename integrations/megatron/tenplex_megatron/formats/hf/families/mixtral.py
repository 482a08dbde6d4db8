"""Mixtral: Llama's attention with top-k experts; the router renormalises the top-k weights
(Megatron's default ``moe_router_pre_softmax=False``). Experts by global id in transformers v5's
per-expert save format (``block_sparse_moe.experts.{e}.w1/w3/w2``)."""

from tenplex_megatron.formats.hf.family import DENSE_NAMES, Family, register

_M = "model.layers.{i}.block_sparse_moe"
_DENSE_MLP = ("linear_fc1", "linear_fc2")
MIXTRAL_NAMES = {**{k: v for k, v in DENSE_NAMES.items() if not any(f"mlp/{x}" in k for x in _DENSE_MLP)},
                 "decoder/layers/{i}/mlp/router/weight": (f"{_M}.gate.weight",),
                 "decoder/layers/{i}/mlp/experts/{e}/linear_fc1/weight": (f"{_M}.experts.{{e}}.w1.weight",
                                                                          f"{_M}.experts.{{e}}.w3.weight"),
                 "decoder/layers/{i}/mlp/experts/{e}/linear_fc2/weight": (f"{_M}.experts.{{e}}.w2.weight",)}

MIXTRAL = register(Family(
    name="mixtral",
    architecture="MixtralForCausalLM",
    names=MIXTRAL_NAMES,
    config={"intermediate_size": lambda m: m.cfg.moe_ffn_hidden_size,
            "num_local_experts": lambda m: m.cfg.num_moe_experts,
            "num_experts_per_tok": lambda m: m.fields.moe_router_topk,
            "router_jitter_noise": lambda m: 0.0, "output_router_logits": lambda m: False},
    supports=frozenset({"experts"}),
    requires=frozenset({"experts"}),
))
