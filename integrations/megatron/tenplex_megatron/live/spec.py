"""The tree of a running megatron-core job: model, optimizer (dp-sharded as it is held), position.

Leaves (global layer indices in paths):

- ``model/...``: the parameters (``params_dtype``, e.g. bf16), replicated over dp;
- ``optimizer/param/...``: fp32 main params (only for 16-bit params; with fp32
  params the main param is the model param);
- ``optimizer/exp_avg/...``, ``optimizer/exp_avg_sq/...``: Adam's moments, fp32;
- ``optimizer/step`` (Adam's step), ``optimizer/scheduler`` (the
  ``OptimizerParamScheduler`` state), ``data/consumed_samples``: global values;
- ``rng/states``: the RNG tracker's and torch's generator states, per (tp, pp).

With the distributed optimizer, optimizer leaves are dp-sharded exactly as
megatron-core 0.16 holds them (``distributed/param_and_grad_buffer.py::
_ParamAndGradBuffer.__init__``, ``optimizer/distrib_optimizer.py::
_build_model_gbuf_range``): one flat buffer per ``(param_dtype, grad_dtype)``,
parameters in reverse ``named_parameters()`` order, each starting on a
multiple of 64 elements, buckets closed after ``bucket_size`` elements (one
bucket without ``overlap_grad_reduce``, and on every stage but the first),
a ``shared_embedding`` parameter (tied embeddings, pp > 1) in a bucket of its
own, each bucket padded to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128,
2**16)`` with ``pad_buckets_for_high_nccl_busbw``) and cut into dp equal
contiguous ranges. :func:`megatron_dp_ranges` restates these rules; the tree
is checked against them for every config it is used at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm, prod

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.layout import DPShard, FlatBuffer
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf

from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import optimizer_path, param_specs
from tenplex_megatron.live.params import stage_params

__all__ = ["LiveSpec", "megatron_dp_ranges", "LIVE_VALUES", "MOMENTS"]

ALIGN = 64
"""``_pad_start_of_param_if_needed``: each parameter starts on a multiple of 64 elements."""
BUCKET_PAD = 128
"""``_pad_end_of_bucket_if_needed``: buckets end on a multiple of ``lcm(dp, 128)``."""
HIGH_BUSBW_PAD = lcm(128, 2 ** 16)
MOMENTS = ("exp_avg", "exp_avg_sq")
LIVE_VALUES = {
    "optimizer/step": ValueLeaf(),
    "optimizer/scheduler": ValueLeaf(),
    "data/consumed_samples": ValueLeaf(),
    "rng/states": ValueLeaf(Scope.COORD, ("tp", "pp")),
}


@dataclass(frozen=True)
class LiveSpec:
    """What the tree of a megatron-core job depends on besides its parallel config.

    Attributes:
        model: the model's shape; ``model.params_dtype`` is the parameters' dtype.
        distributed_optimizer: ``use_distributed_optimizer`` (dp-sharded optimizer state).
        overlap_grad_reduce: DDP's ``overlap_grad_reduce`` (without it, one bucket per buffer).
        bucket_size: DDP's ``bucket_size`` in elements as given (``None``: megatron's
            default ``max(40_000_000, 1_000_000 * dp)``); used only with ``overlap_grad_reduce``.
        grad_reduce_in_fp32: DDP's ``grad_reduce_in_fp32`` (names the buffer).
        pad_buckets_for_high_nccl_busbw: DDP's option of that name.
    """

    model: MegatronConfig
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    grad_reduce_in_fp32: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False

    def __post_init__(self) -> None:
        if self.model.params_dtype == "float16":
            raise ConfigError("LiveSpec: fp16 params need the dynamic loss scaler's state, which the live "
                              "tree does not carry yet; use bfloat16 or float32")

    @classmethod
    def from_ddp_config(cls, model: MegatronConfig, ddp_config) -> "LiveSpec":
        """From a megatron-core ``DistributedDataParallelConfig``.

        DDP overwrites ``ddp_config.bucket_size`` with its effective value at the
        dp it was built for; for dp <= 40 that equals the default at any dp <= 40.
        """
        return cls(model, bool(ddp_config.use_distributed_optimizer),
                   bool(ddp_config.overlap_grad_reduce), ddp_config.bucket_size,
                   bool(ddp_config.grad_reduce_in_fp32), bool(ddp_config.pad_buckets_for_high_nccl_busbw))

    @property
    def main_params(self) -> bool:
        """Whether the optimizer keeps separate fp32 main params (16-bit model params)."""
        return self.model.params_dtype in ("bfloat16", "float16")

    @property
    def buffer_name(self) -> str:
        grad = "float32" if self.grad_reduce_in_fp32 else self.model.params_dtype
        return f"param_and_grad_buffer.{self.model.params_dtype}.{grad}"

    def effective_bucket_size(self, dp: int) -> int | None:
        """DDP's bucket size on the first stage (``distributed_data_parallel.py::__init__``)."""
        if not self.overlap_grad_reduce:
            return None
        return self.bucket_size if self.bucket_size is not None else max(40_000_000, 1_000_000 * dp)

    @property
    def pad_multiple(self) -> int:
        return HIGH_BUSBW_PAD if self.pad_buckets_for_high_nccl_busbw else BUCKET_PAD

    def tree(self, *configs: ParallelConfig) -> PTree:
        """The tree of this job, valid at every one of ``configs``.

        Raises:
            ConfigError: a config cannot hold the model, or megatron-core's buffer
                layout at the configs cannot be described by one tree (see
                ``_representations``).
        """
        if not configs:
            raise ConfigError("LiveSpec.tree: give at least one parallel config")
        first_error = None
        for own_embedding_bucket, bucket_numel in self._representations(configs):
            tree = self._build(own_embedding_bucket, bucket_numel)
            for config in configs:
                tree.validate(config)
            if not self.distributed_optimizer:
                return tree
            mismatch = next(filter(None, (_mismatch(self, tree, c) for c in configs)), None)
            if mismatch is None:
                return tree
            first_error = first_error or mismatch
        raise ConfigError(f"the distributed optimizer's buffers at {', '.join(map(str, configs))} cannot "
                          f"be described by one tree: {first_error}")

    def _representations(self, configs):
        # PENDING CORE RULE (helper `axes`): the core FlatBuffer has no "member gets its own
        # bucket" rule and one bucket_numel for every stage. Until it has, a shared embedding's
        # own bucket is described by a FlatBuffer of its own (exact while pp > 1 at every config),
        # and bucket_size by the one value that matches every config. Replace this with the
        # core rule when it merges.
        owns = (False, True) if self.model.tied else (False,)
        sizes = [None] + sorted({s for s in (self.effective_bucket_size(c.dp) for c in configs) if s})
        return [(own, size) for own in owns for size in sizes]

    def _build(self, own_embedding_bucket: bool, bucket_numel: int | None) -> PTree:
        specs = param_specs(self.model)
        main = self.buffer_name
        shared = specs[0].path if own_embedding_bucket else None
        buffers = [FlatBuffer(main, tuple(s.path for s in reversed(specs) if s.path != shared),
                              ALIGN, self.pad_multiple, bucket_numel)]
        if shared is not None:
            buffers.append(FlatBuffer(f"{main}.shared_embedding", (shared,), ALIGN, self.pad_multiple))
        leaves: dict = {s.path: s.leaf for s in specs}
        states = (("param",) if self.main_params else ()) + MOMENTS
        for state in states:
            for s in specs:
                layout = s.leaf.layout
                if self.distributed_optimizer:
                    name = buffers[-1].name if s.path == shared else main
                    layout = replace(layout, dp_shard=DPShard(name, s.path))
                leaves[optimizer_path(state, s.path)] = TensorLeaf(s.leaf.shape, "float32", layout)
        leaves.update(LIVE_VALUES)
        return PTree(leaves, self.model.num_layers, tuple(buffers) if self.distributed_optimizer else ())


