"""``torch_dist`` to ``torch_dist``: a direct reshard that copies DCP items as they are.

``dist_checkpointing`` stores model-space (global) tensors, so between two
``torch_dist`` directories no region moves. Only three things change with
the config: the padded vocabulary rows (kept where both sides have them,
zero-filled when new, dropped when gone), the ``args`` in ``common.pt``,
and Megatron-LM's RNG states, which are keyed by the (pp, tp) grid
(re-keyed: a coordinate of both grids keeps its state, a new one gets a
state derived from the seed). Every other item is copied byte for byte,
one item at a time, into a file of the same name. ``dp_reshardable``
optimizer buffers, ``fully_sharded_model_space`` state (flattened tp shards) and
``dp_zero_gather_scatter`` objects depend on the layout, so their directories go through the planner instead (:func:`reshard_dist` returns None).
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.transform.plan import PaddingChange

from tenplex_megatron.formats.common import TargetValues
from tenplex_megatron.formats.dist.keys import COMMON_STATE, RNG_KEY, optimizer_prefix, optimizer_states, rng_objects
from tenplex_megatron.formats.dist.dp_zero import DP_ZERO
from tenplex_megatron.formats.dist.model_space import MODEL_SPACE
from tenplex_megatron.formats.dist.read import read_common
from tenplex_megatron.dcp.records import MetadataIndex, TensorStorageMetadata
from tenplex_megatron.formats.dist.source import DistSource, chunk_path, open_dist
from tenplex_megatron.dcp.write import DcpWriter
from tenplex_megatron.formats.dist.write import commit_dir, temp_dir
from tenplex_megatron.model.vocab import check_target_vocab
from tenplex_megatron.model.layouts import check_attention_tp, param_specs

__all__ = ["reshard_dist"]

_COPY = 64 << 20


def reshard_dist(src: str, dst: str, to: ParallelConfig, model_config: dict | None = None,
                 iteration: int | str | None = None, names: str | None = None) -> dict | None:
    """Reshard a ``torch_dist`` directory to ``to`` directly, or return None if it needs the planner.

    ``src`` is read as :func:`tenplex_megatron.formats.folders.locate` finds it; ``dst`` is
    written as a ``--save`` root (the iteration folder, then the tracker).

    Returns:
        ``{"src", "bytes_read", "bytes_written", "files", "padding", "notes", "direct": True}``.

    Raises:
        ConfigError: ``to`` cannot hold the model.
        AlreadyExistsError: ``dst`` exists.
        ManifestError: a bad source (see :func:`tenplex_megatron.formats.dist.source.open_dist`).
    """
    source = open_dist(src, model_config, iteration)
    if source.optim in ("dp_reshardable", MODEL_SPACE, DP_ZERO) or names not in (None, source.meta["megatron"].get("names")):
        return None  # optimizer state follows the layout, or keys are renamed: through the planner
    cfg = source.desc.cfg
    source.tree.validate(to)
    check_attention_tp(cfg, to.tp)
    check_target_vocab(cfg, to.tp)
    vocab = {k: p for k, p in _vocab_keys(cfg, source.optim).items() if k in source.md.state_dict_metadata}
    old, new = cfg.padded_vocab(source.config.tp), cfg.padded_vocab(to.tp)
    values = _target_values(source, to)
    tmp = temp_dir(dst, values.iteration)
    try:
        writer = DcpWriter(tmp)
        by_file: dict[str, list] = {}
        for index, info in source.md.storage_data.items():
            by_file.setdefault(info.relative_path, []).append((info.offset, index, info))
        for name in sorted(by_file):
            writer.open(name)
            for _, index, info in sorted(by_file[name], key=lambda x: x[0]):
                _copy_item(source, writer, index, info, vocab, old, new)
        for key, item in source.md.state_dict_metadata.items():
            if key in vocab and new > old and isinstance(item, TensorStorageMetadata):
                _zero_rows(writer, key, item, old, new)
        if values.had_rng:
            states = values.rng_states(per_dp=to.ep > 1)
            for p in range(to.pp):
                for t in range(to.tp):
                    for key, data in rng_objects(states[f"tp={t},pp={p}"], t, p, to, values.dp_random_init):
                        writer.object(key, [data])
        writer.finish()
        commit_dir(tmp, dst, _common(source, values), values.iteration)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    padding = [PaddingChange(path, 0, cfg.vocab_size, old, new) for path in sorted(set(vocab.values()))] \
        if old != new else []
    return {"src": str(source.config), "bytes_read": source.bytes_read, "bytes_written": writer.bytes_written,
            "files": len(by_file), "padding": padding, "notes": values.notes, "direct": True}


def _vocab_keys(cfg, optim: str | None) -> dict[str, str]:
    """``{DCP key: tree path}`` of every vocabulary-padded tensor (model and model-space optimizer,
    keyed as :func:`~tenplex_megatron.formats.dist.keys.optimizer_prefix` says)."""
    out = {}
    for spec in param_specs(cfg):
        if spec.leaf.layout.padding is not None:
            out[spec.dist] = spec.path
            for state in optimizer_states(optim, cfg.params_dtype):
                out[optimizer_prefix(optim, state, cfg.params_dtype) + spec.dist] = \
                    f"optimizer/{state}/{spec.path.removeprefix('model/')}"
    return out


def _target_values(source: DistSource, to: ParallelConfig) -> TargetValues:
    values = {path: source.value(path, "") for path, leaf in source.tree.values()
              if path != "megatron/rng_state"}
    stored = {key: source.value("megatron/rng_state", key) for key in source.desc.values["megatron/rng_state"]}
    values["megatron/rng_state"] = {f"tp={t},pp={p}": stored.get(f"tp={t},pp={p}")
                                    for p in range(to.pp) for t in range(to.tp)} if stored else {}
    out = TargetValues(values, source.desc.cfg, to)
    out.had_rng = bool(stored)
    if not stored:
        out.notes.append("rng: the source stores no RNG state; none is written")
    return out


def _common(source: DistSource, values: TargetValues) -> dict:
    """The source's ``common.pt`` with the target's args and, for an MoE model, its optimizer
    entry fitted to the target's sub-optimizers: ``{0: dense, 1: expert}`` at ep > 1, the dense
    one alone at ep = 1 (megatron-core's loader fails on the other form, FACTS 6.7)."""
    common = read_common(source.root, source.md)
    if common.get("args") is not None:
        common["args"] = values.args
    optimizer = common.get("optimizer")
    if values.cfg.num_moe_experts and isinstance(optimizer, dict) and optimizer:
        dense = optimizer[0] if set(optimizer) == {0, 1} else optimizer
        groups = values.expert_param_groups()  # a non-distributed optimizer keeps its groups at the top
        expert = copy.deepcopy(dense)  # nothing shared: torch.save keeps shared objects shared, and
        # dist_checkpointing.load merges loaded state into them ("Duplicate non-dict ... values")
        if "param_groups" in dense:
            expert["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        elif "state" in (dense.get("optimizer") or {}):  # the same over bf16/fp16 params, one level down
            expert["optimizer"]["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        else:
            expert["optimizer"] = {"param_groups": groups}
        common["optimizer"] = dense if values.config.ep == 1 else {0: dense, 1: expert}
    return common


def _copy_item(source, writer, index: MetadataIndex, info, vocab, old: int, new: int) -> None:
    key = index.fqn
    if RNG_KEY.match(key) or key == COMMON_STATE:
        return  # re-keyed for the target grid; the common state goes to common.pt (read by 0.16 to 0.19)
    item = source.md.state_dict_metadata[key]
    path = chunk_path(source.root, info.relative_path)
    if not isinstance(item, TensorStorageMetadata):
        writer.object(key, raw=_read(source, path, info.offset, info.length))
        return
    size = tuple(item.size)
    box = Box(tuple(index.offset), next(tuple(c.sizes) for c in item.chunks
                                       if tuple(c.offsets) == tuple(index.offset)))
    if key in vocab and old != new:
        size = (new,) + size[1:]
        if box.offsets[0] >= new:
            return  # rows that no longer exist
        if box.offsets[0] + box.sizes[0] > new:  # cut at the new padded size
            keep = new - box.offsets[0]
            chunk = source.fetch_chunk(key, box, item.properties.dtype)[:keep].clone()
            writer.tensor(key, size, box.offsets, chunk)
            return
    writer.raw_tensor(key, size, item.properties.dtype, box.offsets, box.sizes,
                      lambda f: _stream(source, path, info.offset, info.length, f))


def _zero_rows(writer, key, item, old: int, new: int) -> None:
    size = (new,) + tuple(item.size)[1:]
    writer.tensor(key, size, (old,) + (0,) * (len(size) - 1),
                  torch.zeros((new - old,) + size[1:], dtype=item.properties.dtype))


def _read(source, path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise ManifestError(f"{path}: short read at [{offset}, {offset + length}); the file is truncated")
    source.count(length)
    return data


def _stream(source, path: str, offset: int, length: int, out) -> None:
    buf = np.empty(min(length, _COPY), dtype=np.uint8)
    done = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < length:
            n = f.readinto(memoryview(buf)[:min(len(buf), length - done)])
            if not n:
                        raise ManifestError(f"{path}: short read at byte {offset + done}; the file is truncated")
            out.write(memoryview(buf)[:n])
            done += n
    source.count(length)
