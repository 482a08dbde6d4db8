"""Megatron's distributed-optimizer flat buffers: ``distrib_optim.pt`` and ``dp_reshardable``.

Layout rules, from megatron-core 0.16's
``distributed/param_and_grad_buffer.py::_ParamAndGradBuffer.__init__``:
parameters of one (tp, pp) rank are laid out in **reverse**
``named_parameters()`` order with their tp-local sizes; each starts on a
multiple of 64 elements (``_pad_start_of_param_if_needed``); a bucket ends
after ``bucket_size`` elements (one bucket when ``bucket_size`` is None, the
default without ``overlap_grad_reduce``), and with pp > 1 and tied embeddings
the shared embedding has a bucket of its own
(``_does_param_require_new_bucket``); a bucket's padded size is a multiple
of ``lcm(dp, 128)`` (``_pad_end_of_bucket_if_needed``). Buffers are keyed by
``(param_dtype, grad_dtype)`` (``distributed_data_parallel.py::
_allocate_buffers_for_parameters``): ``(torch.bfloat16, torch.float32)`` for
bf16 params with fp32 gradient reduction. Both formats store each bucket
gathered over dp, unpadded: ``dp_reshardable`` as DCP tensors
``optimizer.distributed.dp_group_idx_<m>.gbuf_idx_0.dtype_(<param>, <grad>).bucket_idx_<b>.<state>``
with ``m = tp_rank + tp * pp_rank``; ``distrib_optim.pt`` coalesced per buffer.
The optimizer state in them (fp32 main params and Adam moments) is float32.

tenplex reads these buffers as per-parameter optimizer state, so they
reshard across tp, pp and dp, and writes them for the target config with
one bucket per buffer (plus the shared embedding's own bucket).
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable

import torch

from tenplex.errors import ManifestError
from tenplex.ptree.buffer import layout_buffer
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.model.derived import derived
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import OPTIMIZER_STATES, megatron_tree, optimizer_path, param_order
from tenplex_megatron.torchfiles.ptfile import TensorRef
from tenplex_megatron.torchfiles.safe_load import TORCH_DTYPES

__all__ = ["ALIGN", "buffer_layout", "buffer_dtypes", "dtype_key", "distrib_optim_refs", "flat_buffers",
           "flat_numel", "shard_group", "distrib_optim_state", "FLAT_DTYPE"]

ALIGN = 64
PAD_MULTIPLE = 128
FLAT_DTYPE = torch.float32
"""The dtype of the optimizer state in the buffers (fp32 main params and moments)."""


def _sharding(cfg: MegatronConfig, config: ParallelConfig) -> Sharding:
    return derived(cfg, ("sharding", config), lambda: Sharding(megatron_tree(cfg), config))


def buffer_layout(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int, group: int = 1,
                  bucket_size: int | None = None, chunk: int = 0, expert: bool = False,
                  ep_rank: int = 0):
    """Buckets of one DDP buffer of rank (tp, ``pp_rank``): ``[(entries, unpadded, padded)]``.

    The rule is core's :func:`tenplex.ptree.buffer.layout_buffer` (megatron-core's
    ``_ParamAndGradBuffer``: reverse ``named_parameters()`` order, 64-element
    alignment, buckets padded to ``lcm(group, 128)``, the shared embedding in a
    bucket of its own).

    Args:
        group: the ranks the buffer is sharded over (dp x cp, or edp for experts).
        chunk: the virtual pipeline chunk (one DDP, hence one buffer set, per chunk).
        expert: the expert buffer (parameters with ``allreduce=False``: experts when
            ep > 1) instead of the dense one; at ep = 1 experts are in the dense buffer.
        ep_rank: the ep rank whose experts (and, for the dense buffer, nothing else) count.

    Returns:
        ``entries`` is ``[(spec, start, numel)]``, starts relative to the bucket, in elements;
        ``unpadded`` includes the alignment gaps (megatron's ``numel_unpadded``).
    """
    sharding = _sharding(cfg, config)
    shared = cfg.tied and config.pp > 1
    specs = {}
    entries = []
    for spec in reversed(param_order(cfg, config, pp_rank, chunk, ep_rank)):
        if (spec.expert is not None and config.ep > 1) != expert:
            continue
        specs[spec.path] = spec
        own = shared and spec.path.endswith("word_embeddings/weight")
        entries.append((spec.path, prod(sharding.tp_local(spec.leaf, 0)[0]), own))
    layout = layout_buffer(entries, group, ALIGN, PAD_MULTIPLE, bucket_size)
    out = [([], b.numel, b.padded) for b in layout.buckets]
    for path, (start, numel, b) in layout.members.items():
        out[b][0].append((specs[path], start - layout.buckets[b].start, numel))
    return out


def buffer_dtypes(cfg: MegatronConfig, args: dict | None) -> tuple[str, str]:
    """The default ``(param_dtype, grad_dtype)`` of a job: gradients reduced in fp32 unless the
    args say ``accumulate_allreduce_grads_in_fp32=False`` (Megatron-LM turns it on for bf16)."""
    param = f"torch.{cfg.params_dtype}"
    in_fp32 = (args or {}).get("accumulate_allreduce_grads_in_fp32")
    return param, param if in_fp32 is False and cfg.params_dtype != "bfloat16" else "torch.float32"


def dtype_key(dtypes) -> tuple[torch.dtype, torch.dtype]:
    """``("torch.bfloat16", "torch.float32")`` as torch dtypes."""
    out = tuple(TORCH_DTYPES.get(str(d).removeprefix("torch.")) for d in dtypes)
    if len(out) != 2 or not all(isinstance(d, torch.dtype) for d in out):
        raise ManifestError(f"buffer dtypes {list(dtypes)}: expected two torch dtype names")
    return out  # type: ignore[return-value]


def distrib_optim_refs(cfg: MegatronConfig, config: ParallelConfig, sharding: Sharding, t: int, p: int,
                       e: int, obj: Any, where: str, writer: Any = None
                       ) -> tuple[dict, tuple[str, str]]:
    """Each optimizer leaf's bytes in a ``distrib_optim.pt`` (loaded with refs) of rank (``t``, ``p``, ``e``).

    With experts at ep > 1 the file holds ``[dense | None, expert | None]``
    (megatron-core ``ChainedOptimizer.save_parameter_state``): the dense state
    only in ep rank 0's directories, the expert state (this ep rank's experts)
    in every one (with etp != tp: the dense state where the writer is dense dp x cp
    rank 0, the expert state at the writer's expert-tp rank; ``writer`` is its
    ``Coord``, by default that of tp rank ``t`` with etp == tp). Each state is
    ``{"buckets_coalesced": True, chunk: {(param_dtype, grad_dtype): {"param", "exp_avg",
    "exp_avg_sq": flat float32, "numel_unpadded"}}}``
    with one entry per virtual pipeline chunk.

    Returns:
        ``({(optimizer leaf path, t, p): TensorRef}, (param_dtype, grad_dtype))``.

    Raises:
        ManifestError: an unexpected structure (a missing part or chunk, several
            buffers, uncoalesced buckets), a missing state, a dtype other than
            float32, or a buffer whose size is not the layout's.
    """
    parts = [(obj, False)]
    if config.ep > 1 and cfg.num_moe_experts:
        if not isinstance(obj, list) or len(obj) != 2:
            raise ManifestError(f"{where}: expected [dense | None, expert | None] (ep={config.ep}); "
                                f"found {type(obj).__name__}")
        dense = e == 0 if writer is None else writer.dense_dp_first
        if obj[1] is None or (dense and obj[0] is None):
            raise ManifestError(f"{where}: the {'expert' if obj[1] is None else 'dense'} optimizer state "
                                "is missing")
        parts = [(obj[1], True)] + ([(obj[0], False)] if dense else [])
    out, dtypes = {}, None
    for state_obj, expert in parts:
        split = writer.etp if expert and writer is not None else t
        for v in range(config.vpp):
            found, dtypes = _chunk_refs(cfg, config, sharding, split, p, e, v, expert, state_obj, where)
            out.update(found)
    return out, dtypes  # type: ignore[return-value]


def _chunk_refs(cfg, config, sharding, t, p, e, v, expert, obj, where):
    where = f"{where} ({'expert' if expert else 'dense'} buffer, chunk {v})"
    if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
        raise ManifestError(f"{where}: expected {{'buckets_coalesced': True, 0: {{...}}}} "
                            "(megatron-core's save_parameter_state); found another structure")
    chunks = sorted((k for k in obj if k != "buckets_coalesced"), key=str)
    if chunks != list(range(config.vpp)):
        raise ManifestError(f"{where}: model chunks {chunks}; the args give vpp={config.vpp}")
    buffers = obj[v]
    if not isinstance(buffers, dict) or len(buffers) != 1:
        raise ManifestError(f"{where}: {len(buffers) if isinstance(buffers, dict) else 0} buffers; "
                            "tenplex reads one (param_dtype, grad_dtype) buffer per rank")
    (key, states), = buffers.items()
    dtypes = tuple(str(d) for d in key) if isinstance(key, tuple) else ()
    if len(dtypes) != 2 or not all(d.startswith("torch.") for d in dtypes):
        raise ManifestError(f"{where}: buffer key {key!r} is not (param_dtype, grad_dtype)")
    layout = buffer_layout(cfg, config, p, 1, chunk=v, expert=expert, ep_rank=e)
    total = sum(n for _, n, _ in layout)
    out = {}
    for state in OPTIMIZER_STATES:
        flat = states.get(state) if isinstance(states, dict) else None
        if not isinstance(flat, TensorRef) or flat.dtype != FLAT_DTYPE or len(flat.shape) != 1:
            raise ManifestError(f"{where}: buffer {key}: {state} is missing or not a flat float32 "
                                f"tensor (found {flat!r:.80})")
        if flat.numel != total:
            raise ManifestError(f"{where}: buffer {key}: {state} has {flat.numel} elements; the "
                                f"single-bucket layout of this model needs {total} (bucketed buffers "
                                "are not supported)")
        offset = 0
        for entries, unpadded, _ in layout:
            for spec, start, numel in entries:
                shape = sharding.tp_local(spec.leaf, t)[0]
                out[(optimizer_path(state, spec.path), t, p)] = flat.narrow(offset + start, numel, shape)
            offset += unpadded
    return out, dtypes


def shard_group(config: ParallelConfig, expert: bool) -> int:
    """Ranks a distributed-optimizer buffer is sharded (and padded) over: expert-dp for an expert
    buffer, dp x cp for a dense one (megatron-core ``DistributedOptimizer`` over
    ``get_data_parallel_group(with_context_parallel=True)`` or the expert-dp group)."""
    return config.edp if expert else config.dp * config.cp


def _flat_layout(cfg: MegatronConfig, config: ParallelConfig, p: int, chunk: int, expert: bool,
                 ep_rank: int) -> list:
    return buffer_layout(cfg, config, p, shard_group(config, expert), chunk=chunk, expert=expert,
                         ep_rank=ep_rank)


def flat_numel(cfg: MegatronConfig, config: ParallelConfig, p: int, chunk: int = 0,
               expert: bool = False, ep_rank: int = 0) -> int:
    """Elements of the flat tensor :func:`flat_buffers` builds per state (float32)."""
    return sum(n for _, n, _ in _flat_layout(cfg, config, p, chunk, expert, ep_rank))


def flat_buffers(cfg: MegatronConfig, config: ParallelConfig, p: int,
                 fill: Callable[[list[tuple[str, torch.Tensor]]], None], chunk: int = 0,
                 expert: bool = False, ep_rank: int = 0, states: tuple[str, ...] = OPTIMIZER_STATES
                 ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """Rank (t, ``p``)'s buffer, unpadded buckets coalesced, built from its optimizer leaves.

    Args:
        chunk, expert, ep_rank: which buffer (see :func:`buffer_layout`).
        states: the optimizer states to build (default all; a streaming writer builds one at a time).
        fill: ``fill([(optimizer leaf path, out), ...])`` copies each leaf's
            tp-local tensor (float32) into its flat view ``out`` (disjoint views,
            so they may be filled in parallel).

    Returns:
        ``({state: flat float32 tensor}, [(bucket offset, bucket numel)])``: one
        tensor per state holds every bucket, gaps zero (so a bucket is a view).
    """
    layout = _flat_layout(cfg, config, p, chunk, expert, ep_rank)
    total = sum(n for _, n, _ in layout)
    flats = {s: torch.empty(total, dtype=FLAT_DTYPE) for s in states}
    buckets, jobs, covered, offset = [], [], [], 0
    for entries, unpadded, _ in layout:
        for spec, start, numel in entries:
            at = offset + start
            covered.append((at, at + numel))
            jobs.extend((optimizer_path(state, spec.path), flat[at:at + numel]) for state, flat in flats.items())
        buckets.append((offset, unpadded))
        offset += unpadded
    position = 0
    for lo, hi in sorted(covered) + [(total, total)]:  # alignment gaps are zero, as megatron-core's
        for flat in flats.values():
            flat[position:lo].zero_()
        position = max(position, hi)
    fill(jobs)
    return flats, buckets


def distrib_optim_state(chunks: list[dict[str, torch.Tensor]], dtypes) -> dict:
    """One optimizer's ``distrib_optim.pt`` state: per model chunk, its buckets coalesced, unpadded
    (megatron-core's ``save_parameter_state`` with ``buckets_coalesced``)."""
    out: dict = {"buckets_coalesced": True}
    for v, flats in enumerate(chunks):
        total = flats[OPTIMIZER_STATES[0]].numel()
        out[v] = {dtype_key(dtypes): {**flats, "numel_unpadded": total}}
    return out
