"""Megatron's distributed-optimizer flat buffers: ``dp_reshardable`` and ``distrib_optim.pt``.

Layout rules, from megatron-core 0.16's
``distributed/param_and_grad_buffer.py::_ParamAndGradBuffer.__init__``:
parameters of one (tp, pp) rank are laid out in **reverse**
``named_parameters()`` order with their tp-local sizes; each starts on a
multiple of 64 elements (``_pad_start_of_param_if_needed``); a bucket ends
after ``bucket_size`` elements (one bucket when ``bucket_size`` is None, the
default without ``overlap_grad_reduce``), and with pp > 1 and tied embeddings
the shared embedding has a bucket of its own
(``_does_param_require_new_bucket``); a bucket's padded size is a multiple
of ``lcm(dp, 128)`` (``_pad_end_of_bucket_if_needed``). Both formats store
each bucket gathered over dp, unpadded: ``dp_reshardable`` as DCP tensors
``optimizer.distributed.dp_group_idx_<m>.gbuf_idx_0.dtype_(...).bucket_idx_<b>.<state>``
with ``m = tp_rank + tp * pp_rank``; ``distrib_optim.pt`` coalesced per buffer.

tenplex reads these buffers into model space (per-parameter optimizer state),
so they reshard across tp, pp and dp, and writes them for the target config
with one bucket per buffer (plus the shared embedding's own bucket).
"""

from __future__ import annotations

import io
import re
from math import lcm, prod

import torch

from tenplex.errors import ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.shards import assemble

from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.layouts import OPTIMIZER_STATES, megatron_tree, optimizer_path

__all__ = ["buffer_layout", "read_dp_reshardable", "write_dp_reshardable", "read_distrib_optim"]

ALIGN = 64
_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.*)\)\.bucket_idx_(\d+)\.(\w+)$")


