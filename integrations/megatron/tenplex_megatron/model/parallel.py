"""The parallel config a Megatron checkpoint was saved at, read from Megatron's ``args``."""

from __future__ import annotations

import argparse

from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.model.config import stage_layers

__all__ = ["arg", "parallel_config"]


def arg(a: dict, name: str, default=None):
    """``a[name]``, or ``default`` where it is missing or None (Megatron leaves unset args None)."""
    value = a.get(name)
    return default if value is None else value


def parallel_config(args, tp: int, pp: int) -> ParallelConfig:
    """The saver's parallel config: ``tp``, ``pp`` and the args' cp, ep, etp, vpp and uneven stages.

    dp is the args' ``data_parallel_size``, raised to what the expert grid
    needs (``etp * ep * pp`` must divide the world); Megatron files hold
    tensors gathered over dp, so dp sizes nothing on disk.

    Raises:
        ConfigError: the degrees do not form a config.
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    cp = arg(a, "context_parallel_size", 1)
    ep = arg(a, "expert_model_parallel_size", 1)
    etp = arg(a, "expert_tensor_parallel_size", tp)
    vpp = arg(a, "virtual_pipeline_model_parallel_size", 1)
    dp = arg(a, "data_parallel_size", 1)
    while (dp * tp * cp * pp) % (etp * ep * pp):
        dp += 1
    layers = a.get("num_layers")
    stages = stage_layers(args, int(layers), pp) if layers else None
    return ParallelConfig(dp, tp, pp, stage_layers=stages, cp=cp, ep=ep, etp=etp, vpp=vpp)
