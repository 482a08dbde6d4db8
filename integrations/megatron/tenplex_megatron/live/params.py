"""Which megatron-core parameters a pipeline stage holds, by name, in ``named_parameters()`` order.

megatron-core's ``GPTModel`` (local layer spec) names its parameters with
stage-local layer indices (``decoder.layers.0...`` on every stage); the tree
uses global ones (:func:`tenplex_megatron.model.layouts.param_specs`). On stage
``s`` the layers are ``[first_layer(s), first_layer(s) + layers_per_stage[s])``
(megatron-core's ``get_transformer_layer_offset`` for an even split).

With tied embeddings and pp > 1, the last stage holds its own copy of the
word embedding as ``output_layer.weight``, after the final norm, with
``shared_embedding = True`` (``models/common/language_module/language_module.py::
setup_embeddings_and_output_layer``); the tree keeps both copies as one leaf
on the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenplex.errors import ShardError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import ParamSpec, param_specs

__all__ = ["StageParam", "stage_params", "named_params"]


@dataclass(frozen=True)
class StageParam:
    """One parameter of a stage.

    Attributes:
        name: its name in the unwrapped ``GPTModel.named_parameters()``.
        spec: its tree spec (global path, layout).
        shared_embedding: megatron-core marks it ``shared_embedding`` (own bucket
            with the distributed optimizer).
    """

    name: str
    spec: ParamSpec
    shared_embedding: bool = False


def stage_params(cfg: MegatronConfig, config: ParallelConfig, stage: int) -> list[StageParam]:
    """The parameters of pipeline ``stage`` under ``config``, in ``named_parameters()`` order."""
    layers = config.layers_per_stage(cfg.num_layers)
    first = config.first_layer(stage, cfg.num_layers)
    last_stage = stage == config.pp - 1
    out: list[StageParam] = []
    tail: list[StageParam] = []
    for spec in param_specs(cfg):
        if spec.layer is not None:
            if first <= spec.layer < first + layers[stage]:
                out.append(StageParam(spec.mcore.replace("{i}", str(spec.layer - first)), spec))
            continue
        stages = spec.leaf.layout.stage.stages(config.pp, lambda layer: 0)
        if stage not in stages:
            continue
        shared = cfg.tied and config.pp > 1 and spec.mcore == "embedding.word_embeddings.weight"
        if shared and last_stage:
            tail.append(StageParam("output_layer.weight", spec, True))
        else:
            out.append(StageParam(spec.mcore, spec, shared))
    return out + tail


def named_params(model_chunks, cfg: MegatronConfig, config: ParallelConfig, stage: int) -> dict:
    """``{tree path: parameter}`` of this rank's model chunk.

    Args:
        model_chunks: the model chunks (DDP-wrapped, ``Float16Module`` or bare
            ``GPTModel``); one chunk (no virtual pipeline).
        cfg, config, stage: the model, the parallel config and this rank's stage.

    Raises:
        ShardError: the chunk's parameters are not those the model config says
            this stage holds (names listed).
    """
    from megatron.core.utils import unwrap_model

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if len(chunks) != 1:
        raise ShardError(f"expected one model chunk (no virtual pipeline), found {len(chunks)}")
    params = {n: p for n, p in unwrap_model(chunks[0]).named_parameters() if p.requires_grad}
    expected = stage_params(cfg, config, stage)
    names = [s.name for s in expected]
    if sorted(names) != sorted(params):
        raise ShardError(f"stage {stage} at {config}: the model's parameters do not match the "
                         f"model config: missing {sorted(set(names) - set(params))}, "
                         f"unexpected {sorted(set(params) - set(names))}")
    return {s.spec.path: params[s.name] for s in expected}
