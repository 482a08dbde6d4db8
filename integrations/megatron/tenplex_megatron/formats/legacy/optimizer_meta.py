"""What a legacy ``model_optim_rng.pt``'s optimizer entry holds besides per-parameter tensors:
its sub-optimizers, param groups, Adam steps and fp16 grad scaler.

Megatron's optimizers save ``{"state", "param_groups"}`` (``FP32Optimizer``),
``{"optimizer", "fp32_from_fp16_params", "grad_scaler"}`` (``Float16OptimizerWithFloat16Params``)
or ``{"optimizer", "grad_scaler"}`` (``DistributedOptimizer``); at ep > 1 a list
``[dense, expert]`` of them (``ChainedOptimizer``). The grad scaler is None
under bf16 and megatron-core's ``DynamicGradScaler.state_dict()`` under fp16:
``{"scale": <1-element fp32 tensor>, "growth_tracker": int, "hysteresis_tracker": int}``.
"""

from __future__ import annotations

from typing import Any, Callable

from tenplex.errors import ManifestError

from tenplex_megatron.torchfiles.jsonable import to_jsonable
from tenplex_megatron.torchfiles.ptfile import TensorRef

__all__ = ["optimizer_subs", "adam_steps", "optimizer_meta", "SCALER_NUMEL"]

_OPTIMIZER_KEYS = {"state", "param_groups", "optimizer", "fp32_from_fp16_params", "grad_scaler"}

SCALER_NUMEL = 16
"""The most elements a tensor of the grad scaler may have (megatron-core's is one ``scale``)."""


def optimizer_subs(optim: Any, where: str) -> list[dict]:
    """The sub-optimizers' state dicts: one, or ``[dense, expert]`` (``ChainedOptimizer.state_dict``
    at ep > 1).

    Raises:
        ManifestError: anything else.
    """
    subs = optim if isinstance(optim, list) else [optim]
    if not 1 <= len(subs) <= 2 or not all(isinstance(o, dict) for o in subs):
        raise ManifestError(f"{where}: the optimizer entry is a {type(optim).__name__}; expected a dict "
                            "or [dense, expert] dicts")
    return subs


def adam_steps(optim) -> list[Any]:
    """The ``step`` entries (tensors as refs) of non-distributed Adam state dicts."""
    out = []
    for sub in optimizer_subs(optim, "optimizer"):
        inner = sub if "state" in sub else sub["optimizer"]
        out += [st["step"] for st in (inner.get("state") or {}).values() if "step" in st]
    return out


def optimizer_meta(optim, where: str, count: Callable[[int], None]) -> dict:
    """The optimizer's param groups (without ``params``), as JSON, and its grad scaler, read; ``step``
    later. The expert sub-optimizer's groups (ep > 1) are kept as ``expert_param_groups``.

    Args:
        optim: the file's ``optimizer`` entry, tensors as :class:`TensorRef` s.
        where: the file, for errors.
        count: called with the bytes read (the grad scaler's tensors).

    Raises:
        ManifestError: for an entry tenplex would not carry, or a grad scaler tensor of more than
            :data:`SCALER_NUMEL` elements.
    """
    subs = optimizer_subs(optim, where)
    groups = []
    for sub in subs:
        unknown = sorted(set(sub) - _OPTIMIZER_KEYS)
        if unknown:
            raise ManifestError(f"{where}: optimizer entries {unknown} are not supported")
        inner = sub["optimizer"] if isinstance(sub.get("optimizer"), dict) else sub
        groups.append([{k: v for k, v in g.items() if k != "params"} for g in inner.get("param_groups", [])])
    scaler = _read_small(subs[0].get("grad_scaler"), f"{where}: grad_scaler", count)
    out = {"param_groups": to_jsonable(groups[0], f"{where}: optimizer param_groups"), "step": None,
           "grad_scaler": to_jsonable(scaler, f"{where}: grad_scaler")}
    if len(groups) == 2:
        out["expert_param_groups"] = to_jsonable(groups[1], f"{where}: expert param_groups")
    return out


def _read_small(obj: Any, where: str, count: Callable[[int], None]) -> Any:
    """``obj`` with each :class:`TensorRef` read (at most :data:`SCALER_NUMEL` elements each)."""
    if isinstance(obj, TensorRef):
        if obj.numel > SCALER_NUMEL:
            raise ManifestError(f"{where}: a {list(obj.shape)} tensor; a grad scaler holds tensors of at most "
                                f"{SCALER_NUMEL} elements (megatron-core's scale is one)")
        tensor, n = obj.read()
        count(n)
        return tensor
    if isinstance(obj, dict):
        return {k: _read_small(v, f"{where}.{k}", count) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_read_small(v, where, count) for v in obj)
    return obj
