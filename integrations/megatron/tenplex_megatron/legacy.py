"""Megatron-LM's per-rank checkpoint layout, read and written.

``ROOT/latest_checkpointed_iteration.txt`` names the iteration;
``ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds, for tp rank
``TT`` and pipeline rank ``PPP`` (suffix only when pp > 1), a dict with
``model``, ``optimizer``, ``opt_param_scheduler``, ``iteration``, ``args``,
``rng_state`` and ``checkpoint_version`` (Megatron-LM's
``megatron/training/checkpointing.py``). Layer indices in ``model`` are
stage-local. Files are read with :func:`safe_load` (no arbitrary unpickling).

The optimizer of a non-distributed Adam is mapped to parameters **by name**:
torch numbers parameters in ``param_groups`` order, and Megatron builds its
groups from ``named_parameters()`` (weight decay; no decay for biases and
norms, ``wd_mult == 0``), so each index is matched to its parameter's name.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from tenplex.errors import AlreadyExistsError, ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.config import (MegatronConfig, args_to_json, json_to_args, stage_layers,
                                     uneven_args)
from tenplex_megatron.layouts import (EXTRA_STATE_LINEARS, megatron_tree, optimizer_path,
                                      param_specs)
from tenplex_megatron import rng
from tenplex_megatron.safe_load import safe_load

__all__ = ["Loaded", "is_legacy", "read_legacy", "write_legacy", "rank_keys"]

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")


@dataclass
class Loaded:
    """A Megatron checkpoint in tenplex terms.

    Attributes:
        cfg: the model config.
        config: its parallel config (dp = 1: Megatron files hold dp rank 0's copy).
        tree: the tree (with optimizer leaves when the checkpoint has Adam state).
        shards: ``{rank: {path: local tensor}}`` for ``config`` (tensor leaves only).
        values: ``{path: value}`` for the value leaves.
        meta: format details to carry along (``{"megatron": {...}}``).
    """

    cfg: MegatronConfig
    config: ParallelConfig
    tree: Any
    shards: dict[int, dict[str, torch.Tensor]]
    values: dict[str, Any]
    meta: dict = field(default_factory=dict)


def is_legacy(root: str) -> bool:
    return os.path.isfile(os.path.join(root, TRACKER))


def _iteration_dir(root: str) -> tuple[str, int | str]:
    try:
        text = open(os.path.join(root, TRACKER)).read().strip()
    except FileNotFoundError:
        raise ManifestError(f"{root}: no {TRACKER}; not a Megatron-LM checkpoint") from None
    if text == "release":
        return os.path.join(root, "release"), "release"
    if not text.isdigit():
        raise ManifestError(f"{root}/{TRACKER}: expected an iteration number, found {text!r}")
    return os.path.join(root, f"iter_{int(text):07d}"), int(text)


def _rank_dirs(iter_dir: str) -> dict[tuple[int, int], str]:
    if not os.path.isdir(iter_dir):
        raise ManifestError(f"{iter_dir}: the iteration directory named by {TRACKER} is missing")
    found = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m:
            found[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, name)
    if not found:
        raise ManifestError(f"{iter_dir}: no mp_rank_* directories")
    return found


def _dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def rank_keys(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int) -> dict[str, list[str]]:
    """``{tree path: [accepted state-dict keys, megatron-core first]}`` on pipeline stage ``pp_rank``."""
    first = config.first_layer(pp_rank, cfg.num_layers)
    last = pp_rank == config.pp - 1
    out: dict[str, list[str]] = {}
    for spec in param_specs(cfg):
        stages = spec.leaf.layout.stage.stages(config.pp, lambda l: config.stage_of_layer(l, cfg.num_layers))
        if pp_rank not in stages:
            continue
        local = {"i": spec.layer - first} if spec.layer is not None else {}
        keys = [spec.mcore.format(**local)] + [k.format(**local) for k in spec.legacy]
        if spec.path.endswith("word_embeddings/weight") and last and config.pp > 1 and cfg.tied:
            keys = (keys if pp_rank == 0 else []) + ["output_layer.weight", "word_embeddings_for_head.weight"]
        out[spec.path] = keys
    return out


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_legacy(root: str, model_config: dict | None = None) -> Loaded:
    """Read a Megatron-LM per-rank checkpoint.

    Args:
        root: the checkpoint root (holding ``latest_checkpointed_iteration.txt``).
        model_config: a model config (JSON fields), whole or overriding the files' ``args``.

    Raises:
        ManifestError: a missing tracker, iteration or ``mp_rank_*`` directory, a
            file that needs unsafe unpickling, a missing or unexpected key.
        ConfigError: the args and the directory grid disagree.
    """
    iter_dir, iteration = _iteration_dir(root)
    dirs = _rank_dirs(iter_dir)
    first_key = min(dirs)
    first = safe_load(os.path.join(dirs[first_key], "model_optim_rng.pt"))
    args = first.get("args")
    # the grid the files should form: from args where they say it, else from the directories
    tp = getattr(args, "tensor_model_parallel_size", None) or max(t for t, _ in dirs) + 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or max(p for _, p in dirs) + 1
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in dirs:
                raise ManifestError(f"{iter_dir}: {_dir_name(t, p, pp)} is missing "
                                    f"(expected tp={tp} x pp={pp} rank directories)")
    extra = sorted(k for k in dirs if k[0] >= tp or k[1] >= pp)
    if extra:
        raise ConfigError(f"{iter_dir}: rank directories {[_dir_name(t, p, pp) for t, p in extra]} "
                          f"lie outside the args' grid tp={tp} x pp={pp}")
    files = {tp_pp: (first if tp_pp == first_key else safe_load(os.path.join(d, "model_optim_rng.pt")))
             for tp_pp, d in dirs.items()}
    cfg = MegatronConfig.from_args(args, model_config)
    config = ParallelConfig(1, tp, pp, stage_layers=stage_layers(args, cfg.num_layers, pp))
    dist_opt = {tp_pp: os.path.join(d, "distrib_optim.pt") for tp_pp, d in dirs.items()
                if os.path.exists(os.path.join(d, "distrib_optim.pt"))}
    if dist_opt and len(dist_opt) != len(dirs):
        raise ManifestError(f"{iter_dir}: distrib_optim.pt is in {len(dist_opt)} of {len(dirs)} "
                            "rank directories")
    adam = "optimizer" in first and "state" in first["optimizer"]
    if "optimizer" in first and not adam and not dist_opt:
        raise ManifestError(f"{iter_dir}: the optimizer's parameter state is missing "
                            "(no Adam state and no distrib_optim.pt)")
    has_optim = adam or bool(dist_opt)
    tree = megatron_tree(cfg, optimizer=has_optim)
    tree.validate(config)
    if dist_opt:
        from tenplex_megatron.flatbuf import read_distrib_optim
        loaded = {k: safe_load(v) for k, v in dist_opt.items()}
        optim_state = read_distrib_optim(cfg, config, loaded, iter_dir)
    shards: dict[int, dict] = {}
    rng_states: dict[str, Any] = {}
    for (t, p), state in files.items():
        where = os.path.join(dirs[(t, p)], "model_optim_rng.pt")
        rank = config.rank(config.coord(0)._replace(tp=t, pp=p))
        shards[rank] = _model_shard(cfg, config, p, _flatten(dict(state["model"])), where)
        if adam:
            shards[rank].update(_adam_shard(cfg, config, p, state["optimizer"], shards[rank], where))
        if "rng_state" in state:
            rng_states[f"tp={t},pp={p}"] = rng.encode(state["rng_state"])
    if dist_opt:
        from tenplex.ptree.shards import materialize
        sub = type(tree)({q: l for q, l in tree.tensors() if q.startswith("optimizer/")}, tree.num_layers)
        for rank in shards:
            shards[rank].update(materialize(sub, optim_state, config, rank))
    values = {
        "megatron/iteration": iteration,
        "megatron/checkpoint_version": first.get("checkpoint_version"),
        "megatron/args": args_to_json(args) if args is not None else None,
        "megatron/opt_param_scheduler": rng.encode(first.get("opt_param_scheduler")),
        "megatron/optimizer": rng.encode(_optimizer_meta(first.get("optimizer"))),
        "megatron/num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far"),
        "megatron/rng_state": rng_states,
    }
    meta = {"megatron": {"format": "legacy", "config": cfg.to_json(),
                         "optimizer": "distrib_optim" if dist_opt else ("adam" if adam else None)}}
    return Loaded(cfg, config, tree, shards, values, meta)


def _model_shard(cfg, config, pp_rank, model: dict, where: str) -> dict:
    expected = rank_keys(cfg, config, pp_rank)
    out, used = {}, set()
    for path, keys in expected.items():
        key = next((k for k in keys if k in model), None)
        if key is None:
            raise ManifestError(f"{where}: key {keys[0]} (leaf {path}) is missing")
        out[path] = model[key].detach().contiguous()
        used.update(k for k in keys if k in model)
    for key, value in model.items():
        if key not in used and not key.endswith("_extra_state"):
            raise ManifestError(f"{where}: unexpected key {key}; tenplex keeps every tensor of a "
                                "checkpoint, and this one is not part of the model config")
    return out


def _param_order(cfg, config, pp_rank) -> list:
    """This stage's parameters in ``named_parameters()`` order, as (spec, path)."""
    keys = rank_keys(cfg, config, pp_rank)
    specs = [s for s in param_specs(cfg) if s.path in keys]
    if cfg.tied and config.pp > 1 and pp_rank == config.pp - 1:
        emb = next(s for s in param_specs(cfg) if s.path.endswith("word_embeddings/weight"))
        specs = [s for s in specs if s is not emb] + ([emb] if pp_rank != 0 else [])
    return specs


def _adam_shard(cfg, config, pp_rank, optim: dict, model_shard: dict, where: str) -> dict:
    specs = _param_order(cfg, config, pp_rank)
    groups = optim["param_groups"]
    out = {}
    for group in groups:
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        members = [s for s in specs if s.no_weight_decay == no_wd]
        if len(members) != len(group["params"]):
            raise ManifestError(f"{where}: optimizer group with wd_mult={group.get('wd_mult')} has "
                                f"{len(group['params'])} params; the model config gives {len(members)}")
        for spec, idx in zip(members, group["params"]):
            st = optim["state"].get(idx, {})
            local = model_shard[spec.path]
            for name in ("exp_avg", "exp_avg_sq"):
                out[optimizer_path(name, spec.path)] = (st[name] if name in st else
                                                        torch.zeros_like(local)).float().contiguous()
            out[optimizer_path("param", spec.path)] = local.float().clone()
    return out


def _optimizer_meta(optim: Any) -> Any:
    if not isinstance(optim, dict):
        return None
    if "optimizer" in optim and "param_groups" not in optim:  # distributed optimizer
        optim = optim["optimizer"]
    groups = []
    for g in optim.get("param_groups", []):
        g = {k: v for k, v in g.items() if k != "params"}
        groups.append(g)
    steps = {float(v["step"]) for v in optim.get("state", {}).values() if "step" in v}
    return {"param_groups": groups, "step": steps.pop() if len(steps) == 1 else None}


def write_legacy(root: str, loaded_for_rank, cfg: MegatronConfig, config: ParallelConfig,
                 values: dict, tree, optimizer: str | None = None) -> None:
    """Write a Megatron-LM per-rank checkpoint, atomically.

    Args:
        root: the checkpoint root; ``iter_NNNNNNN`` must not exist in it.
        loaded_for_rank: ``f(rank) -> {path: local tensor}`` for ``config``'s dp-rank-0 ranks.
        cfg, config: the model and target parallel configs.
        values: the value leaves (``megatron/...``), as a tenplex store keeps them.
        tree: the tree (to know whether optimizer state is present).
        optimizer: ``"distrib_optim"`` to write the distributed optimizer's
            ``distrib_optim.pt`` files, else Adam state in ``model_optim_rng.pt``.

    Raises:
        AlreadyExistsError: the iteration directory exists.
    """
    iteration = values.get("megatron/iteration") or 0
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".{name}.tmp-{uuid.uuid4().hex}")
    has_optim = any(p.startswith("optimizer/") for p in tree.leaves)
    try:
        for p in range(config.pp):
            for t in range(config.tp):
                rank = config.rank(config.coord(0)._replace(tp=t, pp=p))
                shard = loaded_for_rank(rank)
                dist_opt = has_optim and optimizer == "distrib_optim"
                state = _rank_state(cfg, config, t, p, shard, values, has_optim and not dist_opt)
                d = os.path.join(tmp, _dir_name(t, p, config.pp))
                os.makedirs(d)
                if dist_opt:
                    groups = (rng.decode(values.get("megatron/optimizer")) or {}).get("param_groups")
                    state["optimizer"] = {"optimizer": {"param_groups": groups or []}}
                    torch.save(_distrib_optim(cfg, config, p, shard),
                               os.path.join(d, "distrib_optim.pt"))
                torch.save(state, os.path.join(d, "model_optim_rng.pt"))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tracker = os.path.join(root, f".{TRACKER}.tmp-{uuid.uuid4().hex}")
    with open(tracker, "w") as f:
        f.write(str(iteration))
    os.replace(tracker, os.path.join(root, TRACKER))


