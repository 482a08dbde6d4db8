"""Megatron-LM per-rank checkpoints, written one target rank file at a time.

For each (tp, pp) rank of the target config, its local tensors are built
from the source through the planner (:class:`~tenplex_megatron.target.TargetBuilder`),
saved as ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (and, for the distributed
optimizer, ``distrib_optim.pt``), and dropped before the next rank: a writer
holds one target file. Everything goes to a temporary directory that is
renamed into place at the end; the tracker file is written last.
"""

from __future__ import annotations

import os
import shutil
import uuid

import torch

from tenplex.errors import AlreadyExistsError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.common import TargetValues
from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.flatbuf import buffer_dtypes, distrib_optim_state, flat_buffers
from tenplex_megatron.layouts import EXTRA_STATE_LINEARS, optimizer_path, param_order, rank_keys
from tenplex_megatron.legacy import TRACKER, iteration_dir_name, rank_dir_name
from tenplex_megatron.target import TargetBuilder, megatron_meta

__all__ = ["write_legacy", "legacy_optimizer"]


def legacy_optimizer(meta: dict, args) -> str | None:
    """``"distrib_optim"``, ``"adam"`` or None: how the target keeps the source's optimizer state.

    A source written with the distributed optimizer (``distrib_optim.pt``, or a
    ``torch_dist`` optimizer when the args say ``use_distributed_optimizer``)
    gets ``distrib_optim.pt`` files; a non-distributed Adam keeps its state in
    ``model_optim_rng.pt``.
    """
    kind = meta.get("optimizer")
    if kind is None:
        return None
    if kind == "distrib_optim" or (kind != "adam" and getattr(args, "use_distributed_optimizer", True)):
        return "distrib_optim"
    return "adam"


def write_legacy(source, root: str, to: ParallelConfig, threads: int = 8, progress=None) -> dict:
    """Write ``source`` laid out for ``to`` as a Megatron-LM per-rank checkpoint at ``root``.

    Args:
        source: a shard source of a Megatron model (a tenplex store converted
            from Megatron, or a Megatron checkpoint read in place).
        root: the checkpoint root; its iteration directory must not exist.
        to: the target config.
        threads: leaves built at once.
        progress: ``progress(done_bytes, total_bytes)`` as target tensors are built.

    Returns:
        ``{"bytes_written", "files", "padding", "notes"}``.

    Raises:
        AlreadyExistsError: the iteration directory exists.
        ConfigError: ``to`` cannot hold the model or be written as Megatron-LM args.
        ManifestError: the source is not a Megatron model, or a bad source.
    """
    cfg, meta = megatron_meta(source)
    with TargetBuilder(source, to, threads, progress=progress) as build:
        values = TargetValues(build.values, cfg, to)
        name = iteration_dir_name(values.iteration)
        final = os.path.join(root, name)
        if os.path.exists(final):
            raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f".{name}.tmp-{uuid.uuid4().hex}")
        optimizer = legacy_optimizer(meta, values.args) if any(
            p.startswith("optimizer/") for p in source.tree.leaves) else None
        dtypes = meta.get("buffer_dtypes") or buffer_dtypes(cfg, vars(values.args))
        rng_states = values.rng_states()
        written, files = 0, 0
        try:
            for p in range(to.pp):
                for t in range(to.tp):
                    rank = to.rank(to.coord(0)._replace(tp=t, pp=p))
                    d = os.path.join(tmp, rank_dir_name(t, p, to.pp))
                    os.makedirs(d)
                    written += _write_rank(build, cfg, values, rng_states, optimizer, t, p, rank, d)
                    files += 1
                    if optimizer == "distrib_optim":
                        flats, _ = flat_buffers(cfg, to, p, lambda jobs: build.fill(rank, jobs))
                        written += _save(distrib_optim_state(flats, dtypes), os.path.join(d, "distrib_optim.pt"))
                        files += 1
                        del flats
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tracker = os.path.join(root, f".{TRACKER}.tmp-{uuid.uuid4().hex}")
        with open(tracker, "w") as f:
            f.write(str(values.iteration))
        os.replace(tracker, os.path.join(root, TRACKER))
        return {"bytes_written": written, "files": files, "padding": list(build.plan.padding),
                "notes": values.notes}


def _save(obj, path: str) -> int:
    torch.save(obj, path)
    return os.path.getsize(path)


def _write_rank(build, cfg, values, rng_states, optimizer, t, p, rank, d) -> int:
    to = build.to
    local = build.rank(rank, "model/")
    model: dict = {}
    for path, accepted in rank_keys(cfg, to, p).items():
        model[accepted[0]] = local[path]
    first = to.first_layer(p, cfg.num_layers)
    for i in range(first, first + to.layers_per_stage(cfg.num_layers)[p]):
        for linear in EXTRA_STATE_LINEARS:
            model[f"decoder.layers.{i - first}.{linear}._extra_state"] = None
    if p == to.pp - 1:
        model["output_layer._extra_state"] = None
    state: dict = {"args": values.args, "checkpoint_version": values.checkpoint_version,
                   "iteration": values.iteration, "model": model}
    if values.scheduler is not None:
        state["opt_param_scheduler"] = values.scheduler
    if optimizer == "adam":
        state["optimizer"] = _adam_state(build, cfg, values, p, rank, local)
    elif optimizer == "distrib_optim":
        state["optimizer"] = {"optimizer": {"param_groups": values.param_groups()}, **values.grad_scaler()}
    state["rng_state"] = rng_states[f"tp={t},pp={p}"]
    state["num_floating_point_operations_so_far"] = values.flops
    state.update(values.extra)
    written = _save(state, os.path.join(d, "model_optim_rng.pt"))
    del local, model, state
    return written


def _adam_state(build, cfg: MegatronConfig, values, p, rank, local) -> dict:
    """A non-distributed Adam's state dict: ``FP32Optimizer``'s, or ``Float16OptimizerWithFloat16Params``'
    (with ``fp32_from_fp16_params``) for bf16/fp16 params."""
    specs = param_order(cfg, build.to, p)
    step = values.step()
    groups, state, mains, index = [], {}, [], 0
    for g in values.param_groups():
        no_wd = float(g.get("wd_mult", 1.0)) == 0.0
        ids, group_mains = [], []
        for spec in (s for s in specs if s.no_weight_decay == no_wd):
            st = {name: build.leaf(optimizer_path(name, spec.path), rank) for name in ("exp_avg", "exp_avg_sq")}
            if step is not None:
                st["step"] = torch.tensor(float(step))
            state[index] = st
            group_mains.append(build.leaf(optimizer_path("param", spec.path), rank))
            ids.append(index)
            index += 1
        groups.append({**g, "params": ids})
        mains.append(group_mains)
    inner = {"state": state, "param_groups": groups}
    if cfg.params_dtype == "float32":
        return inner
    return {"optimizer": inner, "fp32_from_fp16_params": mains, **values.grad_scaler()}
