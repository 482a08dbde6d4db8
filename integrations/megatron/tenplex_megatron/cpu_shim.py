"""Make megatron-core 0.16.1 run on a CPU-only PyTorch build.

megatron-core assumes CUDA in a handful of places that matter even when every
tensor lives on the CPU. This module patches exactly those places, so that a
real ``GPTModel`` can be built, run, saved and loaded on CPU with the ``gloo``
backend. It exists for tests and demos that must produce *real* Megatron
checkpoints on machines without a GPU; it is not part of tenplex's runtime.

Two entry points, both idempotent (calling them twice is a no-op):

``apply()``
    The model path: building ``GPTModel`` with ``use_cpu_initialization=True``,
    forward passes, ``state_dict``/``sharded_state_dict`` and
    ``dist_checkpointing.save``/``load``.

    * ``torch.compile`` returns what it is given: megatron-core decorates its
      fused kernels with it at import (``megatron/core/jit.py``: ``jit_fuser
      = torch.compile`` on torch >= 2.2). CPU runs turn those fusions off, so
      the kernels never run, yet the decorators alone import ``torch._dynamo``
      and ``torch._inductor``: 2.6 of the 4.6 s that importing
      ``megatron.core.models.gpt`` took in each process here. This counts
      only when ``apply()`` runs before megatron-core is imported.
    * ``torch.cuda.current_device()`` returns ``"cpu"``: many allocations are
      written as ``torch.empty(..., device=torch.cuda.current_device())``.
    * ``torch.cuda.synchronize()`` is a no-op: the DCP writer calls it.
    * ``torch.Tensor.cuda()`` is the identity: with pp > 1 and tied
      embeddings Megatron calls ``weight.data.cuda()`` before the all-reduce
      that syncs the two copies.
    * The tensor-parallel RNG tracker (``megatron.core.tensor_parallel.random``)
      keeps CPU generator states instead of CUDA ones:
      ``_get_cuda_rng_state``/``_set_cuda_rng_state`` map to
      ``torch.get_rng_state``/``torch.set_rng_state``,
      ``torch.cuda.manual_seed`` becomes a no-op, and
      ``CudaRNGStatesTracker.add`` stores the state of a fresh CPU
      ``torch.Generator`` seeded with the given seed.

``apply_optimizer_patches()``
    The distributed-optimizer path (Megatron ``DistributedDataParallel`` with
    ``use_distributed_optimizer=True`` and ``get_megatron_optimizer``). Calls
    ``apply()`` first, then:

    * installs a process-wide ``torch.overrides.TorchFunctionMode`` that
      rewrites ``device='cuda'`` / ``device='cuda:N'`` / ``torch.device('cuda')``
      keyword arguments to ``'cpu'`` (the grad buffers and optimizer helpers
      allocate with ``device='cuda'`` literally);
    * makes ``Tensor.type()`` (no arguments) report ``torch.cuda.*`` names,
      because the optimizer compares ``param.type()`` with
      ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.HalfTensor'`` /
      ``'torch.cuda.BFloat16Tensor'`` and raises ``TypeError`` otherwise;
    * wraps ``DistributedOptimizer._set_main_param_and_optimizer_states`` so a
      ``fully_reshardable`` load with torch Adam does not fail with
      ``KeyError: 'step'`` (see ``_patch_distrib_optimizer_step``);
    * makes ``torch.cuda.is_current_stream_capturing`` return ``False`` and
      ``torch.cuda.current_stream``/``Stream``/``Event``/``stream`` into
      harmless stand-ins where the buffers touch them.

Call these before importing model code that captures the patched functions at
import time, and before building models or seeding RNGs.

Example:
    >>> from tenplex_megatron import cpu_shim
    >>> cpu_shim.apply()
    >>> from megatron.core import parallel_state
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["apply", "apply_optimizer_patches", "is_applied"]

_APPLIED = {"model": False, "optimizer": False}
_DEVICE_MODE: "torch.overrides.TorchFunctionMode | None" = None


def is_applied() -> bool:
    """Return True once ``apply()`` has run in this process."""
    return _APPLIED["model"]


def _cpu_current_device() -> str:
    return "cpu"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _make_noop(name: str):
    """A fresh no-op function per patched attribute.

    torch._dynamo builds a map keyed by the identity of torch.* callables
    (``trace_rules.get_torch_obj_rule_map``). Installing the *same* function
    object as both ``torch.cuda.synchronize`` and ``torch.cuda.manual_seed``
    makes the first ``torch.compile`` (megatron imports call it) fail with
    ``AssertionError: Duplicate torch object <function _noop ...> with
    different rules``. One distinct function per attribute avoids that.
    """

    def noop(*_args: Any, **_kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_shim_{name}"
    return noop


def _eager_compile(model: Any = None, **_options: Any) -> Any:
    """``torch.compile`` for CPU runs: ``model`` as it is (or, as a decorator, the identity)."""
    return (lambda fn: fn) if model is None else model


def _tensor_cuda_identity(self: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    return self


def apply() -> None:
    """Patch torch.cuda and megatron's RNG tracker for CPU-only runs.

    Idempotent. Safe to call before or after ``import megatron.core``, but it
    must run before ``model_parallel_cuda_manual_seed`` and model building.
    """
    if _APPLIED["model"]:
        return

    torch.compile = _eager_compile  # before megatron-core's first import (below): see the module docstring
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _make_noop("synchronize")
    torch.cuda.manual_seed = _make_noop("manual_seed")
    torch.cuda.manual_seed_all = _make_noop("manual_seed_all")
    torch.Tensor.cuda = _tensor_cuda_identity

    from megatron.core.tensor_parallel import random as mrandom

    def _get_rng_state(*_args: Any, clone: bool = False, **_kwargs: Any) -> torch.Tensor:
        # CPU generator state is a ByteTensor copy already; ``clone`` is moot.
        return torch.get_rng_state()

    def _set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    def _tracker_add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state
    mrandom.CudaRNGStatesTracker.add = _tracker_add
    _APPLIED["model"] = True


def _to_cpu_device(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, int) and not isinstance(value, bool):
        # device=torch.cuda.current_device() on real CUDA is an int index.
        return "cpu"
    return value


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrite ``device=`` keyword arguments that name CUDA to ``'cpu'``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs)
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return func(*args, **kwargs)


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


class _FakeStream:
    """Stand-in for ``torch.cuda.Stream``/``Event`` on CPU: every call is a no-op."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __getattr__(self, _name: str) -> Any:
        return _noop

    def __enter__(self) -> "_FakeStream":
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


