"""JSON forms of the small non-tensor objects a Megatron checkpoint carries.

RNG states (Python, NumPy, torch generator states), the learning-rate
scheduler's state, the optimizer's ``param_groups`` and other replicated
entries are kept as value leaves, which must be JSON. :func:`to_jsonable`
encodes tensors and NumPy arrays as base64 with their dtype and tuples as
``{"__tuple__": [...]}``; :func:`from_jsonable` restores them exactly (a
tuple comes back a tuple, a ``uint8`` tensor a ``uint8`` tensor).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.limits import Walk, short

from tenplex_megatron.torchfiles.safe_load import TORCH_DTYPES

__all__ = ["to_jsonable", "from_jsonable"]

_SCALARS = (str, int, float, bool, type(None))


def to_jsonable(obj: Any, where: str = "value", walk: Walk | None = None) -> Any:
    """The JSON-able form of ``obj``.

    At most :data:`~tenplex.limits.MAX_WALK` nodes are visited (a shared
    reference counts each time it is reached: its JSON form is written each
    time), so a pickle of shared references cannot make the form exponential.

    Raises:
        ManifestError: for an object of another type (naming ``where`` and the type), a tensor
            that is an expanded or overlapping view, or more nodes than the limit.
    """
    if walk is None:
        try:
            return to_jsonable(obj, where, Walk(where, ManifestError))
        except RecursionError:
            raise ManifestError(f"{where}: nested too deeply to keep as JSON") from None
    walk.step()
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 1 and obj.untyped_storage().nbytes() < obj.numel() * obj.element_size():
            raise ManifestError(f"{where}: a {list(obj.shape)} tensor with strides {list(obj.stride())} "
                                "views fewer bytes than it has elements (an expanded view)")
        t = obj.detach().cpu().contiguous()
        return {"__tensor__": base64.b64encode(t.numpy().tobytes()).decode(), "dtype": str(t.dtype),
                "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": base64.b64encode(obj.tobytes()).decode(), "dtype": str(obj.dtype),
                "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_jsonable(x, where, walk) for x in obj]}
    if isinstance(obj, list):
        return [to_jsonable(x, where, walk) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise ManifestError(f"{where}: a mapping with keys {short(list(obj))} cannot be kept as JSON")
        return {str(k): to_jsonable(v, f"{where}.{short(k, 60)}", walk) for k, v in obj.items()}
    if isinstance(obj, _SCALARS):
        return obj
    raise ManifestError(f"{where}: a {type(obj).__name__} cannot be kept as JSON; tenplex keeps "
                        "tensors, arrays, numbers, strings and containers of them")


def _dtype(name: str) -> torch.dtype:
    dtype = TORCH_DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ManifestError(f"unknown torch dtype {short(name)} in a stored value")
    return dtype


def from_jsonable(obj: Any) -> Any:
    """Inverse of :func:`to_jsonable`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            data = bytearray(base64.b64decode(obj["__tensor__"]))
            t = torch.frombuffer(data, dtype=_dtype(obj["dtype"])) if data else \
                torch.empty(0, dtype=_dtype(obj["dtype"]))
            return t.reshape(obj.get("shape", [-1])).clone()
        if "__ndarray__" in obj:
            arr = np.frombuffer(base64.b64decode(obj["__ndarray__"]), dtype=obj["dtype"])
            return arr.reshape(obj.get("shape", [-1])).copy()
        if "__dtype__" in obj:
            return _dtype(obj["__dtype__"])
        if "__tuple__" in obj:
            return tuple(from_jsonable(x) for x in obj["__tuple__"])
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(x) for x in obj]
    return obj
