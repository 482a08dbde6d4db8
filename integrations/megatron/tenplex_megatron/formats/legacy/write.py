"""Megatron-LM per-rank checkpoints, written a pipeline stage at a time.

For each (tp, pp) rank of the target config, its local tensors are built
from the source through the planner (:class:`~tenplex_megatron.formats.target.TargetBuilder`),
saved as ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (and, for the distributed
optimizer, ``distrib_optim.pt``), and dropped once written. Each file
is streamed (:func:`~tenplex_megatron.torchfiles.ptsave.save_streamed`): its tensors are
built while the ones before them are written, so a writer holds the tensor
it writes and those built ahead (a byte budget, or one flat optimizer state),
never a whole file.

Files are written stage by stage (a stage: one ``pp`` rank and one ``ep``
rank): first the ``model_optim_rng.pt`` of all its ``tp`` ranks at once,
sharing one byte budget, then its ``distrib_optim.pt`` files
:data:`FILES_AT_ONCE` at a time (each holds a whole flat state). Files
written at once are siblings (:meth:`~tenplex_megatron.formats.target.TargetBuilder.share`):
each leaf is built once for all of them, so a stored tensor that ``tp``
cuts across its rows is read once per stage, not once per rank.
Everything goes to a temporary directory that is renamed into place at the
end; the tracker file is written last.
"""

from __future__ import annotations

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from tenplex.errors import AlreadyExistsError, ConfigError
from tenplex.formats.protocol import source_notes
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.formats.common import TargetValues
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.flatbuf import (FLAT_DTYPE, buffer_dtypes, distrib_optim_state, flat_buffers,
                                      flat_numel)
from tenplex_megatron.model.layouts import (OPTIMIZER_STATES, check_names, chunk_keys, extra_state_keys,
                                            optimizer_path, param_order, param_specs)
from tenplex_megatron.formats.folders import iteration_dir_name, write_tracker
from tenplex_megatron.formats.legacy.grid import check_expert_files, legacy_writers, rank_dir_name
from tenplex_megatron.formats.parts import part_folder, part_ranks, remove_files, seal
from tenplex_megatron.torchfiles.ptsave import save_streamed
from tenplex_megatron.formats.target import TargetBuilder, megatron_meta, part_values

__all__ = ["write_legacy", "legacy_optimizer", "FILES_AT_ONCE"]

FILES_AT_ONCE = 2
"""``distrib_optim.pt`` files written at once. Each holds one flat optimizer state (and builds the
next), so two writers hold about twice one's memory; writing two files overlaps one file's
page-cache copies and CRC-32s with the other's reads. A stage's ``model_optim_rng.pt`` files are
written all at once, sharing one byte budget of tensors built ahead."""


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


def _experts(cfg: MegatronConfig, to: ParallelConfig) -> bool:
    """Whether the target keeps experts in their own optimizer and buffers (ep > 1)."""
    return bool(cfg.num_moe_experts) and to.ep > 1