def buffer_layout(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int, dp: int,
                  bucket_size: int | None = None):
    """Buckets of the (tp, ``pp_rank``) buffer: ``[(entries, unpadded, padded)]``.

    ``entries`` is ``[(spec, start, numel)]``, starts relative to the bucket.
    """
    from tenplex_megatron.legacy import _param_order

    tree = megatron_tree(cfg)
    sharding = Sharding(tree, config)
    params = list(reversed(_param_order(cfg, config, pp_rank)))
    shared = cfg.tied and config.pp > 1
    pad = lcm(dp, 128)
    buckets, entries = [], []
    start = 0
    for spec in params:
        numel = prod(sharding.tp_local(spec.leaf, 0)[0])
        own = shared and spec.path.endswith("word_embeddings/weight")
        start = -(-start // ALIGN) * ALIGN
        if own and entries:
            buckets.append((entries, start_unpadded(entries), 0))
            entries, start = [], 0
        entries.append((spec, start, numel))
        start += numel
        if (bucket_size is not None and start >= bucket_size) or own:
            buckets.append((entries, start, 0))
            entries, start = [], 0
    if entries:
        buckets.append((entries, start, 0))
    return [(e, n, -(-n // pad) * pad) for e, n, _ in buckets]


def start_unpadded(entries) -> int:
    spec, start, numel = entries[-1]
    return start + numel


def _dense(flat: torch.Tensor, start: int, numel: int, shape) -> torch.Tensor:
    return flat[start:start + numel].reshape(shape).clone()


def _stage_config(cfg: MegatronConfig, args, found: dict, where: str) -> ParallelConfig:
    """The saver's (tp, pp): from args, else the one factorization whose buffer sizes match."""
    groups = 1 + max(g for g, _, _ in found)
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    if tp and pp and tp * pp == groups:
        return ParallelConfig(1, tp, pp)
    matches = []
    for tp in (t for t in range(1, groups + 1) if groups % t == 0):
        config = ParallelConfig(1, tp, groups // tp)
        try:
            megatron_tree(cfg).validate(config)
        except ConfigError:
            continue
        sizes = {(t + tp * p, b): n for p in range(config.pp)
                 for b, (_, n, _) in enumerate(buffer_layout(cfg, config, p, 1)) for t in range(tp)}
        stored = {(m, b): found[(m, b, "param")].numel() for m, b, s in found if s == "param"}
        if sizes == stored:
            matches.append(config)
    if len(matches) != 1:
        raise ConfigError(f"{where}: cannot tell the saver's tp and pp from {groups} optimizer "
                          f"buffer groups ({len(matches)} candidates); the checkpoint has no args")
    return matches[0]


def read_dp_reshardable(cfg: MegatronConfig, args, tensors: dict, root: str) -> dict:
    """Global optimizer state (model space) from a ``dp_reshardable`` checkpoint's tensors."""
    found: dict = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m:
            found[(int(m.group(1)), int(m.group(4)), m.group(5))] = t
    if not found:
        raise ManifestError(f"{root}: no dp_reshardable optimizer buffers")
    config = _stage_config(cfg, args, found, root)
    shards = _shards_from_buffers(cfg, config, lambda m, b, state: found.get((m, b, state)), root)
    return _model_space(cfg, config, shards)


def _shards_from_buffers(cfg, config, get, where) -> dict:
    tree = megatron_tree(cfg)
    sharding = Sharding(tree, config)
    shards: dict = {}
    for p in range(config.pp):
        layout = buffer_layout(cfg, config, p, 1)
        for t in range(config.tp):
            m = t + config.tp * p
            rank = config.rank(config.coord(0)._replace(tp=t, pp=p))
            out = shards.setdefault(rank, {})
            for b, (entries, unpadded, _) in enumerate(layout):
                for state in OPTIMIZER_STATES:
                    flat = get(m, b, state)
                    if flat is None or flat.numel() < unpadded:
                        raise ManifestError(f"{where}: optimizer buffer {state} of model-parallel rank "
                                            f"{m}, bucket {b}: expected {unpadded} elements, found "
                                            f"{None if flat is None else flat.numel()}")
                    for spec, start, numel in entries:
                        shape = sharding.tp_local(spec.leaf, t)[0]
                        out[optimizer_path(state, spec.path)] = _dense(flat, start, numel, shape).float()
    return shards


def _model_space(cfg, config, shards) -> dict:
    """Global optimizer tensors from per-rank dense shards (dp rank 0 of each (tp, pp))."""
    tree = megatron_tree(cfg, optimizer=True)
    sub = type(tree)({p: l for p, l in tree.tensors() if p.startswith("optimizer/")}, tree.num_layers)
    everyone = {r: shards[config.rank(config.coord(r)._replace(dp=0))] for r in range(config.world_size)}
    return assemble(sub, config, everyone, padded=True, check_replicas=False)


def read_distrib_optim(cfg: MegatronConfig, config: ParallelConfig, files: dict, where: str) -> dict:
    """Global optimizer state from legacy ``distrib_optim.pt`` files ``{(tp, pp): loaded dict}``."""
    def get(m, b, state):
        t, p = m % config.tp, m // config.tp
        data = files[(t, p)]
        buffers = data[0]
        (key,) = buffers.keys() if len(buffers) == 1 else (None,)
        if key is None:
            raise ManifestError(f"{where}: distrib_optim.pt with several buffers is not supported")
        flat = buffers[key][state]
        layout = buffer_layout(cfg, config, p, 1)
        offset = sum(n for _, n, _ in layout[:b])
        return flat[offset:]
    shards = _shards_from_buffers(cfg, config, get, where)
    return _model_space(cfg, config, shards)


def write_dp_reshardable(cfg: MegatronConfig, config: ParallelConfig, shards: dict, tree,
                         param_groups=None, dtype_key: str = "torch.float32, torch.float32") -> dict:
    """DCP items of a ``dp_reshardable`` checkpoint for ``config`` from target shards."""
    out: dict = {}
    sharding = Sharding(tree, config)
    for p in range(config.pp):
        layout = buffer_layout(cfg, config, p, config.dp)
        for t in range(config.tp):
            m = t + config.tp * p
            shard = shards[config.rank(config.coord(0)._replace(tp=t, pp=p))]
            for b, (entries, unpadded, _) in enumerate(layout):
                for state in OPTIMIZER_STATES:
                    flat = torch.zeros(unpadded, dtype=torch.float32)
                    for spec, start, numel in entries:
                        flat[start:start + numel] = shard[optimizer_path(state, spec.path)].reshape(-1)
                    out[f"optimizer.distributed.dp_group_idx_{m}.gbuf_idx_0.dtype_({dtype_key})."
                        f"bucket_idx_{b}.{state}"] = flat
            dtypes = (torch.float32, torch.float32)
            objects = {
                "optimizer": {"param_groups": param_groups or []},
                "per_bucket_numel": [{dtypes: [padded for _, _, padded in layout]}],
                "per_bucket_numel_unpadded": [{dtypes: [n for _, n, _ in layout]}],
            }
            for name, data in objects.items():
                buf = io.BytesIO()
                torch.save([data], buf)
                buf.seek(0)
                out[f"optimizer.distributed.dp_group_idx_{m}.{name}/shard_0_1"] = buf
    del sharding
    return out
