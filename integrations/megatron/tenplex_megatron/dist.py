"""megatron-core ``dist_checkpointing`` directories (``torch_dist``), read and written.

A directory holds PyTorch DCP files (``.metadata``, ``__R_I.distcp``),
``common.pt`` (the non-sharded part: iteration, scheduler, optimizer param
groups, args) and ``metadata.json``. Tensors are global, with layers stacked
on a leading axis and norms under TE-style names (see
:mod:`tenplex_megatron.layouts`). They are read with DCP's own reader.
Output is written with DCP's own writer, in a form that
``megatron.core.dist_checkpointing.load`` accepts. The ``_extra_state``
entries of the linears are written as per-layer byte objects holding
``[None]``, which is what megatron-core's local layers save.

Optimizer state: ``fully_reshardable`` keys
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` are model-space
tensors. ``dp_reshardable`` keys are whole flat buffers per model-parallel
rank and bucket (:mod:`tenplex_megatron.flatbuf`). Megatron itself
reshards ``dp_reshardable`` only across dp; tenplex reads it into model
space, so it reshards across tp, pp and dp.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tenplex.errors import AlreadyExistsError, ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble, materialize

from tenplex_megatron import rng
from tenplex_megatron.config import (MegatronConfig, args_to_json, json_to_args, stage_layers,
                                     uneven_args)
from tenplex_megatron.dcp_safe import SafeReader, read_objects
from tenplex_megatron.layouts import (EXTRA_STATE_LINEARS, OPTIMIZER_STATES, megatron_tree,
                                      optimizer_path, param_specs)
from tenplex_megatron.legacy import Loaded
from tenplex_megatron.safe_load import safe_load

__all__ = ["is_dist", "read_dist", "write_dist"]

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def is_dist(root: str) -> bool:
    try:
        with open(os.path.join(root, "metadata.json")) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


def read_dist(root: str, model_config: dict | None = None) -> Loaded:
    """Read a megatron-core ``torch_dist`` checkpoint directory.

    Args:
        root: the directory.
        model_config: a model config (JSON fields), whole or overriding ``common.pt``'s ``args``.

    Raises:
        ManifestError: not a ``torch_dist`` directory, a file that needs unsafe
            unpickling, or a missing tensor.
        ConfigError: no model config can be found.
    """
    if not is_dist(root):
        raise ManifestError(f"{root}: no metadata.json with sharded_backend 'torch_dist'")
    common = safe_load(os.path.join(root, "common.pt")) if os.path.exists(
        os.path.join(root, "common.pt")) else {}
    args = common.get("args")
    if model_config is None and args is None:
        raise ConfigError(f"{root}: common.pt has no args; pass the model config "
                          "(--model-config FILE.json, see docs/megatron.md)")
    cfg = MegatronConfig.from_args(args, model_config)
    tensors, objects = _load_tensors(root)
    optim_type = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if optim_type is None and any(k.startswith("optimizer.state.") for k in tensors):
        optim_type = "fully_reshardable"
    tp = getattr(args, "tensor_model_parallel_size", None) or _tp_for(cfg, tensors)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    config = ParallelConfig(1, tp, pp, stage_layers=stage_layers(args, cfg.num_layers, pp))
    tree = megatron_tree(cfg, optimizer=optim_type is not None)
    tree.validate(config)
    state = _model_state(cfg, config, tensors, root)
    if optim_type == "fully_reshardable":
        state.update(_fully_reshardable(cfg, config, tensors, root))
    elif optim_type == "dp_reshardable":
        from tenplex_megatron.flatbuf import read_dp_reshardable
        state.update(read_dp_reshardable(cfg, args, tensors, root))
        groups = next((v[0]["param_groups"] for k, v in objects.items()
                       if k.endswith(".optimizer/shard_0_1")), [])
        common.setdefault("optimizer", {})["optimizer"] = {"param_groups": groups}
    elif optim_type is not None:
        raise ManifestError(f"{root}: optimizer sharding type {optim_type!r} is not supported; "
                            "save with fully_reshardable or dp_reshardable")
    optimizer = common.get("optimizer") or {}
    values = {
        "megatron/iteration": common.get("iteration", 0),
        "megatron/checkpoint_version": common.get("checkpoint_version"),
        "megatron/args": args_to_json(args) if args is not None else None,
        "megatron/opt_param_scheduler": rng.encode(common.get("opt_param_scheduler")),
        "megatron/optimizer": rng.encode({"param_groups": (optimizer.get("optimizer") or {}).get(
            "param_groups", [])}) if optimizer else None,
        "megatron/num_floating_point_operations_so_far": common.get("num_floating_point_operations_so_far"),
        "megatron/rng_state": {},
    }
    shards = {r: materialize(tree, {**state, **values}, config, r) for r in range(config.world_size)}
    content = common.get("content_metadata") or {}
    meta = {"megatron": {"format": "dist", "config": cfg.to_json(), "optimizer": optim_type,
                         "content_metadata": rng.encode(content)}}
    return Loaded(cfg, config, tree, {r: {p: t for p, t in s.items() if isinstance(t, torch.Tensor)}
                                      for r, s in shards.items()}, values, meta)


def _load_tensors(root: str) -> tuple[dict[str, torch.Tensor], dict]:
    reader = SafeReader(root)
    md = reader.read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out, read_objects(root, md, "optimizer.")


def _tp_for(cfg: MegatronConfig, tensors: dict) -> int:
    """A tp whose padded vocabulary equals the stored one (1 if none does)."""
    rows = tensors["embedding.word_embeddings.weight"].shape[0]
    for tp in (1, 2, 4, 8, 16):
        if cfg.padded_vocab(tp) == rows:
            return tp
    return 1


def _get(tensors: dict, key: str, root: str) -> torch.Tensor:
    if key not in tensors:
        raise ManifestError(f"{root}: tensor {key} is missing")
    return tensors[key]


def _model_state(cfg, config, tensors, root, prefix: str = "") -> dict:
    state = {}
    padded = cfg.padded_vocab(config.tp)
    for spec in param_specs(cfg):
        t = _get(tensors, prefix + spec.dist, root)
        if spec.layer is not None:
            t = t[spec.layer]
        if spec.leaf.layout.padding is not None and t.shape[0] not in (spec.leaf.shape[0], padded):
            t = t[: spec.leaf.shape[0]]  # stored under another padding: keep the logical rows
        state[spec.path] = t.to(getattr(torch, spec.leaf.dtype)).contiguous() if not prefix \
            else t.float().contiguous()
    return state


def _fully_reshardable(cfg, config, tensors, root) -> dict:
    out = {}
    for name in OPTIMIZER_STATES:
        for path, t in _model_state(cfg, config, tensors, root, f"optimizer.state.{name}.").items():
            out[optimizer_path(name, path)] = t
    return out


def write_dist(path: str, url: str, reader, cfg: MegatronConfig, meta: dict,
               config: ParallelConfig | None = None, values: dict | None = None) -> None:
    """Write the tenplex store at ``url`` as a ``torch_dist`` directory at ``path``, atomically.

    Each target rank's shards are read from the store through the planner
    (``tenplex.load(url, config, rank)``). Optimizer state is written
    ``fully_reshardable`` (or ``dp_reshardable`` when the source used it).

    Raises:
        AlreadyExistsError: ``path`` exists.
    """
    from tenplex.api import load

    if os.path.exists(path):
        raise AlreadyExistsError(f"{path} exists; tenplex never overwrites a checkpoint in place")
    tree = reader.tree
    config = config or reader.config
    values = values if values is not None else reader.manifest.values
    base = {}
    for rank in range(config.world_size):
        c = config.coord(rank)
        if c.dp == 0:
            base[(c.tp, c.pp)] = load(url, config, rank)
    shards = {r: base[(config.coord(r).tp, config.coord(r).pp)] for r in range(config.world_size)}
    physical = assemble(tree, config, shards, padded=True, check_replicas=False)
    sd: dict[str, Any] = _stacked(cfg, physical, "")
    optim_type = meta.get("optimizer")
    if optim_type == "dp_reshardable":
        from tenplex_megatron.flatbuf import write_dp_reshardable
        groups = (rng.decode(values.get("megatron/optimizer")) or {}).get("param_groups")
        sd.update(write_dp_reshardable(cfg, config, shards, tree, groups))
    elif any(p.startswith("optimizer/") for p in tree.leaves):
        optim_type = "fully_reshardable"
        for name in OPTIMIZER_STATES:
            moved = {p.removeprefix(f"optimizer/{name}/"): t for p, t in physical.items()
                     if p.startswith(f"optimizer/{name}/")}
            sd.update(_stacked(cfg, {"model/" + k: v for k, v in moved.items()},
                               f"optimizer.state.{name}."))
    for linear in EXTRA_STATE_LINEARS:
        for layer in range(cfg.num_layers):
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            sd[f"decoder.layers.{linear}._extra_state/shard_{layer}_{cfg.num_layers}"] = buf
    _write_dir(path, sd, _common(values, cfg, config, optim_type, meta))


def _write_dir(path: str, sd: dict, common: dict) -> None:
    """Write a ``torch_dist`` directory at ``path`` atomically: a temporary directory, then a rename."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            dcp.save(sd, storage_writer=FileSystemWriter(tmp), planner=_RawBytesPlanner(),
                     no_dist=True)
        torch.save(common, os.path.join(tmp, "common.pt"))
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(METADATA_JSON, f)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _RawBytesPlanner(DefaultSavePlanner):
    """Writes ``io.BytesIO`` values as they are, as megatron-core's ``MCoreSavePlanner`` does
    (DCP's default planner would pickle them once more)."""

    def transform_object(self, write_item, object):
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def _stacked(cfg: MegatronConfig, physical: dict, prefix: str) -> dict:
    out: dict = {}
    layers: dict[str, list] = {}
    for spec in param_specs(cfg):
        t = physical[spec.path]
        if spec.layer is None:
            out[prefix + spec.dist] = t
        else:
            layers.setdefault(prefix + spec.dist, [None] * cfg.num_layers)[spec.layer] = t
    for key, items in layers.items():
        out[key] = torch.stack(items)
    return out


