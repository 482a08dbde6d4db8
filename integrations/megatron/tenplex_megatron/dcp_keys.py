"""The keys of a megatron-core ``torch_dist`` checkpoint, and what each must hold.

Tensors are global (model space), layers stacked on a leading axis, norms
under TE-style names (:mod:`tenplex_megatron.layouts`). Optimizer state is
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` (``fully_reshardable``)
or flat buffers per model-parallel rank and bucket (``dp_reshardable``,
:mod:`tenplex_megatron.flatbuf`). Byte objects are megatron-core
``ShardedObject`` s, stored under ``<key>/shard_<offset>_<shape>``
(``dist_checkpointing/mapping.py::ShardedObject.unique_key``):
``<linear>._extra_state/shard_<layer>_<L>``, Megatron-LM's
``rng_state/shard_<pp>.<tp>_<PP>.<TP>`` and the ``dp_reshardable``
bookkeeping objects.
"""

from __future__ import annotations

import json
import os
import re

from tenplex.errors import ConfigError, TenplexError
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.layouts import OPTIMIZER_STATES, extra_state_keys, param_specs
from tenplex_megatron.safe_load import open_regular

__all__ = ["is_dist", "expected_tensors", "classify", "flat_key", "object_key", "rng_key", "RNG_KEY", "FLAT_KEY",
           "EXTRA_KEY", "OBJECT_KEY", "DP_OBJECTS", "extra_state_modules"]

FLAT_KEY = re.compile(r"(?:chained_[01]\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                      r"dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.(\w+)$")
OBJECT_KEY = re.compile(r"(?:chained_[01]\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_0_1$")
EXTRA_KEY = re.compile(r"(.+)\._extra_state/shard_(\d+)(?:\.(\d+))?_(\d+)(?:\.(\d+))?$")
"""``<module>._extra_state/shard_<layer>[.<expert>]_<L>[.<E>]`` (experts stacked on a second axis)."""
RNG_KEY = re.compile(r"rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")
DP_OBJECTS = ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")


def is_dist(root: str) -> bool:
    """Whether ``root`` is a ``torch_dist`` directory (its ``metadata.json`` says so)."""
    try:
        f, _ = open_regular(os.path.join(root, "metadata.json"), "metadata.json")
        with f:
            return json.loads(f.read(4096)).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError, TenplexError):
        return False


def flat_key(m: int, bucket: int, state: str, dtypes, gbuf: int = 0) -> str:
    """The DCP key of one ``dp_reshardable`` bucket: ``dp_group_idx`` ``m``, buffer ``gbuf``, ``bucket``,
    ``state`` (without a ``chained_<i>.`` prefix; see :mod:`tenplex_megatron.dcp_buffers`)."""
    return (f"optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{gbuf}.dtype_({dtypes[0]}, {dtypes[1]})."
            f"bucket_idx_{bucket}.{state}")


def object_key(m: int, name: str) -> str:
    return f"optimizer.distributed.dp_group_idx_{m}.{name}/shard_0_1"


def rng_key(tp_rank: int, pp_rank: int, tp: int, pp: int) -> str:
    """Megatron-LM's ``ShardedObject('rng_state', ..., (pp, tp), (pp_rank, tp_rank))`` key."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def expected_tensors(cfg: MegatronConfig, sharding: Sharding, optim: str | None
                     ) -> dict[str, tuple[tuple[int, ...], str, str, int | None]]:
    """``{DCP key: (global shape, dtype name, tree path, layer)}`` of the model (and model-space optimizer).

    Optimizer state is ``optimizer.state.<state>.<key>``: Adam's moments and fp32 main
    params (``optim="fully_reshardable"``), or the moments alone for a non-distributed
    optimizer over fp32 params (``optim="adam"``, megatron-core ``FP32Optimizer``: the
    main params are the model's).

    Shapes are padded at ``sharding.config``'s tp; layer tensors are stacked
    ``[num_layers, ...]`` and ``layer`` is set for each layer's path (one key
    holds every layer, so the returned path is layer 0's). Expert tensors are
    stacked ``[num_layers, num_moe_experts, ...]`` by global expert id under
    ``decoder.layers.mlp.experts.experts.*`` (megatron-core
    ``SequentialMLP.sharded_state_dict``; the path returned is expert 0's).

    Raises:
        ConfigError: for MoE layers that are not all alike (``moe_layer_freq``):
            megatron-core then writes per-layer keys, which tenplex does not read yet.
    """
    if not cfg.homogeneous:
        raise ConfigError(f"moe_layer_freq={cfg.moe_layer_freq}: torch_dist then uses per-layer keys "
                          "(decoder.layers.<l>.*), which tenplex does not read or write yet; use the "
                          "legacy format")
    out: dict = {}
    states = {"fully_reshardable": OPTIMIZER_STATES, "adam": ("exp_avg", "exp_avg_sq")}.get(optim or "", ())
    prefixes = [("", None)] + [(f"optimizer.state.{s}.", s) for s in states]
    for spec in param_specs(cfg):
        if spec.layer not in (None, 0) or spec.expert not in (None, 0):
            continue
        shape = sharding.physical_shape(spec.leaf)
        if spec.expert is not None:
            shape = (cfg.num_moe_experts,) + shape
        if spec.layer is not None:
            shape = (cfg.num_layers,) + shape
        for prefix, state in prefixes if spec.param else prefixes[:1]:
            dtype = spec.leaf.dtype if state is None else "float32"
            out[prefix + spec.dist] = (shape, dtype, spec.path, spec.layer)
    return out


def extra_state_modules(cfg: MegatronConfig) -> dict[str, bool]:
    """``{module: stacked over experts}`` of the ``_extra_state`` objects a homogeneous model stores."""
    out = {"output_layer": False}
    for key in extra_state_keys(cfg, 0, 1):
        module = key.removesuffix("._extra_state").replace(".{i}", "")
        if ".local_experts." in module:
            out[re.sub(r"local_experts\.\d+\.", "experts.", module)] = True
        elif module.endswith(("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")):
            out[module.replace("mlp.experts.", "mlp.experts.experts.")] = True
        else:
            out[module] = False
    return out


def classify(key: str) -> str:
    """``"flat"``, ``"dp_object"``, ``"extra_state"``, ``"rng"`` or ``"other"`` for a DCP key."""
    for name, pattern in (("flat", FLAT_KEY), ("dp_object", OBJECT_KEY), ("rng", RNG_KEY),
                          ("extra_state", EXTRA_KEY)):
        if pattern.match(key):
            return name
    return "other"
