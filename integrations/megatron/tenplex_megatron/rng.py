"""Megatron RNG state as JSON, and the rule for coordinates that are new.

Megatron keeps RNG state per (tp, pp) rank: Python's, NumPy's, torch's CPU
and CUDA generators, and the tensor-parallel tracker's named CUDA states.
tenplex keeps it **by coordinate**: a target rank whose (tp, pp) coordinate
existed in the source gets that coordinate's state; a rank at a new
coordinate gets a state **re-derived from the seed** the way Megatron seeds a
fresh run (``megatron/training/initialize.py::_set_random_seed``: seed
``args.seed + 100 * pp_rank``; the tracker's model-parallel stream
``seed + 2718 + tp_rank``). One rank's state is never copied to others.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = ["encode", "decode", "derive"]


def _tensor(t: torch.Tensor) -> dict:
    return {"__tensor__": base64.b64encode(t.numpy().tobytes()).decode(), "dtype": str(t.dtype)}


def encode(obj: Any) -> Any:
    """JSON-able form of an RNG state structure (tensors and arrays as base64)."""
    if isinstance(obj, torch.Tensor):
        return _tensor(obj.detach().cpu().contiguous())
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": base64.b64encode(obj.tobytes()).decode(), "dtype": str(obj.dtype)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(x) for x in obj]}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    return obj


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            data = bytearray(base64.b64decode(obj["__tensor__"]))
            return torch.frombuffer(data, dtype=getattr(torch, obj["dtype"].removeprefix("torch."))).clone()
        if "__ndarray__" in obj:
            return np.frombuffer(base64.b64decode(obj["__ndarray__"]), dtype=obj["dtype"]).copy()
        if "__tuple__" in obj:
            return tuple(decode(x) for x in obj["__tuple__"])
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    return obj


def derive(seed: int, tp_rank: int, pp_rank: int) -> list[dict]:
    """Megatron's ``rng_state`` list for a fresh start at (tp_rank, pp_rank)."""
    base = seed + 100 * pp_rank
    py = random.Random(base).getstate()
    np_state = np.random.RandomState(base).get_state()
    cpu = torch.Generator().manual_seed(base).get_state()
    tracker = torch.Generator().manual_seed(base + 2718 + tp_rank).get_state()
    return [{"random_rng_state": py, "np_rng_state": np_state, "torch_rng_state": cpu,
             "cuda_rng_state": cpu, "rng_tracker_states": {"model-parallel-rng": tracker}}]
