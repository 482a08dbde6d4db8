"""Where a megatron-core optimizer keeps each parameter's main param and Adam state.

megatron-core 0.16 (``optimizer/optimizer.py``, ``optimizer/distrib_optimizer.py``):

- ``DistributedOptimizer``: for each model parameter with a range on this dp
  rank, ``optimizer.param_groups[g]["params"][o]`` (``model_param_group_index_map``)
  is its main param, a flat shard: an fp32 copy of the range for 16-bit
  params, a view of the model parameter for fp32 ones. The range within the
  parameter is ``_get_model_param_range_map(param)["param"]``.
- ``Float16OptimizerWithFloat16Params``: ``fp32_from_float16_groups`` holds an
  fp32 copy of each 16-bit parameter (``float16_groups``), whole;
  ``fp32_from_fp32_groups`` holds fp32 parameters themselves.
- ``FP32Optimizer``: the parameters themselves.
- ``ChainedOptimizer``: each of ``chained_optimizers``.

Adam's state (torch's ``Adam``: ``step``, ``exp_avg``, ``exp_avg_sq``) is
keyed by the main param in the inner torch optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tenplex.errors import ShardError

__all__ = ["Slot", "slots"]


@dataclass(frozen=True, eq=False)
class Slot:
    """One parameter's optimizer state.

    Attributes:
        param: the model parameter.
        main: the tensor the inner optimizer updates (key of its state).
        copy: ``main`` is a separate fp32 copy (16-bit params), not the parameter
            or a view of it.
        inner: the torch optimizer holding the state.
        flat: ``(lo, hi)``, the range of the flattened parameter that ``main``
            covers (distributed optimizer), or ``None`` for the whole parameter.
    """

    param: Any
    main: Any
    copy: bool
    inner: Any
    flat: tuple[int, int] | None


def slots(optimizer) -> list[Slot]:
    """Every parameter's :class:`Slot` in ``optimizer``, a megatron-core optimizer.

    Raises:
        ShardError: an optimizer class this module does not know.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (ChainedOptimizer, FP32Optimizer,
                                                   Float16OptimizerWithFloat16Params)

    if isinstance(optimizer, ChainedOptimizer):
        return [s for inner in optimizer.chained_optimizers for s in slots(inner)]
    if isinstance(optimizer, DistributedOptimizer):
        out = []
        for param, (g, o) in optimizer.model_param_group_index_map.items():
            main = optimizer.optimizer.param_groups[g]["params"][o]
            rng = optimizer._get_model_param_range_map(param)["param"]
            # 16-bit params get an fp32 copy of their range; fp32 params a view of it
            out.append(Slot(param, main, main.dtype != param.dtype, optimizer.optimizer, (rng.start, rng.end)))
        return out
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        out = []
        for low, mains, fp32 in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups,
                                    optimizer.fp32_from_fp32_groups):
            out += [Slot(p, m, True, optimizer.optimizer, None) for p, m in zip(low, mains)]
            out += [Slot(p, p, False, optimizer.optimizer, None) for p in fp32]
        return out
    if isinstance(optimizer, FP32Optimizer):
        return [Slot(p, p, False, optimizer.optimizer, None)
                for group in optimizer.optimizer.param_groups for p in group["params"]]
    raise ShardError(f"optimizer {type(optimizer).__name__}: expected a megatron-core DistributedOptimizer, "
                     "Float16OptimizerWithFloat16Params, FP32Optimizer or ChainedOptimizer")