def _rank_state(cfg, config, t, p, shard: dict, values: dict, has_optim: bool) -> dict:
    keys = rank_keys(cfg, config, p)
    model: dict = {}
    first = config.first_layer(p, cfg.num_layers)
    for path, accepted in keys.items():
        model[accepted[0]] = shard[path]
    layers = [i for i in range(cfg.num_layers) if config.stage_of_layer(i, cfg.num_layers) == p]
    for i in layers:
        for linear in EXTRA_STATE_LINEARS:
            model[f"decoder.layers.{i - first}.{linear}._extra_state"] = None
    if p == config.pp - 1:
        model["output_layer._extra_state"] = None
    args = json_to_args(values.get("megatron/args") or {})
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = config.tp, config.pp
    args.padded_vocab_size = cfg.padded_vocab(config.tp)
    vars(args).update(uneven_args(config.stage_layers))
    args.world_size = config.world_size
    args.data_parallel_size = config.dp
    state: dict = {"args": args, "checkpoint_version": values.get("megatron/checkpoint_version") or 3.0,
                   "iteration": values.get("megatron/iteration") or 0, "model": model}
    scheduler = values.get("megatron/opt_param_scheduler")
    if scheduler is not None:
        state["opt_param_scheduler"] = rng.decode(scheduler)
    if has_optim:
        state["optimizer"] = _adam_state(cfg, config, p, shard, rng.decode(values.get("megatron/optimizer")))
    rng_states = values.get("megatron/rng_state") or {}
    saved = rng_states.get(f"tp={t},pp={p}")
    seed = getattr(args, "seed", 1234)
    state["rng_state"] = rng.decode(saved) if saved is not None else rng.derive(seed, t, p)
    state["num_floating_point_operations_so_far"] = \
        values.get("megatron/num_floating_point_operations_so_far") or 0
    return state


