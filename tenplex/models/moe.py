"""Mixture-of-experts MLP blocks, laid out as megatron-core 0.16's ``MoELayer``.

Paths under ``<prefix>`` (the layer's ``mlp``), in module order:

- ``router/weight`` ``[num_experts, hidden]`` and ``router/bias``
  ``[num_experts]`` (with biases): replicated (``TopKRouter``);
- ``router/expert_bias`` ``[num_experts]`` float32, a buffer, not a parameter
  (aux-loss-free balancing): replicated;
- ``experts/{g}/fc1|fc2/weight|bias`` for global expert ``g``: an MLP of
  ``moe_ffn`` laid out like a dense one but split over expert tp, held by the
  ep rank that owns ``g`` and replicated over expert dp
  (:class:`~tenplex.ptree.layout.Expert`; ``SequentialMLP`` with
  ``tp_group=expt_tp``);
- ``shared_experts/gate_weight`` ``[1, hidden]`` (with a gate, replicated)
  and ``shared_experts/fc1|fc2/...``: a dense MLP over tp (``SharedExpertMLP``).
"""

from __future__ import annotations

from tenplex.models.mlp import dense_mlp
from tenplex.ptree.layout import Expert, Layout, Stage
from tenplex.ptree.tree import TensorLeaf

__all__ = ["moe_mlp"]


def moe_mlp(spec, layer: int, prefix: str) -> tuple[dict[str, TensorLeaf], dict[str, TensorLeaf]]:
    """The MoE MLP of ``layer``: ``(parameters, non-parameter tensors)``.

    Args:
        spec: the model (a :class:`~tenplex.models.gpt.GPTSpec` with ``num_experts > 0``).
        layer: the global layer index.
        prefix: the MLP's path.
    """
    dt, h, experts = spec.dtype, spec.hidden, spec.num_experts
    stage = Stage.of_layer(layer)
    params = {f"{prefix}/router/weight": TensorLeaf((experts, h), dt, Layout(stage))}
    if spec.bias:
        params[f"{prefix}/router/bias"] = TensorLeaf((experts,), dt, Layout(stage))
    state = {}
    if spec.expert_bias:
        state[f"{prefix}/router/expert_bias"] = TensorLeaf((experts,), "float32", Layout(stage))
    ffn = spec.moe_ffn or spec.ffn
    for g in range(experts):
        params.update(dense_mlp(spec, f"{prefix}/experts/{g}", stage, ffn, Expert(g, experts)))
    if spec.shared_expert_ffn:
        if spec.shared_expert_gate:
            params[f"{prefix}/shared_experts/gate_weight"] = TensorLeaf((1, h), dt, Layout(stage))
        params.update(dense_mlp(spec, f"{prefix}/shared_experts", stage, spec.shared_expert_ffn))
    return params, state
