"""Which ``dp_reshardable`` flat buffers a ``torch_dist`` checkpoint holds, and under which keys.

megatron-core 0.16.1 builds one ``DistributedOptimizer`` over the dense
parameters and, when experts are split over ep > 1 ranks (their
``allreduce`` is False), a second one over the expert parameters, chained
in a ``ChainedOptimizer`` (``optimizer/__init__.py::get_megatron_optimizer``).
With ``dp_reshardable`` every key of sub-optimizer ``i`` gets the prefix
``chained_<i>.`` when there are two (``ChainedOptimizer.sharded_state_dict``
adds it for non fully-reshardable types; one sub-optimizer delegates
without a prefix). Each sub-optimizer stores, per ``dp_group_idx`` (its
``data_parallel_group_idx``):

- dense: the rank in the tp x pp model-parallel group, ``tp_rank + tp * pp_rank``;
- expert: the rank in the etp x ep x pp group,
  ``etp_rank + etp * (ep_rank + ep * pp_rank)`` (``parallel_state`` builds it
  from ``get_ranks('tp-ep-pp')``; group ranks follow the global rank order);

one ``gbuf_idx`` per non-empty buffer, in model-chunk (vpp) order
(``DistributedOptimizer.buffers`` chains ``per_model_buffers``), each keyed by
``(param_dtype, grad_dtype)``, cut into buckets
(``optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_(<p>, <g>).bucket_idx_<b>.<state>``,
1-D float32 of the bucket's unpadded numel), and the objects
``optimizer.distributed.dp_group_idx_<m>.{optimizer, per_bucket_numel,
per_bucket_numel_unpadded}``. Seen on disk: tp1 ep2 (world 2) and pp2
vpp2 ep2 (world 4) saved by megatron-core 0.16.1 (``NOTES.md``). The dense
buffers are sharded over dp x cp, the expert ones over expert-dp; each
bucket's layout is :func:`tenplex_megatron.model.flatbuf.buffer_layout`'s.
"""

from __future__ import annotations

from typing import NamedTuple

from tenplex.ptree.config import Coord, ParallelConfig

from tenplex_megatron.model.derived import derived
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.formats.dist.keys import flat_key, object_key
from tenplex_megatron.model.flatbuf import buffer_layout, shard_group
from tenplex_megatron.model.layouts import OPTIMIZER_STATES, spec_of

__all__ = ["OptimBuffer", "optimizer_buffers", "expected_flat", "flat_index", "chained"]


class OptimBuffer(NamedTuple):
    """One distributed-optimizer buffer of a ``dp_reshardable`` checkpoint.

    Attributes:
        prefix: ``""`` (one optimizer), ``"chained_0."`` (dense) or ``"chained_1."`` (expert).
        group_idx: the sub-optimizer's ``dp_group_idx``.
        gbuf: the buffer's ``gbuf_idx`` within its sub-optimizer.
        chunk: the virtual pipeline chunk it belongs to.
        expert: an expert buffer (sharded over expert-dp) rather than a dense one (dp x cp).
        split: the tp rank (the etp rank for an expert buffer) of its holders.
        pp: their pipeline stage.
        ep: their ep rank (0 for a dense buffer).
    """

    prefix: str
    group_idx: int
    gbuf: int
    chunk: int
    expert: bool
    split: int
    pp: int
    ep: int

    def layout(self, cfg: MegatronConfig, config: ParallelConfig, padded: bool = False):
        """:func:`buffer_layout` of this buffer (padding for its shard group when ``padded``)."""
        group = shard_group(config, self.expert) if padded else 1
        return buffer_layout(cfg, config, self.pp, group, chunk=self.chunk, expert=self.expert, ep_rank=self.ep)

    def key(self, bucket: int, state: str, dtypes) -> str:
        return self.prefix + flat_key(self.group_idx, bucket, state, dtypes, self.gbuf)

    def object(self, name: str) -> str:
        return self.prefix + object_key(self.group_idx, name)


