"""Megatron RNG state: kept by coordinate, re-derived from the seed where a coordinate is new.

Megatron keeps RNG state per (tp, pp) rank, as a list over dp ranks (one
entry unless ``data_parallel_random_init``; one per dp-cp rank where megatron-core
0.16's Megatron-LM keeps each rank's apart at ep > 1,
:func:`tenplex_megatron.formats.dist.keys.rng_objects`): Python's, NumPy's and torch's
CPU generator states, the device generator's (``cuda_rng_state``) and the
tensor-parallel tracker's named device states (``rng_tracker_states``).
tenplex keeps it **by coordinate**: a target rank whose (tp, pp) coordinate
existed in the source gets that coordinate's state; a rank at a new
coordinate gets a state **re-derived from the seed** as Megatron seeds a
fresh run. One rank's state is never copied to another.

Seeding rules (Megatron-LM ``megatron/training/initialize.py::_set_random_seed``
and megatron-core 0.16 ``tensor_parallel/random.py::model_parallel_cuda_manual_seed``):
``seed = args.seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
``data_parallel_random_init``) seeds Python, NumPy, torch and the device
generator; the tracker holds ``data-parallel-rng`` (``seed``),
``model-parallel-rng`` (``seed + 2718 + tp_rank``) and
``expert-parallel-rng`` (``seed + 1024 + 100 * ep_rank + etp_rank``; ep = etp = 0
for dense models).

A derived device state must fit the generator that restores it: a CUDA
generator's state is 16 bytes (Philox seed and offset, little-endian
``uint64`` and ``int64``; ``CUDAGeneratorImpl::get_state``), a CPU
generator's is the Mersenne-Twister state (5056 bytes). The kind is taken
from the source's own states; without any, it is CUDA.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import torch

__all__ = ["TRACKER_NAMES", "derive", "device_kind", "fill_states"]

TRACKER_NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")
"""The tracker's stream names in megatron-core 0.16 (``tensor_parallel/random.py``)."""

_CPU_STATE_BYTES = torch.Generator().get_state().numel()


def _device_state(seed: int, kind: str) -> torch.Tensor:
    if kind == "cuda":
        return torch.frombuffer(bytearray(struct.pack("<Qq", seed, 0)), dtype=torch.uint8).clone()
    return torch.Generator().manual_seed(seed).get_state()


def device_kind(states: Any) -> str:
    """``"cuda"`` or ``"cpu"``: the kind of device generator state in ``states``.

    ``states`` is any structure of rank RNG states (lists, dicts); the size of
    the first ``cuda_rng_state`` (or tracker state) found decides. Without
    any, ``"cuda"`` (a GPU job). Anything but a CPU generator's state size
    (5056 bytes) counts as CUDA (16 bytes today, 816 before torch 2.1).
    """
    found = _first_device_state(states)
    if found is None:
        return "cuda"
    return "cpu" if found.numel() == _CPU_STATE_BYTES else "cuda"


def _first_device_state(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, dict):
        for key in ("cuda_rng_state", "rng_tracker_states"):
            value = obj.get(key)
            if isinstance(value, torch.Tensor):
                return value
            if isinstance(value, dict):
                for v in value.values():
                    if isinstance(v, torch.Tensor):
                        return v
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_device_state(item) if isinstance(item, (dict, list, tuple)) else None
            if found is not None:
                return found
    return None


def derive(seed: int, tp_rank: int, pp_rank: int, *, dp_rank: int = 0,
           dp_random_init: bool = False, kind: str = "cuda", ep_rank: int = 0, etp_rank: int = 0) -> dict:
    """One rank's RNG state for a fresh start at (``tp_rank``, ``pp_rank``, ``dp_rank``), whose
    expert-grid coordinates are ``ep_rank`` and ``etp_rank``.

    Returns:
        ``{"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
        "rng_tracker_states"}`` as Megatron-LM's ``get_rng_state`` builds it;
        device states are of ``kind`` (``"cuda"`` or ``"cpu"``).
    """
    base = seed + 100 * pp_rank + (10 * dp_rank if dp_random_init else 0)
    tracker = {"data-parallel-rng": _device_state(base, kind),
               "model-parallel-rng": _device_state(base + 2718 + tp_rank, kind),
               "expert-parallel-rng": _device_state(base + 1024 + 100 * ep_rank + etp_rank, kind)}
    return {"random_rng_state": random.Random(base).getstate(),
            "np_rng_state": np.random.RandomState(base).get_state(),
            "torch_rng_state": torch.Generator().manual_seed(base).get_state(),
            "cuda_rng_state": _device_state(base, kind),
            "rng_tracker_states": tracker}


def fill_states(states: dict[str, Any], coords, dp: int, *, seed: int, dp_random_init: bool,
                kind: str, per_rank: int = 1, expert_rank=None) -> tuple[dict[str, list], list[str]]:
    """RNG state lists for every target coordinate, and notes on what was derived.

    Args:
        states: ``{"tp=T,pp=P": list of states by dp(-cp) rank, or None}`` for the target's
            coordinates (None where the coordinate is new; a None entry: a rank no file held).
        coords: the target's ``(tp_rank, pp_rank)`` coordinates.
        dp: the target's dp (the list length with ``dp_random_init``).
        seed: ``args.seed``.
        dp_random_init: Megatron-LM's ``data_parallel_random_init``.
        kind: the device generator kind (:func:`device_kind`).
        per_rank: the list length without ``dp_random_init``: 1 (every dp rank restores one
            state), or the dp-cp size where each rank keeps its own (megatron-core 0.16's
            Megatron-LM at ep > 1: :func:`tenplex_megatron.formats.dist.keys.rng_objects`).
        expert_rank: ``expert_rank(tp_rank, pp_rank, dp-cp rank) -> (ep_rank, etp_rank)`` on the
            target's expert grid (the expert stream of a derived state); default (0, 0).

    Returns:
        ``({"tp=T,pp=P": [state, ...]}, notes)``.
    """
    out, notes = {}, []
    length = dp if dp_random_init else per_rank
    if not any(states.values()):
        notes.append(f"rng: the source stores no RNG state; every rank's state is derived from seed {seed}")
    for t, p in coords:
        key = f"tp={t},pp={p}"
        kept = list(states.get(key) or [])
        if not any(s is not None for s in kept) and any(states.values()):
            notes.append(f"rng: {key} is a new coordinate; its state is derived from seed {seed}")
        elif kept and len(kept) != length:
            notes.append(f"rng: {key} held {len(kept)} dp states, the target needs {length}; "
                         f"{'missing ones derived' if len(kept) < length else 'extra ones dropped'}")
        elif None in kept:
            notes.append(f"rng: {key} held {length - kept.count(None)} of {length} dp states; the missing "
                         "ones are derived")
        full = kept[:length] + [None] * (length - len(kept))
        for d, state in enumerate(full):
            if state is None:  # a new rank: seeded as megatron-core seeds it
                ep_rank, etp_rank = expert_rank(t, p, d) if expert_rank else (0, 0)
                full[d] = derive(seed, t, p, dp_rank=d, dp_random_init=dp_random_init, kind=kind,
                                 ep_rank=ep_rank, etp_rank=etp_rank)
        out[key] = full
    return out, notes
