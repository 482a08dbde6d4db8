"""Load Megatron ``.pt`` files without running code from them.

``torch.load(weights_only=True)`` refuses every global except tensors and
plain containers. Megatron checkpoints also hold ``argparse.Namespace``
(args) and NumPy's RNG state, so exactly those globals are allow-listed; a
file that needs anything else is refused.
"""

from __future__ import annotations

import argparse
import pickle

import numpy as np
import torch

from tenplex.errors import ManifestError

__all__ = ["safe_load"]


def _numpy_globals() -> list:
    names = [np.ndarray, np.dtype, np.dtypes.UInt32DType, np.dtypes.Float64DType,
             np.dtypes.Int64DType]
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return names + [_reconstruct]


ALLOWED = [argparse.Namespace] + _numpy_globals()
"""The only globals a Megatron checkpoint may reference."""


def safe_load(path, what: str | None = None):
    """``torch.load(path, weights_only=True)`` with Megatron's allow-list.

    Raises:
        ManifestError: if the file needs unsafe unpickling (any other global),
            naming the file and the global it asked for.
        FileNotFoundError: if ``path`` does not exist.
    """
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        detail = next((line.strip() for line in str(exc).splitlines()
                       if "GLOBAL" in line or "Unsupported" in line), first)
        raise ManifestError(f"{what or path}: refusing unsafe unpickling ({detail}); tenplex loads "
                            "Megatron files with weights_only=True and allows only "
                            "argparse.Namespace and NumPy arrays") from None