def chained(cfg: MegatronConfig, config: ParallelConfig) -> bool:
    """Whether megatron-core chains a second (expert) optimizer: experts split over ep > 1."""
    return bool(cfg.num_moe_experts) and config.ep > 1


def optimizer_buffers(cfg: MegatronConfig, config: ParallelConfig) -> tuple[OptimBuffer, ...]:
    """Every buffer of every distributed optimizer of ``config``, dense ones first.

    Returns:
        One :class:`OptimBuffer` per (sub-optimizer, ``dp_group_idx``, ``gbuf_idx``)
        (made once per ``cfg`` object and config, :func:`~tenplex_megatron.model.derived.derived`).
    """
    return derived(cfg, ("buffers", config), lambda: _make_buffers(cfg, config))


def _make_buffers(cfg: MegatronConfig, config: ParallelConfig) -> tuple[OptimBuffer, ...]:
    two = chained(cfg, config)
    out = []
    for p in range(config.pp):
        for t in range(config.tp):
            out += _group(cfg, config, "chained_0." if two else "", t + config.tp * p, False, t, p, 0)
    if two:
        for p in range(config.pp):
            for e in range(config.ep):
                for t in range(config.etp):
                    out += _group(cfg, config, "chained_1.", t + config.etp * (e + config.ep * p), True, t, p, e)
    return tuple(out)


def _group(cfg, config, prefix, idx, expert, t, p, e) -> list[OptimBuffer]:
    out: list[OptimBuffer] = []
    for v in range(config.vpp):
        buf = OptimBuffer(prefix, idx, len(out), v, expert, t, p, e)
        if any(entries for entries, _, _ in buf.layout(cfg, config)):
            out.append(buf)
    return out


def expected_flat(cfg: MegatronConfig, config: ParallelConfig, dtypes) -> dict[str, int]:
    """``{DCP key: numel}`` of every flat tensor a ``dp_reshardable`` checkpoint of ``config`` holds,
    with buffer dtypes ``dtypes`` (``(param_dtype, grad_dtype)`` names). Computed once per
    arguments (the metadata check asks for every item); do not modify the result."""
    return _expected_flat(cfg, config, tuple(dtypes))


def _expected_flat(cfg: MegatronConfig, config: ParallelConfig, dtypes: tuple) -> dict[str, int]:
    return derived(cfg, ("expected_flat", config, dtypes), lambda: _make_expected_flat(cfg, config, dtypes))


def _make_expected_flat(cfg: MegatronConfig, config: ParallelConfig, dtypes: tuple) -> dict[str, int]:
    out = {}
    for buf in optimizer_buffers(cfg, config):
        for b, (_, numel, _) in enumerate(buf.layout(cfg, config)):
            for state in OPTIMIZER_STATES:
                out[buf.key(b, state, dtypes)] = numel
    return out


def _paths(cfg: MegatronConfig, config: ParallelConfig) -> dict:
    return derived(cfg, ("paths", config), lambda: _make_paths(cfg, config))


def _make_paths(cfg: MegatronConfig, config: ParallelConfig) -> dict:
    out: dict = {}
    for buf in optimizer_buffers(cfg, config):
        for b, (entries, _, _) in enumerate(buf.layout(cfg, config)):
            for spec, start, numel in entries:
                out[(spec.path, buf.expert, buf.split, buf.pp, buf.ep)] = (buf, b, start, numel)
    return out


def flat_index(cfg: MegatronConfig, config: ParallelConfig, path: str, coord: Coord
               ) -> tuple[OptimBuffer, int, int, int] | None:
    """Where model path ``path`` of the rank at ``coord`` lies: ``(buffer, bucket, start, numel)``
    (start within the bucket, in elements), or None when no buffer of that rank holds it."""
    index = _paths(cfg, config)
    expert = chained(cfg, config) and spec_of(cfg, path).expert is not None
    key = (path, True, coord.etp, coord.pp, coord.ep) if expert else (path, False, coord.tp, coord.pp, 0)
    return index.get(key)
