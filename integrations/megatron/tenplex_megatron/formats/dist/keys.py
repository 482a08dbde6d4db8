"""The keys of a megatron-core ``torch_dist`` checkpoint, and what each must hold.

Tensors are global (model space), layers stacked on a leading axis, or
keyed one by one (``decoder.layers.<l>.*``) when ``moe_layer_freq`` mixes
dense and MoE layers (:func:`dist_key`); norms under TE-style names
(:mod:`tenplex_megatron.model.layouts`). Optimizer state is
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` (``fully_reshardable``;
a non-distributed optimizer: :func:`optimizer_prefix`) or flat buffers per
model-parallel rank and bucket (``dp_reshardable``,
:mod:`tenplex_megatron.model.flatbuf`). Byte objects are megatron-core
``ShardedObject`` s, stored under ``<key>/shard_<offset>_<shape>``
(``dist_checkpointing/mapping.py::ShardedObject.unique_key``):
``<linear>._extra_state/shard_<layer>_<L>`` (:func:`extra_state_objects`), Megatron-LM's
``rng_state/shard_<pp>.<tp>[.<dp>]_<PP>.<TP>[.<DP>]`` (:func:`rng_objects`) and the ``dp_reshardable``
bookkeeping objects.
"""

from __future__ import annotations

import os
import re

from tenplex.errors import TenplexError
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.model.derived import derived
from tenplex_megatron.formats.dist.model_space import MODEL_SPACE, model_space_shape
from tenplex_megatron.formats.folders import locate, sharded_backend
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import NAMES, OPTIMIZER_STATES, ParamSpec, extra_state_keys, param_specs

__all__ = ["COMMON_STATE", "dist_names", "is_dist", "expected_tensors", "classify", "flat_key", "object_key", "rng_key", "RNG_KEY", "FLAT_KEY",
           "optimizer_prefix", "optimizer_states", "chain_prefix", "rng_objects",
           "EXTRA_KEY", "OBJECT_KEY", "DP_OBJECTS", "extra_state_objects",
           "known_extra_state", "dist_key"]

