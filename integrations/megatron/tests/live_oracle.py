"""megatron-core itself as the oracle for the distributed optimizer's dp ranges (one child process).

The child applies the CPU shim, starts a one-process gloo group, and for each
request builds megatron-core's own ``DistributedDataParallel`` over a module
with the stage's parameters (tp-local shapes, ``shared_embedding`` marks) and
process groups that report the requested dp size and pp rank, then asks
``DistributedOptimizer._build_model_gbuf_range`` for each dp rank's ranges.
Nothing of megatron-core's rules is restated here; that is the point.
"""

from __future__ import annotations

import os
import socket


class _Group:
    """A process group stand-in that only reports a size and a rank."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _module(named):
    import torch

    root = torch.nn.Module()
    for name, param in named:
        *mods, leaf = name.split(".")
        m = root
        for part in mods:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, param)
    return root


def megatron_ranges(cfg_json: dict, config_json: dict, stage: int, ddp: dict) -> dict:
    """``{tree path: [(lo, hi) or None per dp rank]}`` as megatron-core computes them."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tenplex.ptree.config import ParallelConfig
    from tenplex.ptree.sharding import Sharding
    from tenplex.ptree.tree import PTree, torch_dtype
    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.live.params import stage_params

    cfg, config = MegatronConfig.from_json(cfg_json), ParallelConfig.from_json(config_json)
    params = stage_params(cfg, config, stage)
    sharding = Sharding(PTree({p.spec.path: p.spec.leaf for p in params}, cfg.num_layers), config)
    named, path_of = [], {}
    for p in params:
        shape = sharding.tp_local(p.spec.leaf, 0)[0]
        t = torch.nn.Parameter(torch.zeros(shape, dtype=torch_dtype(cfg.params_dtype)))
        if p.shared_embedding:
            t.shared_embedding = True
        named.append((p.name, t))
        path_of[id(t)] = p.spec.path
    pg = ProcessGroupCollection()
    for key in ("dp", "dp_cp", "expt_dp"):
        setattr(pg, key, _Group(config.dp))
    pg.tp, pg.ep, pg.pp = _Group(config.tp), _Group(1), _Group(config.pp, stage)
    dtype = torch_dtype(cfg.params_dtype)
    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, pipeline_dtype=dtype)
    model = DistributedDataParallel(tc, DistributedDataParallelConfig(**ddp), _module(named),
                                    pg_collection=pg)
    out = {path: [None] * config.dp for path in path_of.values()}
    for buf in model.buffers:
        for d in range(config.dp):
            buf.data_parallel_group = _Group(config.dp, d)
            for b in range(len(buf.buckets)):
                ranges = DistributedOptimizer._build_model_gbuf_range(buf, b)["param_map"]
                for param, r in ranges.items():
                    out[path_of[id(param)]][d] = (r["param"].start, r["param"].end)
    return out


def spec_from_ddp(cfg_json: dict, ddp: dict) -> dict:
    """``LiveSpec.from_ddp_config`` over a real ``DistributedDataParallelConfig``, as plain fields."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.live.spec import LiveSpec

    spec = LiveSpec.from_ddp_config(MegatronConfig.from_json(cfg_json), DistributedDataParallelConfig(**ddp))
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "model"}


def serve(conn) -> None:
    """Answer ``(cfg_json, config_json, stage, ddp kwargs)`` requests (or ``("spec", cfg_json, ddp)``)
    until ``None`` arrives."""
    import traceback

    from tenplex_megatron import cpu_shim

    cpu_shim.apply()
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    while True:
        request = conn.recv()
        if request is None:
            break
        try:
            conn.send(("ok", spec_from_ddp(*request[1:]) if request[0] == "spec" else megatron_ranges(*request)))
        except Exception:  # the test reports the child's traceback
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
