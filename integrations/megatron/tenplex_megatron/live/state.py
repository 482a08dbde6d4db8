"""Export a running megatron-core job's local state into its tree, and import it back.

:func:`export_state` reads this rank's parameters, the optimizer's main
params and Adam moments (dp-sharded exactly as a ``DistributedOptimizer``
holds them, never gathered), the LR scheduler, the data position and the
RNG states. :func:`import_state` fills freshly built model chunks, optimizer
and scheduler from such a state, at any config. Both run between training
steps (after ``optimizer.step()``), on every rank, without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tenplex.errors import ConfigError, ShardError
from tenplex.ptree.config import Coord, ParallelConfig
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.torchfiles.jsonable import from_jsonable, to_jsonable
from tenplex_megatron.model.layouts import optimizer_path
from tenplex_megatron.live.optim import slots
from tenplex_megatron.live.params import named_params
from tenplex_megatron.live.spec import MOMENTS, LiveSpec

__all__ = ["export_state", "import_state", "current_config", "Imported"]


def current_config() -> tuple[ParallelConfig, Coord]:
    """The (dp, tp, pp) config of megatron-core's ``parallel_state`` and this rank's coordinate.

    Raises:
        ConfigError: context or expert parallelism is on, or megatron-core's
            rank order differs from the config's (tp fastest, then dp, then pp).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() != 1 or ps.get_expert_model_parallel_world_size() != 1:
        raise ConfigError("the live API supports dp, tp and pp; context and expert parallelism are not yet")
    config = ParallelConfig(dp=ps.get_data_parallel_world_size(), tp=ps.get_tensor_model_parallel_world_size(),
                            pp=ps.get_pipeline_model_parallel_world_size())
    coord = Coord(ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                  ps.get_pipeline_model_parallel_rank())
    if config.rank(coord) != dist.get_rank():
        raise ConfigError(f"rank {dist.get_rank()} is {coord} in megatron-core's parallel_state, but rank "
                          f"{config.rank(coord)} of {config} (order tp, dp, pp)")
    return config, coord


@dataclass(frozen=True)
class Imported:
    """What :func:`import_state` hands back to the training loop.

    Attributes:
        consumed_samples: the data position (samples of the global order already used).
        step: Adam's step count.
        rng_restored: the RNG states came from the state (``False``: a new
            (tp, pp) coordinate; megatron-core's seeding stands).
    """

    consumed_samples: int
    step: int
    rng_restored: bool


def export_state(model_chunks, optimizer, scheduler, *, spec: LiveSpec, consumed_samples: int,
                 tree=None) -> dict[str, Any]:
    """This rank's state: ``{tree path: local tensor or JSON value}``.

    Args:
        model_chunks: the model chunks (megatron-core DDP-wrapped; one chunk).
        optimizer: the megatron-core optimizer built over them.
        scheduler: the ``OptimizerParamScheduler``, or ``None``.
        spec: the job's :class:`LiveSpec`.
        consumed_samples: the data position.
        tree: the tree (default ``spec.tree(config)``); its holdings are checked.

    Returns:
        Model tensors (``params_dtype``, tp-local shapes), optimizer tensors
        (fp32; 1-D dp-shard ranges with the distributed optimizer) and the
        value leaves of :data:`~tenplex_megatron.live.spec.LIVE_VALUES`; clones,
        safe to keep while the model trains on.

    Raises:
        ConfigError: see :func:`current_config`; or the optimizer holds another
            range than the tree says (megatron-core's layout changed).
        ShardError: parameters or optimizer state that do not match the model config.
    """
    config, coord = current_config()
    tree = tree or spec.tree(config)
    sharding = Sharding(tree, config)
    params = named_params(model_chunks, spec.model, config, coord.pp)
    path_of = {id(p): path for path, p in params.items()}
    out: dict[str, Any] = {}
    for path, p in params.items():
        _check_dtype(path, p, spec.model.params_dtype)
        out[path] = p.detach().clone()
    steps = set()
    for slot in slots(optimizer):
        path = path_of.get(id(slot.param))
        if path is None:
            raise ShardError("the optimizer holds a parameter that is not in the model chunks")
        _check_holding(sharding, tree, path, coord, slot, spec)
        state = slot.inner.state.get(slot.main, {})
        unknown = set(state) - {"step", *MOMENTS}
        if unknown:
            raise ShardError(f"{path}: optimizer state {sorted(unknown)} is not Adam's "
                             "(step, exp_avg, exp_avg_sq)")
        steps.add(int(state["step"]) if "step" in state else 0)
        shape = (-1,) if slot.flat else slot.param.shape
        if spec.main_params:
            out[optimizer_path("param", path)] = slot.main.detach().float().clone().reshape(shape)
        for name in MOMENTS:
            held = state.get(name)
            value = held.detach().clone() if held is not None else torch.zeros(slot.main.shape)
            out[optimizer_path(name, path)] = value.reshape(shape)
    if len(steps) > 1:
        raise ShardError(f"optimizer: parameters are at different Adam steps {sorted(steps)}")
    out["optimizer/step"] = steps.pop() if steps else 0
    out["optimizer/scheduler"] = dict(scheduler.state_dict()) if scheduler is not None else None
    out["data/consumed_samples"] = int(consumed_samples)
    out["rng/states"] = to_jsonable(_rng_states(), "rng/states")
    _check_against_tree(out, tree, sharding, coord)
    return {p: out[p] for p in tree.leaves if p in out}


