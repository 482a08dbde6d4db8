"""TransformerEngine's extra states in the legacy files of the worker's ``--names te`` models.

The model has TE's layer structure and names (te_spec.py). What it lacks is TE's ``_extra_state``
values: TE's modules return an empty uint8 tensor without FP8 (megatron-core's local linears give
None), and ``TEDotProductAttention`` has one too. These put them in a saved state dict and take
them out again before megatron-core loads it.
"""

from __future__ import annotations


def to_te_names(state: dict) -> dict:
    """A state dict with TE's extra states: every ``_extra_state`` an empty uint8 tensor (TE's
    ``get_extra_state`` without FP8), plus ``self_attention.core_attention._extra_state``."""
    import torch

    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            value = torch.empty(0, dtype=torch.uint8)
            if key.endswith(".self_attention.linear_proj._extra_state"):
                out[key.replace("linear_proj", "core_attention")] = torch.empty(0, dtype=torch.uint8)
        out[key] = value
    return out


def from_te_names(state: dict) -> dict:
    """:func:`to_te_names` undone, for loading into the worker's model (extra states must be empty)."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            assert value is None or value.numel() == 0, (key, value)
            if ".core_attention." in key:
                continue
            value = None
        out[key] = value
    return out