def write_legacy(source, root: str, to: ParallelConfig, threads: int = 8, progress=None,
                 expert_names: str | None = None, names: str | None = None, part=None) -> dict:
    """Write ``source`` laid out for ``to`` as a Megatron-LM per-rank checkpoint at ``root``.

    Args:
        source: a shard source of a Megatron model (a tenplex store converted
            from Megatron, or a Megatron checkpoint read in place).
        root: the checkpoint root; its iteration directory must not exist.
        to: the target config.
        threads: leaves built at once.
        progress: ``progress(done_bytes, total_bytes)`` as target tensors are built.
        expert_names: ``"sequential"`` (``local_experts.{j}.linear_fc1.weight``) or
            ``"grouped"`` (``linear_fc1.weight{j}``); default: the source's scheme.
        names: the norms' naming scheme, ``"local"`` (``input_layernorm.weight``) or ``"te"``
            (``self_attention.linear_qkv.layer_norm_weight``, TE's extra states);
            default: the source's (:data:`~tenplex_megatron.model.layouts.NAMES`).
        part: a :class:`~tenplex.formats.protocol.Part`: write only this part's rank
            directories into the run's temporary folder, fsync them and commit nothing
            (:mod:`tenplex_megatron.formats.parts`); the result's ``"part"`` is its report.

    Returns:
        ``{"bytes_written", "files", "padding", "notes"}`` (and ``"part"``).

    Raises:
        AlreadyExistsError: the iteration directory exists.
        ConfigError: ``to`` cannot hold the model or be written as Megatron-LM args, or
            an MoE model whose ``etp`` makes Megatron-LM's files collide or miss
            shards (:func:`tenplex_megatron.formats.legacy.grid.check_expert_files`).
        ManifestError: the source is not a Megatron model, or a bad source.
    """
    cfg, meta = megatron_meta(source)
    scheme = names
    if cfg.num_moe_experts:
        check_expert_files(to, root)
    names = expert_names or meta.get("expert_names") or "sequential"
    if names not in ("sequential", "grouped"):
        raise ConfigError(f"expert_names={names!r}: expected 'sequential' or 'grouped'")
    if names != "sequential":
        cfg = type(cfg).from_json({**cfg.to_json(), "moe_grouped_gemm": True})
    scheme = check_names(scheme or meta.get("names") or "local")
    cfg = cfg.with_impl(scheme)  # the target's layer spec: the order of optimizer state kept by position
    with TargetBuilder(source, to, threads, progress=progress) as build:
        writers = sorted(legacy_writers(to).items(), key=lambda x: (x[0][1], x[0][0], x[0][2]))
        mine = part_ranks(build, [r for _, r in writers], part) if part is not None else None
        # a part reads the values (RNG states) of its own files only
        values = TargetValues(build.values, cfg, to) if mine is None else part_values(build, cfg, to, mine)
        values.notes.extend(source_notes(source))
        optimizer = legacy_optimizer(meta, values.args) if any(
            p.startswith("optimizer/") for p in source.tree.leaves) else None
        if optimizer == "adam" and to.vpp > 1:
            raise ConfigError(f"{to}: a non-distributed optimizer's legacy state with vpp={to.vpp} is "
                              "not written by tenplex; reshard to vpp=1 or from a distributed optimizer")
        name = iteration_dir_name(values.iteration)
        final = os.path.join(root, name)
        if os.path.exists(final):
            raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
        created = not os.path.lexists(root)  # a refused write leaves no empty root behind
        os.makedirs(root, exist_ok=True)
        tmp = (os.path.join(root, f".{name}.tmp-{uuid.uuid4().hex}") if part is None
               else part_folder(root, values.iteration, part.token))
        dtypes = meta.get("buffer_dtypes") or buffer_dtypes(cfg, vars(values.args))
        rng_states = values.rng_states(per_dp=to.ep > 1)
        stages: dict = {}  # (pp, ep) -> ([model file jobs], [distrib_optim.pt jobs]), in rank order
        expected, made = [], []
        try:
            for (t, p, e), rank in writers:
                rel = rank_dir_name(t, p, to.pp, e, to.ep)
                files = [f"{rel}/model_optim_rng.pt"] + ([f"{rel}/distrib_optim.pt"]
                                                          if optimizer == "distrib_optim" else [])
                expected += files
                if mine is not None and rank not in mine:
                    continue
                d = os.path.join(tmp, rel)
                os.makedirs(d)
                made += files
                models, optims = stages.setdefault((p, e), ([], []))
                models.append((rank, lambda t=t, p=p, e=e, rank=rank, d=d: _write_rank(
                    build, cfg, values, rng_states, optimizer, t, p, e, rank, d, scheme)))
                if optimizer == "distrib_optim":
                    optims.append((rank, lambda p=p, e=e, rank=rank, d=d: _distrib_optim(
                        build, cfg, to, p, e, rank, dtypes, os.path.join(d, "distrib_optim.pt"))))
            batches = [b for models, optims in stages.values() for b in
                       [models] + [optims[i:i + FILES_AT_ONCE] for i in range(0, len(optims), FILES_AT_ONCE)]]
            written = _write_files(build, [b for b in batches if b])
            files = sum(len(b) for b in batches)
            if part is not None:  # no rename, no tracker: the committing process does both
                report = {"files": seal(tmp, made), "expected": expected, "iteration": values.iteration,
                          "bytes_written": written, "ranks": sorted(mine)}
            else:
                os.rename(tmp, final)
        except BaseException:
            if part is not None:  # the other parts' files are theirs (or the committer's) to remove
                remove_files(tmp, made)
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            if created and not os.listdir(root):
                os.rmdir(root)
            raise
        if part is None:
            write_tracker(root, values.iteration)
        return {"bytes_written": written, "files": files, "padding": list(build.plan.padding),
                "bytes_needed": build.runner.bytes_needed,
                "notes": values.notes, **({"part": report} if part is not None else {})}