def import_state(state: dict[str, Any], model_chunks, optimizer, scheduler, *, spec: LiveSpec,
                 tree=None) -> Imported:
    """Fill freshly built model chunks, optimizer and scheduler from ``state`` (this rank's, this config).

    Args:
        state: this rank's state under the current config (from
            :func:`export_state` or ``tenplex.reconfigure``).
        model_chunks, optimizer, scheduler, spec, tree: as :func:`export_state`;
            the scheduler must be fresh (no steps taken).

    Returns:
        :class:`Imported`: the data position, the step, and whether the RNG
        states were restored.

    Raises:
        ShardError: ``state`` lacks a leaf this rank holds or has a wrong shape or dtype.
        ConfigError: as :func:`export_state`.
    """
    config, coord = current_config()
    tree = tree or spec.tree(config)
    sharding = Sharding(tree, config)
    params = named_params(model_chunks, spec.model, config, coord.pp)
    path_of = {id(p): path for path, p in params.items()}
    step = int(_get(state, "optimizer/step"))
    consumed = int(_get(state, "data/consumed_samples"))
    # every tensor is checked before anything is written: a bad state leaves the model untouched
    copies = [(p.data, _tensor(state, path, p.shape, p.dtype)) for path, p in params.items()]
    moments = []
    for slot in slots(optimizer):
        path = path_of[id(slot.param)]
        _check_holding(sharding, tree, path, coord, slot, spec)
        shape = slot.main.shape
        if slot.copy:
            copies.append((slot.main, _tensor(state, optimizer_path("param", path), shape, torch.float32)))
        moments.append((slot, {name: _tensor(state, optimizer_path(name, path), shape, torch.float32)
                               for name in MOMENTS}))
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
        for slot, values in moments:
            slot.inner.state[slot.main] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                           **{name: v.clone() for name, v in values.items()}}
    if scheduler is not None and state.get("optimizer/scheduler") is not None:
        scheduler.num_steps = 0
        scheduler.load_state_dict(state["optimizer/scheduler"])
    saved = state.get("rng/states")
    if saved is not None:
        _set_rng_states(from_jsonable(saved))
    return Imported(consumed, step, saved is not None)


def _check_against_tree(out: dict, tree, sharding, coord) -> None:
    """Every tensor the tree says this rank holds is exported, with the tree's local shape, and no other."""
    for path, leaf in tree.tensors():
        holding = sharding.holding(path, coord)
        found = tuple(out[path].shape) if path in out else None
        if (holding.shape if holding is not None else None) != found:
            raise ShardError(f"{path}: the tree says rank {coord} holds "
                             f"{holding.shape if holding is not None else 'nothing'}; the job has "
                             f"{found if found is not None else 'nothing'}")


def _check_dtype(path: str, p, dtype: str) -> None:
    if str(p.dtype).removeprefix("torch.") != dtype:
        raise ShardError(f"{path}: parameter dtype {p.dtype}, expected {dtype} (LiveSpec.model.params_dtype)")


def _check_holding(sharding, tree, path, coord, slot, spec) -> None:
    """The optimizer's range of ``path`` on this rank must be the tree's."""
    if slot.copy != spec.main_params:
        raise ShardError(f"{path}: the optimizer {'keeps' if slot.copy else 'has no'} fp32 main param copy; "
                         f"the spec says params_dtype={spec.model.params_dtype}")
    leaf = tree[optimizer_path(MOMENTS[0], path)]
    if leaf.layout.dp_shard is None:
        if slot.flat is not None:
            raise ConfigError(f"{path}: the optimizer is distributed; LiveSpec.distributed_optimizer is False")
        return
    if slot.flat is None:
        raise ConfigError(f"{path}: the optimizer is not distributed; LiveSpec.distributed_optimizer is True")
    expected = sharding.dp_range(leaf, coord.dp, coord.pp)
    if expected != slot.flat:
        raise ConfigError(f"{path}: the distributed optimizer holds elements {slot.flat} on dp rank {coord.dp}, "
                          f"the tree says {expected} (megatron-core's buffer layout differs from LiveSpec)")


def _get(state: dict, path: str):
    if path not in state:
        raise ShardError(f"state lacks {path!r}")
    return state[path]


def _tensor(state: dict, path: str, shape, dtype) -> torch.Tensor:
    value = _get(state, path)
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or (shape is not None and value.shape != shape):
        found = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ShardError(f"{path}: expected a {dtype} tensor{'' if shape is None else f' of shape {tuple(shape)}'}, "
                         f"found {found}")
    return value


def _rng_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = {"tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(dict(states["tracker"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
