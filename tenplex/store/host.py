"""Host bytes of a tensor that may live on an accelerator, in bounded pieces.

A store file is written from host memory. A shard on a GPU (``cuda``) or any
other non-CPU device is copied to the host in pieces of at most ``chunk``
bytes through one staging buffer (pinned where CUDA can pin it), so saving a
GPU-resident shard holds one piece on the host, not a host copy of the shard.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

STAGING_BYTES = 64 << 20  # bytes per device-to-host copy


def host_bytes(t: torch.Tensor, chunk: int | None = None) -> Iterator[np.ndarray]:
    """The bytes of ``t`` in flat (C) order, as host ``uint8`` arrays of at most ``chunk`` bytes.

    A CPU tensor yields one array that views its memory (after ``contiguous``).
    A tensor on another device yields views of one reused staging buffer: each
    array is valid until the next one is asked for, so write it before moving on.

    Args:
        t: any tensor with data (not ``meta``), any shape and dtype.
        chunk: largest piece in bytes (> 0; default :data:`STAGING_BYTES`); non-CPU tensors only.
    """
    chunk = chunk or STAGING_BYTES
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        yield flat.numpy()
        return
    pin = flat.device.type == "cuda"
    stage = torch.empty(min(chunk, flat.numel()), dtype=torch.uint8, pin_memory=pin)
    for start in range(0, flat.numel(), chunk):
        piece = flat[start:start + chunk]
        host = stage[:piece.numel()]
        host.copy_(piece)  # synchronous: the piece is on the host when copy_ returns
        yield host.numpy()