FLAT_KEY = re.compile(r"(?:chained_[01]\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                      r"dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.(\w+)$")
OBJECT_KEY = re.compile(r"(?:chained_[01]\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_0_1$")
EXTRA_KEY = re.compile(r"(.+)\._extra_state/shard_(\d+)(?:\.(\d+))?_(\d+)(?:\.(\d+))?$")
"""``<module>._extra_state/shard_<layer>[.<expert>]_<L>[.<E>]`` (experts stacked on a second axis)."""
RNG_KEY = re.compile(r"rng_state/shard_(\d+)\.(\d+)(?:\.(\d+))?_(\d+)\.(\d+)(?:\.(\d+))?$")
"""``rng_state/shard_<pp>.<tp>_<PP>.<TP>``, or ``shard_<pp>.<tp>.<dp>_<PP>.<TP>.<DP>`` (:func:`rng_key`)."""
DP_OBJECTS = ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")
COMMON_STATE = "common_state/shard_0_1"
"""megatron-core 0.19's common state: ``ShardedObject("common_state", [common dict], (1,), (0,))``
in place of ``common.pt`` (:func:`tenplex_megatron.formats.dist.read.read_common`)."""


def is_dist(path: str) -> bool:
    """Whether ``path`` (a ``--save`` root, an iteration folder or a bare folder) holds a ``torch_dist``
    checkpoint: its folder's ``metadata.json`` says ``sharded_backend: torch_dist``
    (:func:`tenplex_megatron.formats.folders.locate`, :func:`~tenplex_megatron.formats.folders.sharded_backend`)."""
    try:
        return sharded_backend(locate(path).dir) == "torch_dist"
    except (OSError, TenplexError):
        return False


def dist_names(cfg: MegatronConfig, keys) -> str:
    """The naming scheme (:data:`~tenplex_megatron.model.layouts.NAMES`) of a ``torch_dist``
    checkpoint's ``keys``, which tells its layer spec.

    Dense layers have the same tensor keys under both specs (megatron-core's local spec renames its
    norms to TE's names in ``sharded_state_dict``). The keys decide where they differ: ``"te"``
    when an MoE layer's norm is TE's separate ``pre_mlp_layernorm`` or attention has TE's
    ``core_attention._extra_state``; ``"local"`` when an MoE layer's norm has the local spec's
    renamed key. Otherwise the args decide (``cfg.transformer_impl``, Megatron-LM's
    ``--transformer-impl``, whose default is TE)."""
    specs = param_specs(cfg)
    found = {k.split("/")[0] for k in keys}
    per_layer = found | {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", k) for k in found}
    if {spec.te_dist for spec in specs if spec.te_dist} & per_layer or any(
            ".core_attention._extra_state" in k for k in per_layer):
        return "te"
    moe_norm = {spec.dist for spec in specs if spec.te_dist}  # the local spec's key of the MoE norm
    if moe_norm & per_layer:
        return "local"
    return "te" if cfg.transformer_impl == "transformer_engine" else "local"


def flat_key(m: int, bucket: int, state: str, dtypes, gbuf: int = 0) -> str:
    """The DCP key of one ``dp_reshardable`` bucket: ``dp_group_idx`` ``m``, buffer ``gbuf``, ``bucket``,
    ``state`` (without a ``chained_<i>.`` prefix; see :mod:`tenplex_megatron.formats.dist.buffers`)."""
    return (f"optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{gbuf}.dtype_({dtypes[0]}, {dtypes[1]})."
            f"bucket_idx_{bucket}.{state}")


def object_key(m: int, name: str) -> str:
    return f"optimizer.distributed.dp_group_idx_{m}.{name}/shard_0_1"


def rng_key(tp_rank: int, pp_rank: int, tp: int, pp: int, dp_rank: int | None = None, dp: int = 1) -> str:
    """Megatron-LM's ``ShardedObject('rng_state', ..., (pp, tp), (pp_rank, tp_rank))`` key, or with
    ``dp_rank`` its ``(pp, tp, dp)`` grid's (``dp`` = the dp-cp group's size; see :func:`rng_objects`)."""
    if dp_rank is None:
        return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"
    return f"rng_state/shard_{pp_rank}.{tp_rank}.{dp_rank}_{pp}.{tp}.{dp}"


def rng_objects(states: list, t: int, p: int, to, dp_random_init: bool) -> list[tuple[str, list]]:
    """The ``(key, rng_state_list)`` objects of coordinate (``t``, ``p``) in a ``torch_dist`` target at ``to``.

    ``states`` is the coordinate's state by dp-cp rank (``TargetValues.rng_states(per_dp=...)``).
    Megatron-LM's ``get_rng_state`` shards RNG state on the (pp, tp) grid, replicated over the
    dp-cp ranks, except core_v0.16.0 and 0.16.1 at ep > 1: there on the (pp, tp, dp-cp) grid, one
    object per rank (#2658; 0.17.0 reverted it, #3736; Megatron-Bridge keeps it). Each version
    loads only its own form, and ignores keys it does not ask for (the default
    ``--dist-ckpt-strictness assume_ok_unexpected``), so at ep > 1 both are written: dp-cp rank 0's
    state under the (pp, tp) key, and each rank's under its (pp, tp, dp) key. A rank's
    ``rng_state_list`` is ``[its state]``, or with ``data_parallel_random_init`` every dp rank's.
    """
    own = (lambda d: states) if dp_random_init else (lambda d: [states[d]])
    out = [(rng_key(t, p, to.tp, to.pp), own(0))]
    if to.ep > 1:
        size = to.dp * to.cp
        out += [(rng_key(t, p, to.tp, to.pp, d, size), own(d)) for d in range(size)]
    return out


def dist_key(cfg: MegatronConfig, spec: ParamSpec, names: str = "local"
             ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The DCP key of ``spec``'s tensor, its leading coordinates in it and their sizes.

    A layer's tensor is stacked on a leading layer axis (``decoder.layers.mlp.linear_fc1.weight``,
    coordinate ``(layer,)`` of ``num_layers``), or keyed by its global layer
    (``decoder.layers.3.mlp.linear_fc1.weight``, no layer axis) when
    :attr:`MegatronConfig.dist_per_layer`. An expert's tensor is then stacked on a global
    expert axis (coordinate ``expert`` of ``num_moe_experts``), as megatron-core's
    ``SequentialMLP.sharded_state_dict`` prepends it.
    """
    key, lead, sizes = spec.dist_name(names), (), ()
    if spec.layer is not None:
        if cfg.dist_per_layer:
            key = f"decoder.layers.{spec.layer}.{key.removeprefix('decoder.layers.')}"
        else:
            lead, sizes = (spec.layer,), (cfg.num_layers,)
    if spec.expert is not None:
        lead, sizes = lead + (spec.expert,), sizes + (cfg.num_moe_experts,)
    return key, lead, sizes


def optimizer_prefix(optim: str | None, state: str, params_dtype: str) -> str:
    """The DCP key prefix of optimizer state ``state`` (``param``, ``exp_avg``, ``exp_avg_sq``): the
    model key follows it.

    - distributed optimizer, ``fully_reshardable``: ``optimizer.state.<state>.``;
    - distributed optimizer, ``fully_sharded_model_space`` (megatron-core <= 0.13): the same, but
      ``optimizer.state.fp32_param.`` for the main params;
    - non-distributed optimizer (``optim="adam"``): moments as above; the fp32 main params are the
      model's own tensors (prefix ``""``) over fp32 params (megatron-core ``FP32Optimizer``), and
      ``optimizer.state.fp32_param.`` over bf16/fp16 params (``Float16OptimizerWithFloat16Params.
      sharded_state_dict`` makes them from ``fp32_from_fp16_params`` with that prefix).
    """
    if optim == "adam" and state == "param":
        return "" if params_dtype == "float32" else "optimizer.state.fp32_param."
    if optim == MODEL_SPACE and state == "param":
        return "optimizer.state.fp32_param."
    return f"optimizer.state.{state}."


def chain_prefix(spec: ParamSpec) -> str:
    """``chained_0.`` (dense) or ``chained_1.`` (an expert): what megatron-core <= 0.13's
    ``ChainedOptimizer.sharded_state_dict`` put before each sub-optimizer's keys at ep > 1 (0.14
    added ``chained_optim_avoid_prefix``)."""
    return f"chained_{0 if spec.expert is None else 1}."


def optimizer_states(optim: str | None, params_dtype: str) -> tuple[str, ...]:
    """The optimizer states stored under their own keys (:func:`optimizer_prefix`): all three for the
    distributed optimizer (``fully_reshardable``) and for a non-distributed one over bf16/fp16
    params; the moments alone over fp32 params; none otherwise (``dp_reshardable`` is flat)."""
    if optim in ("fully_reshardable", MODEL_SPACE) or (optim == "adam" and params_dtype != "float32"):
        return OPTIMIZER_STATES
    return ("exp_avg", "exp_avg_sq") if optim == "adam" else ()


def expected_tensors(cfg: MegatronConfig, sharding: Sharding, optim: str | None, names: str = "local",
                     chained_prefix: bool = False) -> dict[str, tuple[tuple[int, ...], str, str, int | None]]:
    """``{DCP key: (global shape, dtype name, tree path, layer)}`` of the model (and model-space optimizer).

    Optimizer state is keyed as :func:`optimizer_prefix` says, for the states of
    :func:`optimizer_states`; ``fully_sharded_model_space`` state has the reformulated shape of
    :func:`~tenplex_megatron.formats.dist.model_space.model_space_shape`, and with
    ``chained_prefix`` :func:`chain_prefix` before its key.

    Shapes are padded at ``sharding.config``'s tp, with the leading axes of
    :func:`dist_key`: layers stacked ``[num_layers, ...]`` (one key holds every
    layer, so the returned path and layer are layer 0's) or one key per layer
    (:attr:`MegatronConfig.dist_per_layer`); expert tensors stacked
    ``[num_moe_experts, ...]`` by global expert id under
    ``...mlp.experts.experts.*`` (megatron-core ``SequentialMLP.sharded_state_dict``;
    the path returned is expert 0's).
    """
    out: dict = {}
    prefixes = [("", None)] + [(optimizer_prefix(optim, s, cfg.params_dtype), s)
                               for s in optimizer_states(optim, cfg.params_dtype)]
    for spec in param_specs(cfg):
        if spec.expert not in (None, 0) or (spec.layer not in (None, 0) and not cfg.dist_per_layer):
            continue
        key, _, lead_sizes = dist_key(cfg, spec, names)
        shape = lead_sizes + sharding.physical_shape(spec.leaf)
        for prefix, state in prefixes if spec.param else prefixes[:1]:
            dtype = spec.leaf.dtype if state is None else "float32"
            stored = shape if state is None or optim != MODEL_SPACE else \
                lead_sizes + model_space_shape(sharding, spec.leaf, prefix + key)
            chain = chain_prefix(spec) if state is not None and chained_prefix else ""
            out[chain + prefix + key] = (stored, dtype, spec.path, spec.layer)
    return out


def _layer_extra_modules(cfg: MegatronConfig, layer: int, names: str = "local") -> dict[str, bool]:
    """``{module (stacked-key form): stacked over experts}`` of global layer ``layer``'s extra states."""
    out = {}
    for key in extra_state_keys(cfg, layer, 1, names):
        module = key.removesuffix("._extra_state").replace(".{i}", "")
        if ".local_experts." in module:
            out[re.sub(r"local_experts\.\d+\.", "experts.", module)] = True
        elif module.endswith(("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")):
            out[module.replace("mlp.experts.", "mlp.experts.experts.")] = True
        else:
            out[module] = False
    return out


def extra_state_objects(cfg: MegatronConfig, layer: int, names: str = "local") -> list[str]:
    """The DCP keys of global layer ``layer``'s ``_extra_state`` objects (megatron-core ``ShardedObject`` s).

    Stacked layers: ``<module>._extra_state/shard_<layer>_<L>``, an expert's
    ``shard_<layer>.<expert>_<L>.<E>``. Per-layer keys
    (:attr:`MegatronConfig.dist_per_layer`): ``decoder.layers.<layer>.<module>._extra_state/shard_0_1``,
    an expert's ``shard_<expert>_<E>`` (run with megatron-core 0.16.1, NOTES section 8).
    """
    L, E, out = cfg.num_layers, cfg.num_moe_experts, []
    for module, stacked in _layer_extra_modules(cfg, layer, names).items():
        if cfg.dist_per_layer:
            module = f"decoder.layers.{layer}.{module.removeprefix('decoder.layers.')}"
            shards = [f"{g}_{E}" for g in range(E)] if stacked else ["0_1"]
        else:
            shards = [f"{layer}.{g}_{L}.{E}" for g in range(E)] if stacked else [f"{layer}_{L}"]
        out += [f"{module}._extra_state/shard_{s}" for s in shards]
    return out


def _all_extra_objects(cfg: MegatronConfig) -> frozenset:
    return derived(cfg, "extra_objects", lambda: _make_all_extra_objects(cfg))


def _make_all_extra_objects(cfg: MegatronConfig) -> frozenset:
    """Every extra-state object of either naming scheme (TE adds ``core_attention``'s)."""
    return frozenset(k for layer in range(cfg.num_layers) for names in NAMES
                     for k in extra_state_objects(cfg, layer, names))


def known_extra_state(cfg: MegatronConfig, key: str) -> bool:
    """Whether ``key`` names an ``_extra_state`` object the model has (:func:`extra_state_objects`;
    with stacked layers also ``output_layer._extra_state/shard_<l>_<L>``)."""
    if key in _all_extra_objects(cfg):
        return True
    m = EXTRA_KEY.match(key)
    return not cfg.dist_per_layer and m is not None and m.group(1) == "output_layer" \
        and m.group(3) is None and int(m.group(4)) == cfg.num_layers and int(m.group(2)) < cfg.num_layers


def classify(key: str) -> str:
    """``"flat"``, ``"dp_object"``, ``"extra_state"``, ``"rng"`` or ``"other"`` for a DCP key."""
    for name, pattern in (("flat", FLAT_KEY), ("dp_object", OBJECT_KEY), ("rng", RNG_KEY),
                          ("extra_state", EXTRA_KEY)):
        if pattern.match(key):
            return name
    return "other"
