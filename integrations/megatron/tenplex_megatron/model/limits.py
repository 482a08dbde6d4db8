"""Bounds on the numbers a Megatron checkpoint's ``args`` may state (issue 20).

The args size loops and trees: a degree sizes the rank grid that is walked,
``num_layers`` and ``num_experts`` the leaves built per layer and expert. A
file that states ``ep=2**40`` or ``num_layers=2**24`` would hang or exhaust
memory before any tensor is read, so every count is checked first against
what can exist (:mod:`tenplex.limits`, stated in ``docs/guide.md``), with one
error that names the file and the field.
"""

from __future__ import annotations

import argparse
from typing import Any

from tenplex.errors import ConfigError
from tenplex.limits import (MAX_DEGREE, MAX_EXPERTS, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_VOCAB,
                            MAX_WORLD, check_count)

__all__ = ["ARG_LIMITS", "SCALARS", "check_args", "check_fields", "check_scalars"]

SCALARS = ("megatron/iteration", "megatron/checkpoint_version", "megatron/num_floating_point_operations_so_far")
"""Values a Megatron file states as scalars, kept as they are."""

_DEGREES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
            "virtual_pipeline_model_parallel_size")
ARG_LIMITS: dict[str, int] = {
    **{name: MAX_DEGREE for name in _DEGREES}, "world_size": MAX_WORLD,
    "num_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS, "num_moe_experts": MAX_EXPERTS,
    "num_attention_heads": MAX_HEADS, "num_query_groups": MAX_HEADS,
    "vocab_size": MAX_VOCAB, "padded_vocab_size": MAX_VOCAB, "make_vocab_size_divisible_by": MAX_VOCAB,
    "vocab_padded_from": MAX_VOCAB,
    "hidden_size": MAX_HIDDEN, "ffn_hidden_size": MAX_HIDDEN, "kv_channels": MAX_HIDDEN,
    "moe_ffn_hidden_size": MAX_HIDDEN, "moe_shared_expert_intermediate_size": MAX_HIDDEN,
    "max_position_embeddings": MAX_HIDDEN * 64, "seq_length": MAX_HIDDEN * 64,
}
"""``{args field: largest value}``; each field, where set (not None), must be an int in ``[0, limit]``."""


def check_fields(values: dict, where: str) -> None:
    """Check each field of ``values`` named in :data:`ARG_LIMITS`.

    Raises:
        ConfigError: ``"{where}: args.<field>: expected an integer in [0, limit], found ..."``.
    """
    for name, hi in ARG_LIMITS.items():
        value = values.get(name)
        if value is not None:
            check_count(value, f"{where}: args.{name}", hi, error=ConfigError)


def check_args(args: Any, where: str) -> None:
    """:func:`check_fields` of Megatron's ``args`` (a Namespace, a mapping, or None)."""
    if args is None:
        return
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: args: expected a Namespace or a mapping, found {type(args).__name__}")
    check_fields(values, where)


def check_scalars(values: dict, names: tuple[str, ...], where: str) -> None:
    """Each of ``values[name]`` is None, a bool, a number or a short string (a value a file states
    as a scalar, such as ``checkpoint_version``, kept as-is in the tree's values).

    Raises:
        ConfigError: naming ``where`` and the field, with a bounded description of what was found.
    """
    from tenplex.limits import short
    for name in names:
        value = values.get(name)
        ok = value is None or type(value) in (bool, float) or (type(value) is int and value.bit_length() < 64) \
            or (type(value) is str and len(value) <= 256)
        if not ok:
            raise ConfigError(f"{where}: {name.split('/')[-1]}: expected a number, found {short(value)}")