def _write_files(build, batches: list[list[tuple[int, Callable]]]) -> int:
    """Run the file writers of each batch (``[(rank, job)]``) at once, batch after batch
    (:meth:`TargetBuilder.at_once`); the bytes written.

    The first error is raised once the files being written have stopped; no later file starts."""
    return sum(sum(build.at_once(batch)) for batch in batches)


def _placeholder(build, path: str, rank: int) -> torch.Tensor:
    """An untouched tensor of target ``rank``'s shape of ``path`` (see :mod:`tenplex_megatron.torchfiles.ptsave`)."""
    held = build.runner.D.holding(path, build.to.coord(rank))
    return torch.empty(held.shape, dtype=torch_dtype(build.tree[path].dtype))


def _ahead(fns: list) -> Iterator[torch.Tensor]:
    """``fn()`` for each of ``fns`` in order, the next one built (in a thread) while the caller
    writes the current one."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fns[0]) if fns else None
        for i in range(len(fns)):
            result = future.result()
            future = pool.submit(fns[i + 1]) if i + 1 < len(fns) else None
            yield result


def _distrib_optim(build, cfg, to, p, e, rank, dtypes, path: str) -> int:
    """Write ``distrib_optim.pt`` of directory (``p``, ``e``) written by ``rank``: one state, or
    ``[dense | None, expert]`` at ep > 1 with the dense state only where ``rank`` is dense dp x cp
    rank 0 (``ChainedOptimizer`` saves each sub-optimizer's state on its dp rank 0).

    Each flat state tensor is built while the previous one is written; the file's bytes."""
    placeholders, fns = [], []

    def fill(jobs):
        build.fill(rank, jobs)

    def flat(v: int, expert: bool, state: str) -> torch.Tensor:
        return flat_buffers(cfg, to, p, fill, v, expert, e, states=(state,))[0][state]

    def state(expert: bool) -> dict:
        chunks = []
        for v in range(to.vpp):
            numel = flat_numel(cfg, to, p, v, expert, e)
            chunks.append({s: torch.empty(numel, dtype=FLAT_DTYPE) for s in OPTIMIZER_STATES})
            placeholders.extend(chunks[-1].values())
            fns.extend(lambda v=v, s=s: flat(v, expert, s) for s in OPTIMIZER_STATES)
        return distrib_optim_state(chunks, dtypes)
    if not _experts(cfg, to):
        obj = state(False)
    else:
        obj = [state(False) if to.coord(rank).dense_dp_first else None, state(True)]
    return save_streamed(obj, path, placeholders, _ahead(fns))


def _write_rank(build, cfg, values, rng_states, optimizer, t, p, e, rank, d, scheme="local") -> int:
    to = build.to
    paths, placeholders = [], []
    names = 1 if cfg.moe_grouped_gemm else 0
    te = {s.path for s in param_specs(cfg) if s.te} if scheme == "te" else set()
    state: dict = {"args": values.args, "checkpoint_version": values.checkpoint_version,
                   "iteration": values.iteration}
    for v in range(to.vpp):
        model: dict = {}
        first = to.first_layer(p, cfg.num_layers, v)
        for path, accepted in chunk_keys(cfg, to, p, v, e).items():
            expert = build.tree[path].layout.expert is not None
            key = accepted[-1] if path in te else accepted[names if expert else 0]
            model[key] = _placeholder(build, path, rank)
            paths.append(path)
            placeholders.append(model[key])
        for layer in to.chunk_layers(p, v, cfg.num_layers):
            for key in extra_state_keys(cfg, layer, to.ep, scheme):
                model[key.format(i=layer - first)] = None
        if (p, v) == (to.pp - 1, to.vpp - 1):
            model["output_layer._extra_state"] = None
        state["model" if to.vpp == 1 else f"model{v}"] = model
    if values.scheduler is not None:
        state["opt_param_scheduler"] = values.scheduler
    subs = [values.param_groups()] + ([values.expert_param_groups()] if _experts(cfg, to) else [])
    if optimizer == "adam":
        specs = param_order(cfg, to, p, 0, e)
        parts = [specs] if len(subs) == 1 else [[s for s in specs if s.expert is None],
                                                [s for s in specs if s.expert is not None]]
        state["optimizer"] = [_adam_state(build, cfg, values, rank, part, groups, paths, placeholders)
                              for part, groups in zip(parts, subs)]
    elif optimizer == "distrib_optim":
        state["optimizer"] = [{"optimizer": {"param_groups": groups}, **values.grad_scaler()} for groups in subs]
    if optimizer is not None and len(subs) == 1:
        state["optimizer"] = state["optimizer"][0]
    states, c = rng_states[f"tp={t},pp={p}"], to.coord(rank)  # at ep > 1 the writer's own (rank dp*cp + cp)
    state["rng_state"] = states if values.dp_random_init or to.ep == 1 else [states[c.dp * to.cp + c.cp]]
    state["num_floating_point_operations_so_far"] = values.flops
    state.update(values.extra)
    return save_streamed(state, os.path.join(d, "model_optim_rng.pt"), placeholders,
                         (tensor for _, tensor in build.stream(rank, paths)))


def _adam_state(build, cfg: MegatronConfig, values, rank, specs, param_groups, paths: list,
                placeholders: list) -> dict:
    """A non-distributed Adam's state dict: ``FP32Optimizer``'s, or ``Float16OptimizerWithFloat16Params``'
    (with ``fp32_from_fp16_params``) for bf16/fp16 params, over ``specs`` (one sub-optimizer's).

    Its tensors are placeholders, appended to ``placeholders`` (and their leaves to ``paths``) in
    the order the pickle meets them, so the file streams them like the model's: a writer holds
    what it writes, not the rank's whole optimizer state (which, for the stage's ``tp`` files
    written at once, is the stage's)."""
    step = values.step()
    groups, state, mains, main_paths, index = [], {}, [], [], 0
    for g in param_groups:
        no_wd = float(g.get("wd_mult", 1.0)) == 0.0
        ids, group_mains = [], []
        for spec in (s for s in specs if s.no_weight_decay == no_wd):
            st = {}
            for name in ("exp_avg", "exp_avg_sq"):  # met in this order: state[index] is pickled whole
                st[name] = _placeholder(build, optimizer_path(name, spec.path), rank)
                paths.append(optimizer_path(name, spec.path))
                placeholders.append(st[name])
            if step is not None:
                st["step"] = torch.tensor(float(step))
            state[index] = st
            if cfg.params_dtype != "float32":  # else the main params are the model's, not stored
                group_mains.append(_placeholder(build, optimizer_path("param", spec.path), rank))
                main_paths.append(optimizer_path("param", spec.path))
            ids.append(index)
            index += 1
        groups.append({**g, "params": ids})
        mains.append(group_mains)
    inner = {"state": state, "param_groups": groups}
    if cfg.params_dtype == "float32":
        return inner
    paths.extend(main_paths)  # after every moment: "optimizer" is pickled before "fp32_from_fp16_params"
    placeholders.extend(m for group in mains for m in group)
    return {"optimizer": inner, "fp32_from_fp16_params": mains, **values.grad_scaler()}