def megatron_dp_ranges(spec: LiveSpec, config: ParallelConfig, stage: int) -> dict:
    """Per parameter of ``stage``, the flat range of its tp-local tensor each dp rank holds.

    A restatement of megatron-core 0.16's ``_ParamAndGradBuffer.__init__`` and
    ``DistributedOptimizer._build_model_gbuf_range`` (see the module docstring).

    Returns:
        ``{tree path: [(lo, hi) or None for dp rank 0 .. dp-1]}``, elements.
    """
    params = stage_params(spec.model, config, stage)
    sharding = Sharding(PTree({s.spec.path: s.spec.leaf for s in params}, spec.model.num_layers), config)
    bucket_size = spec.effective_bucket_size(config.dp) if stage == 0 else None
    divisor = lcm(config.dp, spec.pad_multiple)
    pad = lambda n, m: -(-n // m) * m
    buckets, members = [], []
    start = bucket_start = 0

    def close(end: int) -> int:
        nonlocal members, bucket_start
        buckets.append((bucket_start, pad(end, divisor), members))
        members, bucket_start = [], pad(end, divisor)
        return bucket_start

    for p in reversed(params):
        numel = prod(sharding.tp_local(p.spec.leaf, 0)[0])
        start = pad(start, ALIGN)
        if p.shared_embedding and members:
            start = close(start)
        end = start + numel
        members.append((p.spec.path, start, end))
        full = bucket_size is not None and end - bucket_start >= bucket_size
        start = close(end) if full or p.shared_embedding else end
    if members:
        close(start)
    out = {}
    for lo_b, hi_b, entries in buckets:
        per = (hi_b - lo_b) // config.dp
        for path, a, b in entries:
            ranges = []
            for d in range(config.dp):
                lo, hi = max(a, lo_b + d * per), min(b, lo_b + (d + 1) * per)
                ranges.append((lo - a, hi - a) if hi > lo else None)
            out[path] = ranges
    return out


def _mismatch(spec: LiveSpec, tree: PTree, config: ParallelConfig) -> str | None:
    """Where ``tree`` and megatron-core disagree at ``config``, or ``None``."""
    sharding = Sharding(tree, config)
    for stage in range(config.pp):
        for path, ranges in megatron_dp_ranges(spec, config, stage).items():
            leaf = tree[optimizer_path(MOMENTS[0], path)]
            got = [sharding.dp_range(leaf, d, stage) for d in range(config.dp)]
            if got != ranges:
                return f"at {config}, stage {stage}, {path}: megatron-core holds {ranges} per dp rank, " \
                       f"the tree {got}"
    return None
