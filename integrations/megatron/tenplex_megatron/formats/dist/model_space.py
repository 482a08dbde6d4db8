"""megatron-core's ``fully_sharded_model_space`` optimizer state in ``torch_dist`` (megatron-core <= 0.13).

Megatron-LM before core 0.14 saved the distributed optimizer's state this way by
default (``--ckpt-fully-parallel-save``; ``--dist-ckpt-save-pre-mcore-014`` still
does in 0.14 and 0.15, and RL frameworks such as slime set it):
``DistributedOptimizer.sharded_param_state_fs_model_space`` gives each rank's
shard of the fp32 main param and both Adam moments as a ``ShardedTensor``
with a ``flattened_range`` of the parameter's local (tp) shard, under
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``. The
``torch_dist`` strategy stores such a tensor reformulated
(``nd_flattened_tensor_reformulated_global_shape``): the item's shape is
the model key's leading axes (layer, expert), then the number of local
shards along each axis of the parameter, then the local shard's element
count; a chunk is ``(leading, shard index, flat start)`` with sizes
``(1, ..., 1, flat length)``. So local shard ``f`` of a parameter is row
``f`` of the item, its elements in row-major order, cut by data-parallel
rank into contiguous runs. (SwiGLU's ``linear_fc1`` is split into its gate
and up halves first, ``apply_swiglu_sharded_factory``: at tp ``T`` the gate
shard of tp rank ``t`` is shard ``t`` of ``2T`` along axis 0, its up shard
``T + t``.)

:func:`model_space_pieces` turns a rank's local tensor (the tenplex pieces of
its tp shard) into boxes of that item, so the ``torch_dist`` reader reads
it like any other DCP tensor (:class:`~tenplex_megatron.formats.dist.source.DistSource`).
Checked against megatron-core 0.13.1's own save
(``tests/formats/test_megatron_core_013.py``).
"""

from __future__ import annotations

from math import prod

import torch

from tenplex.errors import ManifestError
from tenplex.limits import short
from tenplex.ptree.region import Box, flat_start, is_contiguous
from tenplex.ptree.sharding import Piece, Sharding
from tenplex.ptree.tree import TensorLeaf

__all__ = ["MODEL_SPACE", "model_space_pieces", "model_space_shape", "check_steps"]

MODEL_SPACE = "fully_sharded_model_space"
"""The ``param_state_sharding_type`` (and ``distrib_optim_sharding_type``) of this layout."""


def _shards(global_shape: tuple[int, ...], box: Box, where: str) -> tuple[int, ...]:
    """The index of local shard ``box`` along each axis (it must tile ``global_shape`` evenly)."""
    out = []
    for g, o, s in zip(global_shape, box.offsets, box.sizes):
        if not s or g % s or o % s:
            raise ManifestError(f"{where}: local shard {box} does not tile {list(global_shape)} evenly; "
                                "fully_sharded_model_space cannot hold it")
        out.append(o // s)
    return tuple(out)


def model_space_shape(sharding: Sharding, leaf: TensorLeaf, where: str = "") -> tuple[int, ...]:
    """The reformulated shape (without leading axes) of ``leaf``'s optimizer item at ``sharding``'s tp:
    local shards per axis, then the local shard's element count.

    Raises:
        ManifestError: the local shards do not tile the parameter evenly.
    """
    shape = sharding.physical_shape(leaf)
    pieces = sharding.tp_local(leaf, 0)[1]
    sizes = {p.box.sizes for p in pieces}
    if len(sizes) != 1:
        raise ManifestError(f"{where}: local shards of {sorted(sizes)} elements; fully_sharded_model_space "
                            "stores equal ones")
    (size,) = sizes
    for p in pieces:
        _shards(shape, p.box, where)
    return tuple(g // s for g, s in zip(shape, size)) + (prod(size),)


def model_space_pieces(global_shape: tuple[int, ...], pieces: tuple[Piece, ...], where: str
                       ) -> tuple[Piece, ...]:
    """A rank's local tensor (``pieces`` of a parameter of ``global_shape``) as boxes of the
    reformulated item: each piece becomes its shard's row, ``(shard index..., 0)`` sized
    ``(1, ..., 1, numel)``, placed where the piece's elements lie in the local tensor.

    Raises:
        ManifestError: a piece that is not one contiguous run of the local tensor, or that does not
            tile the parameter evenly.
    """
    out = []
    for p in pieces:
        if not is_contiguous(p.local, p.view):
            raise ManifestError(f"{where}: a local shard that is not contiguous in the local tensor; "
                                "fully_sharded_model_space stores each shard flattened")
        index = _shards(global_shape, p.box, where)
        n = prod(p.box.sizes)
        ones = (1,) * len(index)
        out.append(Piece(Box(index + (0,), ones + (n,)), p.offset + flat_start(p.local, p.view), ones + (n,),
                         Box((0,) * (len(index) + 1), ones + (n,))))
    return tuple(out)


def check_steps(param_state, param_groups, where: str) -> None:
    """``common.pt``'s ``optimizer.param_state`` of this layout: what is left per parameter once its
    tensors went to DCP items. With torch's Adam that is each parameter's ``step``; it must be the
    step of every param group (which tenplex carries), so dropping it loses nothing. Apex's and
    TransformerEngine's fused Adam keep the step in the groups only (empty entries).

    Raises:
        ManifestError: another entry, a step that is not a number, or steps that differ.
    """
    if param_state is None:
        return
    if not isinstance(param_state, dict):
        raise ManifestError(f"{where}: optimizer.param_state is {type(param_state).__name__}; expected a dict")
    steps = set()
    for entry in param_state.values():
        if not isinstance(entry, dict) or set(entry) - {"step"}:
            raise ManifestError(f"{where}: optimizer.param_state holds {short(entry)}; expected per-parameter "
                                f"{{'step'}} entries ({MODEL_SPACE} keeps the tensors in DCP items)")
        if "step" in entry:
            steps.add(_number(entry["step"], where))
    groups = {_number(g.get("step"), where) for g in param_groups or [] if isinstance(g, dict) and "step" in g}
    if len(steps) > 1 or (steps and groups and steps != groups):
        raise ManifestError(f"{where}: optimizer steps differ: per parameter {sorted(steps)}, per param group "
                            f"{sorted(groups)}; tenplex carries one step")


def _number(value, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ManifestError(f"{where}: an optimizer step is {short(value)}; expected a number")
    return float(value)
