"""megatron-core ``torch_dist`` directories, written by streaming DCP items.

Target ranks are built one at a time through the planner
(:class:`~tenplex_megatron.target.TargetBuilder`), a few leaves ahead; each
piece of a local tensor is appended to the rank's ``__<rank>_0.distcp`` as a
DCP chunk of its global key (layers as chunks ``(layer, ...)`` of the
stacked tensor, as megatron-core saves them), then dropped. Replicas are
written once (by the first rank that holds them), as megatron-core
deduplicates by ``replica_id``. Optimizer state is written
``fully_reshardable`` (model space), or ``dp_reshardable`` flat buffers
when the source used them. The directory is written under a temporary name
and renamed into place; ``megatron.core.dist_checkpointing.load`` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch

from tenplex.errors import AlreadyExistsError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import piece_view

from tenplex_megatron.common import TargetValues
from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.dcp_keys import dist_key, extra_state_objects, flat_key, object_key, rng_key
from tenplex_megatron.dcp_write import DcpWriter
from tenplex_megatron.flatbuf import buffer_dtypes, buffer_layout, dtype_key, flat_buffers
from tenplex_megatron.layouts import OPTIMIZER_STATES, spec_of
from tenplex_megatron.target import TargetBuilder, megatron_meta

__all__ = ["write_dist", "METADATA_JSON", "common_state", "temp_dir", "commit_dir"]

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def temp_dir(path: str) -> str:
    """A fresh temporary directory beside ``path``.

    Raises:
        AlreadyExistsError: ``path`` exists.
    """
    if os.path.exists(path):
        raise AlreadyExistsError(f"{path} exists; tenplex never overwrites a checkpoint in place")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    return tmp


def commit_dir(tmp: str, path: str, common: dict) -> None:
    """Write ``common.pt`` and ``metadata.json`` into ``tmp``, then rename it to ``path``."""
    torch.save(common, os.path.join(tmp, "common.pt"))
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump(METADATA_JSON, f)
    os.rename(tmp, path)


def common_state(values: TargetValues, optim: str | None, content: dict | None = None) -> dict:
    """``common.pt`` for the target: content metadata, iteration, scheduler, optimizer groups, args."""
    common: dict = {"content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                         **(content or {})}}
    common["content_metadata"].pop("distrib_optim_sharding_type", None)
    if optim:
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
    elif optim == "dp_reshardable":
        common["optimizer"] = {"param_state_sharding_type": "dp_reshardable", **values.grad_scaler()}
    if values.values.get("megatron/args"):
        common["args"] = values.args
        common["checkpoint_version"] = values.checkpoint_version
    if values.values.get("megatron/num_floating_point_operations_so_far") is not None:
        common["num_floating_point_operations_so_far"] = values.flops
    common.update(values.extra)
    return common


def write_dist(source, path: str, to: ParallelConfig, threads: int = 8, progress=None) -> dict:
    """Write ``source`` laid out for ``to`` as a ``torch_dist`` directory at ``path``, atomically.

    Args:
        source: a shard source of a Megatron model.
        path: the directory to create; it must not exist.
        to: the target config (its dp sizes nothing on disk: tensors are global).
        threads: leaves built at once.
        progress: ``progress(done_bytes, total_bytes)`` as target tensors are built.

    Returns:
        ``{"bytes_written", "files", "padding", "notes"}``.

    Raises:
        AlreadyExistsError: ``path`` exists.
        ConfigError: ``to`` cannot hold the model.
        ManifestError: the source is not a Megatron model, or a bad source.
    """
    cfg, meta = megatron_meta(source)
    has_optim = any(p.startswith("optimizer/") for p in source.tree.leaves)
    optim = None if not has_optim else (
        "dp_reshardable" if meta.get("optimizer") == "dp_reshardable" else "fully_reshardable")
    with TargetBuilder(source, to, threads, progress=progress) as build:
        values = TargetValues(build.values, cfg, to)
        if optim == "dp_reshardable" and (to.vpp > 1 or (cfg.num_moe_experts and to.ep > 1)):
            optim = "fully_reshardable"  # tenplex writes dp_reshardable buffers for one dense chunk only
            values.notes.append(f"optimizer: written fully_reshardable (model space): tenplex writes "
                                f"dp_reshardable buffers only without vpp and expert buffers ({to})")
        dtypes = meta.get("buffer_dtypes") or buffer_dtypes(cfg, vars(values.args))
        rng_states = values.rng_states() if values.had_rng else {}
        if not values.had_rng:
            values.notes.append("rng: the source stores no RNG state; none is written")
        tmp = temp_dir(path)
        try:
            writer, files = DcpWriter(tmp), 0
            for rank in range(to.world_size):
                c = to.coord(rank)
                dense = (c.dp, c.cp) == (0, 0)
                if not dense and c.edp != 0:
                    continue  # holds replicas only: megatron-core writes replica_id 0
                writer.open(f"__{rank}_0.distcp")
                files += 1
                _write_tensors(build, cfg, writer, rank, optim)
                if dense and optim == "dp_reshardable":
                    _write_buffers(build, cfg, writer, c.tp, c.pp, rank, dtypes, values)
                if dense and c.tp == 0 and c.ep == 0:
                    _write_extra_states(cfg, to, writer, c.pp)
                if dense and rng_states:
                    writer.object(rng_key(c.tp, c.pp, to.tp, to.pp), [rng_states[f"tp={c.tp},pp={c.pp}"]])
            writer.finish()
            commit_dir(tmp, path, common_state(values, optim, meta.get("content_metadata")))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"bytes_written": writer.bytes_written, "files": files,
                "padding": list(build.plan.padding), "notes": values.notes}


def _dcp_key(cfg: MegatronConfig, path: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """DCP key of tree path ``path``, its leading coordinates (layer, then global expert) and their sizes."""
    spec = spec_of(cfg, path if path.startswith("model/") else "model/" + path.split("/", 2)[2])
    key, lead, sizes = dist_key(cfg, spec)
    if not path.startswith("model/"):
        key = f"optimizer.state.{path.split('/')[1]}.{key}"
    return key, lead, sizes


def _write_tensors(build, cfg, writer: DcpWriter, rank: int, optim) -> None:
    sharding = build.runner.D
    prefixes = ("model/", "optimizer/") if optim == "fully_reshardable" else ("model/",)
    paths = [q for q in build.paths(rank) if q.startswith(prefixes)
             and any(c.ranks[0] == rank for c in sharding.classes(q))]
    coord = build.to.coord(rank)
    for path, local in build.stream(rank, paths):
        key, lead, lead_sizes = _dcp_key(cfg, path)
        size = sharding.physical_shape(build.tree[path])
        held = sharding.holding(path, coord)
        for piece in held.pieces:
            data = piece_view(local, piece).reshape((1,) * len(lead) + tuple(piece.box.sizes))
            writer.tensor(key, lead_sizes + size, lead + piece.box.offsets, data)
        del local


def _write_buffers(build, cfg, writer, t, p, rank, dtypes, values) -> None:
    to = build.to
    m = t + to.tp * p
    layout = buffer_layout(cfg, to, p, to.dp)
    flats, buckets = flat_buffers(cfg, to, p, lambda jobs: build.fill(rank, jobs))
    for b, (offset, numel) in enumerate(buckets):
        for state in OPTIMIZER_STATES:
            writer.tensor(flat_key(m, b, state, dtypes), (numel,), (0,), flats[state][offset:offset + numel])
    del flats
    key = dtype_key(dtypes)
    objects = {"optimizer": {"param_groups": values.param_groups()},
               "per_bucket_numel": [{key: [padded for _, _, padded in layout]}],
               "per_bucket_numel_unpadded": [{key: [n for _, n, _ in layout]}]}
    for name, data in objects.items():
        writer.object(object_key(m, name), [data])


def _write_extra_states(cfg, to, writer, p) -> None:
    """Stage ``p``'s ``_extra_state`` objects (all None), expert ones per (layer, global expert)."""
    for v in range(to.vpp):
        for layer in to.chunk_layers(p, v, cfg.num_layers):
            for key in extra_state_objects(cfg, layer):
                writer.object(key, [None])
