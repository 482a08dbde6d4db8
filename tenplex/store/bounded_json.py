"""Parse untrusted JSON within stated limits: size, nesting depth, containers, and integer length.

``json.loads`` builds whatever a document describes: 42 MB of ``[]`` is 14
million lists (about 1 GB), a document nested 100 000 deep is a
``RecursionError``, and an integer of a million digits is a ``ValueError``
(Python 3.11's ``int`` string limit). :func:`load_json` checks the raw bytes
first, with a scan that costs no Python object per byte:

- at most ``max_bytes`` bytes (:data:`~tenplex.limits.MAX_JSON_BYTES`);
- outside strings, at most :data:`~tenplex.limits.MAX_JSON_NODES` ``[`` and
  ``{`` and nesting at most :data:`~tenplex.limits.MAX_JSON_DEPTH` deep;
- integers of at most 40 digits;

then parses, turning any failure into the caller's error type naming ``where``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from tenplex.errors import ManifestError
from tenplex.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_JSON_NODES

__all__ = ["load_json", "MAX_INT_DIGITS"]

MAX_INT_DIGITS = 40
"""Longest integer literal accepted (40 digits: 2**128 has 39)."""

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _structure(data: bytes, where: str, error: type[Exception], max_depth: int, max_nodes: int) -> None:
    bare = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    step = np.isin(bare, _OPEN).astype(np.int32) - np.isin(bare, _CLOSE).astype(np.int32)
    nodes = int((step > 0).sum())
    if nodes > max_nodes:
        raise error(f"{where}: expected at most {max_nodes} arrays and objects, found {nodes}")
    depth = int(np.cumsum(step).max(initial=0))
    if depth > max_depth:
        raise error(f"{where}: expected at most {max_depth} levels of nesting, found {depth}")


def load_json(data: bytes, where: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              max_nodes: int = MAX_JSON_NODES, error: type[Exception] = ManifestError) -> Any:
    """The JSON value in ``data``, within the limits above.

    Raises:
        error: naming ``where``: too large, too deep, too many containers, an integer too
            long, or malformed JSON (also what ``RecursionError`` or ``MemoryError`` would have been).
    """
    if len(data) > max_bytes:
        raise error(f"{where}: expected at most {max_bytes} bytes, found {len(data)}")
    data = bytes(data)
    _structure(data, where, error, max_depth, max_nodes)
    try:
        return json.loads(data, parse_int=_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{where}: malformed JSON: {str(exc)[:200]}") from None
    except ValueError as exc:
        raise error(f"{where}: malformed JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise error(f"{where}: malformed JSON: nested too deeply") from None
    except MemoryError:
        raise error(f"{where}: the JSON does not fit in memory") from None