def _adam_state(cfg, config, p, shard, meta) -> dict:
    specs = _param_order(cfg, config, p)
    groups_meta = (meta or {}).get("param_groups") or [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
    step = (meta or {}).get("step")
    groups, state, index = [], {}, 0
    for g in groups_meta:
        no_wd = float(g.get("wd_mult", 1.0)) == 0.0
        members = [s for s in specs if s.no_weight_decay == no_wd]
        ids = []
        for spec in members:
            st = {"exp_avg": shard[optimizer_path("exp_avg", spec.path)],
                  "exp_avg_sq": shard[optimizer_path("exp_avg_sq", spec.path)]}
            if step is not None:
                st["step"] = torch.tensor(float(step))
            state[index] = st
            ids.append(index)
            index += 1
        groups.append({**g, "params": ids})
    return {"state": state, "param_groups": groups}


def _distrib_optim(cfg, config, p, shard) -> dict:
    """``distrib_optim.pt`` content for one (tp, pp) rank: buckets coalesced, unpadded."""
    from tenplex_megatron.flatbuf import buffer_layout

    layout = buffer_layout(cfg, config, p, config.dp)
    total = sum(n for _, n, _ in layout)
    flats = {s: torch.zeros(total, dtype=torch.float32) for s in ("param", "exp_avg", "exp_avg_sq")}
    offset = 0
    for entries, unpadded, _ in layout:
        for spec, start, numel in entries:
            for name, flat in flats.items():
                flat[offset + start: offset + start + numel] = shard[optimizer_path(name, spec.path)].reshape(-1)
        offset += unpadded
    return {"buckets_coalesced": True,
            0: {(torch.float32, torch.float32): {**flats, "numel_unpadded": total}}}
