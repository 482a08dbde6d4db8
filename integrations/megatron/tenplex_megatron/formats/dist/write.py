"""megatron-core ``torch_dist`` directories, written by streaming DCP items.

Target ranks are built through the planner
(:class:`~tenplex_megatron.formats.target.TargetBuilder`), a few leaves ahead, the
ranks that differ only in ``tp`` (and ``etp``) at once, so that each leaf is built
once for them all (a stored tensor that ``tp`` cuts across its rows is read once,
not once per rank); each piece of a local tensor is appended to the rank's
``__<rank>_0.distcp`` as a DCP chunk of its global key (layers as chunks ``(layer, ...)`` of the
stacked tensor, as megatron-core saves them), then dropped. Replicas are
written once (by the first rank that holds them), as megatron-core
deduplicates by ``replica_id``. Optimizer state is written
``fully_reshardable`` (model space), as the moments of a non-distributed
optimizer (``adam``: ``FP32Optimizer``, whose main params are the model's),
or ``dp_reshardable`` flat buffers when the source used them
(``chained_0.``/``chained_1.`` dense and expert optimizers, one buffer per
model chunk: :mod:`tenplex_megatron.formats.dist.buffers`). The directory is written
under a temporary name and renamed into place;
``megatron.core.dist_checkpointing.load`` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch

from tenplex.errors import AlreadyExistsError, ConfigError
from tenplex.formats.protocol import source_notes
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import piece_view

from tenplex_megatron.formats.common import TargetValues
from tenplex_megatron.formats.folders import iteration_dir_name, write_tracker
from tenplex_megatron.formats.parts import commit_parts, part_folder, part_ranks, remove_files, seal
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.formats.dist.buffers import chained, optimizer_buffers
from tenplex_megatron.formats.dist.keys import (dist_key, extra_state_objects, optimizer_prefix, optimizer_states,
                                                rng_objects)
from tenplex_megatron.dcp.write import DcpWriter
from tenplex_megatron.model.flatbuf import buffer_dtypes, dtype_key, flat_buffers
from tenplex_megatron.model.layouts import OPTIMIZER_STATES, check_names, spec_of
from tenplex_megatron.formats.siblings import tp_siblings
from tenplex_megatron.formats.target import TargetBuilder, megatron_meta, part_values

__all__ = ["write_dist", "METADATA_JSON", "common_state", "temp_dir", "commit_dir", "write_common", "commit_dist"]

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def temp_dir(root: str, iteration) -> str:
    """A fresh temporary folder inside the ``--save`` root ``root`` for iteration ``iteration``'s folder.

    Raises:
        AlreadyExistsError: the iteration folder exists, or ``root`` is a checkpoint folder itself.
    """
    final = os.path.join(root, iteration_dir_name(iteration))
    if os.path.lexists(final):
        raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
    if os.path.lexists(root) and (not os.path.isdir(root) or os.path.lexists(os.path.join(root, "metadata.json"))):
        raise AlreadyExistsError(f"{root} exists and is not a Megatron-LM --save folder; tenplex never "
                                 "overwrites a checkpoint in place")
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".{iteration_dir_name(iteration)}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    return tmp


def write_common(tmp: str, common: dict) -> list[str]:
    """Write ``common.pt`` and ``metadata.json`` into ``tmp``; their names.

    ``common.pt`` with ``common_backend: torch`` is what megatron-core 0.16 to 0.19 all load
    (0.19 writes its common state into a ``.distcp`` item instead, and still reads ``common.pt``).
    """
    torch.save(common, os.path.join(tmp, "common.pt"))
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump(METADATA_JSON, f)
    return ["common.pt", "metadata.json"]


def commit_dir(tmp: str, root: str, common: dict, iteration) -> str:
    """Write ``common.pt`` and ``metadata.json`` into ``tmp`` (:func:`write_common`), rename it to
    ``root``'s iteration folder, then write the tracker (Megatron-LM's ``--save`` layout); returns
    the iteration folder.
    """
    write_common(tmp, common)
    final = os.path.join(root, iteration_dir_name(iteration))
    os.rename(tmp, final)
    write_tracker(root, iteration)
    return final


def common_state(values: TargetValues, optim: str | None, content: dict | None = None) -> dict:
    """``common.pt`` for the target: content metadata, iteration, scheduler, optimizer groups, args."""
    common: dict = {"content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                         **(content or {})}}
    common["content_metadata"].pop("distrib_optim_sharding_type", None)
    if optim in ("fully_reshardable", "dp_reshardable"):
        common["content_metadata"]["distrib_optim_sharding_type"] = optim
    common["iteration"] = values.iteration
    if values.scheduler is not None:
        common["opt_param_scheduler"] = values.scheduler
    if optim == "fully_reshardable":
        common["optimizer"] = {"optimizer": {"param_groups": values.param_groups()},
                               "param_state_sharding_type": "fully_reshardable", **values.grad_scaler()}
        if values.cfg.num_moe_experts and values.config.ep > 1:  # ChainedOptimizer: {0: dense, 1: expert}
            common["optimizer"] = {0: common["optimizer"],
                                   1: {**common["optimizer"],
                                       "optimizer": {"param_groups": values.expert_param_groups()}}}
    elif optim == "adam":
        common["optimizer"] = _adam_common(values, values.param_groups())
        if chained(values.cfg, values.config):
            common["optimizer"] = {0: common["optimizer"], 1: _adam_common(values, values.expert_param_groups())}
    elif optim == "dp_reshardable":
        common["optimizer"] = {"param_state_sharding_type": "dp_reshardable", **values.grad_scaler()}
        if chained(values.cfg, values.config):  # ChainedOptimizer: {0: dense, 1: expert}
            common["optimizer"] = {0: common["optimizer"], 1: {"param_state_sharding_type": "dp_reshardable",
                                                               **values.grad_scaler()}}
    if values.values.get("megatron/args"):
        common["args"] = values.args
        common["checkpoint_version"] = values.checkpoint_version
    if values.values.get("megatron/num_floating_point_operations_so_far") is not None:
        common["num_floating_point_operations_so_far"] = values.flops
    common.update(values.extra)
    return common


def _adam_common(values: TargetValues, groups: list[dict]) -> dict:
    """A non-distributed optimizer's ``common.pt`` entry: its groups without ``params`` (rebuilt at
    load) and the shared Adam step, as megatron-core ``FP32Optimizer.sharded_state_dict`` saves them
    over fp32 params; over bf16/fp16 params under ``"optimizer"`` with the grad scaler beside
    (``Float16OptimizerWithFloat16Params``: its ``fp32_from_fp16_params`` are DCP tensors)."""
    step = values.step()
    body = {"state": {} if step is None else {"common_step": torch.tensor(float(step))},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}
    return body if values.cfg.params_dtype == "float32" else {"optimizer": body, **values.grad_scaler()}


def write_dist(source, path: str, to: ParallelConfig, threads: int = 8, progress=None,
               names: str | None = None, part=None) -> dict:
    """Write ``source`` laid out for ``to`` as a ``torch_dist`` checkpoint under the ``--save`` root ``path``.

    The iteration folder ``path/iter_NNNNNNN`` is written under a temporary name and renamed
    into place; the tracker ``latest_checkpointed_iteration.txt`` is written last, so
    Megatron-LM's ``--load path`` resumes at the source's iteration.

    Args:
        source: a shard source of a Megatron model.
        path: the ``--save`` root; its iteration folder must not exist.
        to: the target config (its dp sizes nothing on disk: tensors are global).
        threads: leaves built at once.
        progress: ``progress(done_bytes, total_bytes)`` as target tensors are built.
        names: the naming scheme (``"local"`` or ``"te"``: an MoE layer's norm is
            ``pre_mlp_layernorm`` and attention has a ``core_attention`` extra state under TE);
            default: the source's.
        part: a :class:`~tenplex.formats.protocol.Part`: write only this part's ``.distcp``
            files (part 0 also ``common.pt``) into the run's temporary folder, fsync them and
            commit nothing; the result's ``"part"`` carries their DCP items for
            :func:`commit_dist` (:mod:`tenplex_megatron.formats.parts`).

    Returns:
        ``{"bytes_written", "files", "padding", "notes"}`` (and ``"part"``).

    Raises:
        AlreadyExistsError: the iteration folder exists, or ``path`` is a checkpoint folder.
        ConfigError: ``to`` cannot hold the model.
        ManifestError: the source is not a Megatron model, or a bad source.
    """
    cfg, meta = megatron_meta(source)
    names = check_names(names or meta.get("names") or "local")
    cfg = cfg.with_impl(names)  # the target's layer spec: the order of dp_reshardable buffers
    has_optim = any(p.startswith("optimizer/") for p in source.tree.leaves)
    optim = None if not has_optim else meta.get("optimizer") if meta.get("optimizer") in (
        "dp_reshardable", "adam") else "fully_reshardable"
    with TargetBuilder(source, to, threads, progress=progress) as build:
        writers = [r for r in range(to.world_size)  # the others hold replicas only (replica_id > 0)
                   if to.coord(r).dense_dp_first or to.coord(r).edp == 0]
        mine = set(writers) if part is None else part_ranks(build, writers, part)
        # a part reads the values of its own files only: global ones (common.pt) and the RNG
        # states its dense ranks write
        values = TargetValues(build.values, cfg, to) if part is None else part_values(
            build, cfg, to, [r for r in mine if to.coord(r).dense_dp_first])
        values.notes.extend(source_notes(source))
        if meta.get("optimizer") in ("fully_sharded_model_space", "dp_zero_gather_scatter"):
            values.notes.append(f"optimizer: the source's {meta['optimizer']} state (megatron-core <= 0.13) is "
                                "written fully_reshardable, which megatron-core 0.14 and later load; for 0.13 "
                                "write --format megatron-legacy (distrib_optim.pt)")
        dtypes = meta.get("buffer_dtypes") or buffer_dtypes(cfg, vars(values.args))
        rng_states = values.rng_states(per_dp=to.ep > 1) if values.had_rng else {}
        if not values.had_rng:
            values.notes.append("rng: the source stores no RNG state; none is written")
        tmp = temp_dir(path, values.iteration) if part is None else part_folder(path, values.iteration,
                                                                                  part.token)
        made = []
        try:
            writer, files = DcpWriter(tmp), 0
            for group in tp_siblings(to, mine):  # a group's files at once: see _write_group
                made += [f"__{rank}_0.distcp" for rank in group]
                files += len(group)
                _write_group(build, cfg, writer, tmp, group, optim, names, dtypes, values, rng_states)
            common = common_state(values, optim, meta.get("content_metadata"))
            report = None
            if part is None:
                writer.finish()
                commit_dir(tmp, path, common, values.iteration)
            else:  # no .metadata, no rename, no tracker: commit_dist does them
                writer.close()
                made += write_common(tmp, common) if part.index == 0 else []
                expected = [f"__{r}_0.distcp" for r in writers] + ["common.pt", "metadata.json"]
                report = {"files": seal(tmp, made), "expected": expected, "iteration": values.iteration,
                          "bytes_written": writer.bytes_written, "dcp": writer.to_json(),
                          "ranks": sorted(mine)}
        except BaseException:
            if part is not None:  # the other parts' files are theirs (or the committer's) to remove
                remove_files(tmp, made)
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"bytes_written": writer.bytes_written, "files": files, "bytes_needed": build.runner.bytes_needed,
                "padding": list(build.plan.padding), "notes": values.notes,
                **({"part": report} if report is not None else {})}


def commit_dist(path: str, parts: list[dict], token: str) -> dict:
    """Commit a ``torch_dist`` checkpoint written in parts: the parts' DCP items merged into one
    ``.metadata``, then the folder renamed into place and the tracker written
    (:func:`tenplex_megatron.formats.parts.commit_parts`).

    Raises:
        CorruptShardError: a file missing or of another size, or parts whose items disagree.
    """
    def finish(folder: str) -> None:
        writer = DcpWriter(folder)
        for p in parts:
            writer.add_json(p["dcp"])
        writer.finish()
        seal(folder, [".metadata"])
    return commit_parts(path, parts, token, finish)


def _dcp_key(cfg: MegatronConfig, path: str, optim: str | None, names: str = "local"
             ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """DCP key of tree path ``path``, its leading coordinates (layer, then global expert) and their sizes."""
    spec = spec_of(cfg, path if path.startswith("model/") else "model/" + path.split("/", 2)[2])
    key, lead, sizes = dist_key(cfg, spec, names)
    if not path.startswith("model/"):
        key = optimizer_prefix(optim, path.split("/")[1], cfg.params_dtype) + key
    return key, lead, sizes


def _write_group(build, cfg, writer: DcpWriter, tmp: str, group, optim, names, dtypes, values,
                 rng_states) -> None:
    """Write the ``.distcp`` files of sibling ranks ``group`` (:func:`tp_siblings`), each through
    its own :class:`DcpWriter` whose items join ``writer``'s: their tensors all at once (each leaf
    built once for the group: :meth:`TargetBuilder.at_once`), then their flat buffers two files at
    a time (each holds a whole flat state), then their objects."""
    to = build.to
    subs = {rank: DcpWriter(tmp) for rank in group}
    try:
        for rank, sub in subs.items():
            sub.open(f"__{rank}_0.distcp")
        build.at_once([(rank, lambda r=rank: _write_tensors(build, cfg, subs[r], r, optim, names))
                       for rank in group])
        if optim == "dp_reshardable":
            for i in range(0, len(group), 2):
                build.at_once([(rank, lambda r=rank: _write_buffers(build, cfg, subs[r], to.coord(r), r,
                                                                    dtypes, values)) for rank in group[i:i + 2]])
        for rank, sub in subs.items():
            c = to.coord(rank)
            if c.dense_dp_first and c.tp == 0 and c.ep == 0:
                _write_extra_states(cfg, to, sub, c.pp, names)
            if c.dense_dp_first and rng_states:  # this (tp, pp)'s objects, per dp-cp rank too at ep > 1
                for key, data in rng_objects(rng_states[f"tp={c.tp},pp={c.pp}"], c.tp, c.pp, to,
                                             values.dp_random_init):
                    sub.object(key, [data])
    finally:
        for sub in subs.values():
            sub.close()
    for sub in subs.values():
        writer.add_json(sub.to_json())
        writer.bytes_written += sub.bytes_written


def _write_tensors(build, cfg, writer: DcpWriter, rank: int, optim, names: str = "local") -> None:
    sharding = build.runner.D
    # over fp32 params a non-distributed optimizer's main params are the model's: not stored twice
    prefixes = ("model/",) + tuple(f"optimizer/{state}/" for state in optimizer_states(optim, cfg.params_dtype))
    paths = [q for q in build.paths(rank) if q.startswith(prefixes)
             and any(c.ranks[0] == rank for c in sharding.classes(q))]
    coord = build.to.coord(rank)
    for path, local in build.stream(rank, paths):
        key, lead, lead_sizes = _dcp_key(cfg, path, optim, names)
        size = sharding.physical_shape(build.tree[path])
        held = sharding.holding(path, coord)
        for piece in held.pieces:
            data = piece_view(local, piece).reshape((1,) * len(lead) + tuple(piece.box.sizes))
            writer.tensor(key, lead_sizes + size, lead + piece.box.offsets, data)
        del local


def _write_buffers(build, cfg, writer, c, rank, dtypes, values) -> None:
    """The ``dp_reshardable`` buffers that rank ``rank`` (at ``c``) writes: its dense ones when it is
    dp x cp rank 0, its expert ones when it is expert-dp rank 0 (each gathered over its group, unpadded)."""
    to = build.to
    mine = [buf for buf in optimizer_buffers(cfg, to)
            if (buf.expert and c.edp == 0 and (buf.split, buf.pp, buf.ep) == (c.etp, c.pp, c.ep))
            or (not buf.expert and c.dense_dp_first and (buf.split, buf.pp) == (c.tp, c.pp))]
    key = dtype_key(dtypes)
    groups: dict = {}
    for buf in mine:
        flats, buckets = flat_buffers(cfg, to, buf.pp, lambda jobs: build.fill(rank, jobs), buf.chunk,
                                      buf.expert, buf.ep)
        for b, (offset, numel) in enumerate(buckets):
            for state in OPTIMIZER_STATES:
                writer.tensor(buf.key(b, state, dtypes), (numel,), (0,), flats[state][offset:offset + numel])
        del flats
        layout = buf.layout(cfg, to, padded=True)
        sizes = groups.setdefault((buf.prefix, buf.group_idx), (buf, [], []))
        sizes[1].append({key: [padded for _, _, padded in layout]})
        sizes[2].append({key: [n for _, n, _ in layout]})
    for buf, padded, unpadded in groups.values():
        param_groups = values.expert_param_groups() if buf.expert else values.param_groups()
        objects = {"optimizer": {"param_groups": param_groups}, "per_bucket_numel": padded,
                   "per_bucket_numel_unpadded": unpadded}
        for name, data in objects.items():
            writer.object(buf.object(name), [data])


def _write_extra_states(cfg, to, writer, p, names: str = "local") -> None:
    """Stage ``p``'s ``_extra_state`` objects (all None), expert ones per (layer, global expert)."""
    for v in range(to.vpp):
        for layer in to.chunk_layers(p, v, cfg.num_layers):
            for key in extra_state_objects(cfg, layer, names):
                writer.object(key, [None])