def _common(values: dict, cfg, config, optim_type, meta) -> dict:
    common: dict = {"content_metadata": {"singleton_local_shards": False,
                                         "chained_optim_avoid_prefix": True}}
    if optim_type:
        common["content_metadata"]["distrib_optim_sharding_type"] = optim_type
    if values.get("megatron/iteration") is not None:
        common["iteration"] = values["megatron/iteration"]
    if values.get("megatron/opt_param_scheduler") is not None:
        common["opt_param_scheduler"] = rng.decode(values["megatron/opt_param_scheduler"])
    optim = rng.decode(values.get("megatron/optimizer")) if values.get("megatron/optimizer") else None
    if optim_type == "fully_reshardable":
        groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g
                  for g in (optim or {}).get("param_groups", [])]
        common["optimizer"] = {"optimizer": {"param_groups": groups},
                               "param_state_sharding_type": "fully_reshardable"}
    elif optim_type == "dp_reshardable":
        common["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}
    if values.get("megatron/args"):
        args = json_to_args(values["megatron/args"])
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = config.tp, config.pp
        args.padded_vocab_size = cfg.padded_vocab(config.tp)
        vars(args).update(uneven_args(config.stage_layers))
        args.data_parallel_size = config.dp
        common["args"] = args
    return common


def reshard_dist(src: str, dst: str, to: ParallelConfig, model_config: dict | None = None) -> dict | None:
    """Reshard a ``torch_dist`` directory to ``to`` directly, or return None if it needs the planner.

    ``dist_checkpointing`` stores model-space (global) tensors, so a reshard
    between two ``torch_dist`` directories moves no regions. Only three things
    change with the config: the padded vocabulary rows (kept where both sides
    have them, zero-filled when new, dropped when gone), the ``args`` in
    ``common.pt``, and the layout-dependent ``dp_reshardable`` optimizer
    buffers. The last need the planner, so this returns None for them. The
    output is written to a temporary directory and renamed into place.

    Raises:
        ConfigError: ``to`` cannot hold the model.
        AlreadyExistsError: ``dst`` exists.
    """
    if os.path.exists(dst):
        raise AlreadyExistsError(f"{dst} exists; tenplex never overwrites a checkpoint in place")
    common = safe_load(os.path.join(src, "common.pt")) if os.path.exists(os.path.join(src, "common.pt")) else {}
    if (common.get("optimizer") or {}).get("param_state_sharding_type") == "dp_reshardable":
        return None
    args = common.get("args")
    if model_config is None and args is None:
        raise ConfigError(f"{src}: common.pt has no args; pass the model config "
                          "(--model-config FILE.json, see docs/megatron.md)")
    cfg = MegatronConfig.from_args(args, model_config)
    megatron_tree(cfg).validate(to)
    reader = SafeReader(src)
    md = reader.read_metadata()
    tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
               for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    padded = cfg.padded_vocab(to.tp)
    vocab_keys = {s.dist for s in param_specs(cfg) if s.leaf.layout.padding is not None}
    changes = []
    for key, t in list(tensors.items()):
        base = key.split("optimizer.state.", 1)[-1].split(".", 1)[-1] if key.startswith("optimizer.state.") else key
        if base in vocab_keys and t.shape[0] != padded:
            new = torch.zeros((padded,) + tuple(t.shape[1:]), dtype=t.dtype)
            rows = min(padded, t.shape[0])
            new[:rows] = t[:rows]
            changes.append(f"{key}: axis 0 padded {t.shape[0]} -> {padded} (logical {cfg.vocab_size}; "
                           f"{max(0, padded - t.shape[0])} rows zero-filled, {max(0, t.shape[0] - padded)} dropped)")
            tensors[key] = new
    sd: dict[str, Any] = dict(tensors)
    for key, obj in read_objects(src, md).items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        sd[key] = buf
    if args is not None:
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = to.tp, to.pp
        args.padded_vocab_size = padded
        vars(args).update(uneven_args(to.stage_layers))
        args.data_parallel_size = to.dp
        common["args"] = args
    _write_dir(dst, sd, common)
    import sys
    for line in changes:
        print(f"padding: {line}", file=sys.stderr)
    return {"padding": changes, "direct": True}