def _patch_distrib_optimizer_step() -> None:
    """Let ``fully_reshardable`` loads work with torch Adam (no Apex/TE).

    Without Apex/TE, ``DistributedOptimizer.load_state_dict`` puts a ``step``
    tensor into every param's torch-Adam state, then
    ``load_parameter_state_from_fully_reshardable`` drops ``step`` from the
    loaded tensors and ``_set_main_param_and_optimizer_states`` copies every
    *destination* key, so it fails with ``KeyError: 'step'``. This wrapper
    supplies the destination's own ``step`` for any missing key, making that
    copy a no-op; the step value itself comes from the checkpoint's
    ``param_groups[i]['step']``. A ``step`` among the *loaded* tensors is
    dropped: with ``dp_reshardable`` the per-param dicts of the is_loading
    template carry the fresh optimizer's ``step`` (not stored in the
    checkpoint), and copying it would silently reset Adam's step to 0.

    It also runs the copy under ``torch.no_grad()``:
    ``load_parameter_state_from_dp_reshardable`` lacks the decorator that the
    fully_reshardable loader has, and with fp32 params (main param = a view of
    the model param, which requires grad) it fails with ``RuntimeError: a view
    of a leaf Variable that requires grad is being used in an in-place
    operation.``
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, "_tenplex_cpu_shim", False):
        return

    def _set_states(self: Any, model_param: Any, tensors: dict) -> None:
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            # "step" always comes from param_groups[i]["step"] (already applied by
            # load_state_dict); a "step" among the loaded tensors is only the
            # placeholder of the is_loading template, so never copy it.
            tensors = {k: v for k, v in tensors.items() if k != "step"}
            missing = {k: v for k, v in state.items() if k not in tensors}
            tensors = {**tensors, **missing}
        with torch.no_grad():
            orig(self, model_param, tensors)

    _set_states._tenplex_cpu_shim = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states


def apply_optimizer_patches() -> None:
    """Patches for Megatron DDP + distributed optimizer on CPU.

    Calls ``apply()`` first. Idempotent. Installs a TorchFunctionMode for the
    rest of the process (it is entered and never exited), so call this only in
    worker processes that need the optimizer path.
    """
    global _DEVICE_MODE
    apply()
    if _APPLIED["optimizer"]:
        return

    orig_type = torch.Tensor.type

    def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
        if dtype is None and not kwargs:
            name = orig_type(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_stream = lambda *a, **k: _FakeStream()
    torch.cuda.default_stream = lambda *a, **k: _FakeStream()
    torch.cuda.Stream = _FakeStream
    torch.cuda.Event = _FakeStream
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()

    _patch_distrib_optimizer_step()

    _DEVICE_MODE = _CudaToCpuMode()
    _DEVICE_MODE.__enter__()
    _APPLIED["optimizer"] = True
