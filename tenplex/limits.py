"""Named limits on what tenplex reads from a file, and bounded descriptions of untrusted values.

Nothing read from a checkpoint is trusted (DESIGN.md, invariant 8). Each
number below bounds the work or memory one field of a file can cause; a file
beyond a limit is refused with an error naming the file and the field,
before the work is done. ``docs/guide.md`` ("Limits") lists them.

Each limit can be raised for one process with an environment variable of the
same name prefixed ``TENPLEX_`` (e.g. ``TENPLEX_MAX_PICKLE_OBJECTS``), read
when this module is imported.

:func:`short` describes a value in at most a given number of characters
without building its whole ``repr`` (a pickle of shared references has an
exponential one; an integer of 10**6 digits has no ``str`` in Python 3.11).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["MAX_PICKLE_OBJECTS", "MAX_WALK", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_NODES",
           "MAX_WORLD", "MAX_DEGREE", "MAX_LAYERS", "MAX_EXPERTS", "MAX_HEADS", "MAX_VOCAB",
           "MAX_HIDDEN", "MAX_SAFETENSORS_HEADER", "SAFE_REPR", "short", "check_count", "Walk"]


def _env(name: str, default: int) -> int:
    raw = os.environ.get(f"TENPLEX_{name}")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


MAX_PICKLE_OBJECTS = _env("MAX_PICKLE_OBJECTS", 1 << 23)
"""Most objects one pickle may build (8 Mi; about 64 bytes of Python objects each)."""

MAX_WALK = _env("MAX_WALK", 1 << 21)
"""Most nodes a walk over a loaded object visits (2 Mi; shared references count each time they are reached)."""

MAX_JSON_BYTES = _env("MAX_JSON_BYTES", 1 << 28)
"""Largest JSON document read (256 MiB: a 1 TB checkpoint in 1 MiB blocks needs ~40 MB)."""

MAX_JSON_DEPTH = _env("MAX_JSON_DEPTH", 64)
"""Deepest nesting of arrays and objects in a JSON document."""

MAX_JSON_NODES = _env("MAX_JSON_NODES", 1 << 22)
"""Most arrays and objects in a JSON document (4 Mi; each costs ~60 bytes or more once parsed)."""

MAX_SAFETENSORS_HEADER = _env("MAX_SAFETENSORS_HEADER", 1 << 26)
"""Largest safetensors JSON header, in bytes (64 MiB)."""

MAX_WORLD = _env("MAX_WORLD", 1 << 16)
"""Most ranks a parallel config may have (dp * tp * cp * pp, and the expert grid's product)."""

MAX_DEGREE = MAX_WORLD
"""Largest degree of one parallel axis (dp, tp, pp, cp, ep, etp, vpp)."""

MAX_LAYERS = _env("MAX_LAYERS", 1 << 12)
"""Most transformer layers a model may declare (4096)."""

MAX_EXPERTS = _env("MAX_EXPERTS", 1 << 12)
"""Most experts per MoE layer (4096)."""

MAX_HEADS = _env("MAX_HEADS", 1 << 12)
"""Most attention heads or query groups (4096)."""

MAX_VOCAB = _env("MAX_VOCAB", 1 << 24)
"""Largest vocabulary (16 Mi tokens)."""

MAX_HIDDEN = _env("MAX_HIDDEN", 1 << 20)
"""Largest hidden, FFN or head size (1 Mi)."""


SAFE_REPR: set[type] = set()
"""Types whose own ``repr`` is short and safe to call (their objects hold no file data):
registered by the modules that define them."""


_TORCH_SAFE = {("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format")}


def check_count(value: Any, field: str, hi: int, lo: int = 0, error: type[Exception] = ValueError) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``, else ``error`` naming ``field``."""
    if type(value) is not int or not lo <= value <= hi:
        raise error(f"{field}: expected an integer in [{lo}, {hi}], found {short(value)}")
    return value


def short(value: Any, limit: int = 80) -> str:
    """A description of ``value`` in at most about ``limit`` characters, built in O(limit) time.

    Strings, bytes, numbers and containers are shown as ``repr`` would, cut with
    ``...``; an integer too long to show gives its bit length; any other object
    only its type name (its own ``__repr__`` is never called).
    """
    out: list[str] = []
    _short(value, out, [limit], 0)
    text = "".join(out)
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


def _short(value: Any, out: list[str], left: list[int], depth: int) -> None:
    if left[0] <= 0:
        return
    if isinstance(value, bool) or value is None or isinstance(value, float):
        piece = repr(value)
    elif isinstance(value, int):
        piece = repr(value) if value.bit_length() <= 200 else f"<int of {value.bit_length()} bits>"
    elif isinstance(value, (str, bytes, bytearray)):
        piece = repr(value[:left[0] + 1])
    elif isinstance(value, (list, tuple, dict, set, frozenset)) and depth < 8:
        _container(value, out, left, depth)
        return
    elif type(value) in SAFE_REPR or (type(value).__module__, type(value).__name__) in _TORCH_SAFE:
        piece = repr(value)[:left[0] + 1]
    else:
        piece = f"<{type(value).__name__}>"
    out.append(piece)
    left[0] -= len(piece)


def _container(value: Any, out: list[str], left: list[int], depth: int) -> None:
    open_, close = {list: "[]", tuple: "()", dict: "{}"}.get(type(value), "{}")
    out.append(open_)
    left[0] -= 1
    items = value.items() if isinstance(value, dict) else value
    for i, item in enumerate(items):
        if left[0] <= 0:
            out.append("...")
            return
        if i:
            out.append(", ")
            left[0] -= 2
        if isinstance(value, dict):
            _short(item[0], out, left, depth + 1)
            out.append(": ")
            left[0] -= 2
            _short(item[1], out, left, depth + 1)
        else:
            _short(item, out, left, depth + 1)
    if type(value) is tuple and len(value) == 1:
        out.append(",")
    out.append(close)
    left[0] -= 1


class Walk:
    """A budget of :data:`MAX_WALK` steps for one walk over a loaded object.

    Call :meth:`step` once per node visited; past the budget it raises ``error``
    naming ``what`` (a walk over shared references can otherwise take
    exponential time and memory).
    """

    def __init__(self, what: str, error: type[Exception], limit: int | None = None):
        self.what, self.error = what, error
        self.left = MAX_WALK if limit is None else limit

    def step(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise self.error(f"{self.what}: more than {MAX_WALK} nested objects (counting shared "
                             "references each time); raise TENPLEX_MAX_WALK to read it")
