"""TransformerEngine's key names for the worker's local-spec models (``--names te``).

Megatron-LM with ``--transformer-impl transformer_engine`` saves legacy files and torch_dist keys under
the TE spec's names; these map the local spec's keys to them and back, from megatron-core's own map.
"""

from __future__ import annotations


def te_prefixes(model) -> dict[str, str]:
    """``{local key prefix: TransformerEngine key prefix}`` of every layer of ``model`` (chunk-local).

    Taken from megatron-core's own map, each layer's ``submodules_config.sharded_state_dict_keys_map``
    (core_v0.16.1 ``get_gpt_layer_local_spec``: ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``,
    ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``), which renames the local spec's keys to
    the TE spec's. An MoE layer's ``pre_mlp_layernorm`` is its own module in the TE spec
    (``get_gpt_layer_with_transformer_engine_spec``: ``pre_mlp_layernorm=backend.layer_norm() if
    num_experts``), so there only the attention norm is renamed.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out = {}
    for i, layer in enumerate(model.decoder.layers):
        for local, te in layer.submodules_config.sharded_state_dict_keys_map.items():
            if local == "pre_mlp_layernorm." and isinstance(layer.mlp, MoELayer):
                continue
            out[f"decoder.layers.{i}.{local}"] = f"decoder.layers.{i}.{te}"
    return out


def use_te_dist_names(model) -> None:
    """Make ``model.sharded_state_dict`` use the TE spec's torch_dist keys: each layer's keys map
    without the entries :func:`te_prefixes` drops (an MoE layer's separate ``pre_mlp_layernorm``)."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.decoder.layers:
        keep = {k: v for k, v in layer.submodules_config.sharded_state_dict_keys_map.items()
                if not (k == "pre_mlp_layernorm." and isinstance(layer.mlp, MoELayer))}
        layer.submodules_config = dataclasses.replace(layer.submodules_config, sharded_state_dict_keys_map=keep)


def to_te_names(state: dict, prefixes: dict) -> dict:
    """A local-spec model state dict under TE's names, as a TE model's ``state_dict`` holds them: norms
    renamed by ``prefixes``; every ``_extra_state`` an empty uint8 tensor (TE's ``get_extra_state``
    without FP8), plus ``self_attention.core_attention._extra_state`` (``TEDotProductAttention``)."""
    import torch

    out = {}
    for key, value in state.items():
        for local, te in prefixes.items():
            if key.startswith(local):
                key = te + key[len(local):]
                break
        if key.endswith("._extra_state"):
            value = torch.empty(0, dtype=torch.uint8)
            if key.endswith(".self_attention.linear_proj._extra_state"):
                out[key.replace("linear_proj", "core_attention")] = torch.empty(0, dtype=torch.uint8)
        out[key] = value
    return out


def from_te_names(state: dict, prefixes: dict) -> dict:
    """:func:`to_te_names` undone, for loading into the local-spec model (extra states must be empty)."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            assert value is None or value.numel() == 0, (key, value)
            if ".core_attention." in key:
                continue
            value = None
        for local, te in prefixes.items():
            if key.startswith(te):
                key = local + key[len(te):]
                break
        out[key] = value
    return out
