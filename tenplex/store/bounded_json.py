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

__all__ = ["load_json", "check_writable", "MAX_INT_DIGITS"]

MAX_INT_DIGITS = 40
"""Longest integer literal accepted (40 digits: 2**128 has 39)."""

_LONG_INT = re.compile(rb"\d{%d,}" % (MAX_INT_DIGITS + 1))
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_QUOTE, _ZERO = ord('"'), np.uint8(ord("0"))
_BRACKET = np.zeros(256, np.int8)  # +1 for a byte that opens a container, -1 for one that closes it
_BRACKET[_OPEN], _BRACKET[_CLOSE] = 1, -1


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _structure(data: bytes, where: str, error: type[Exception], max_depth: int, max_nodes: int) -> bool:
    """Check containers and nesting outside strings; True if ``data`` may hold an integer too long.

    Without a backslash in ``data`` every ``"`` opens or closes a string, so a byte lies outside
    strings where the count of quotes before it is even: a few passes of numpy, no Python object
    per string (the regular expression took 8 ms, a quarter of parsing a 0.4 MB manifest).
    With a backslash the strings are blanked by a regular expression first.
    """
    if b"\\" in data:
        data = _STRING.sub(b'""', data)
    raw = np.frombuffer(data, np.uint8)
    quotes = np.flatnonzero(raw == _QUOTE)
    where_b = np.flatnonzero((raw == _OPEN[0]) | (raw == _OPEN[1]) | (raw == _CLOSE[0]) | (raw == _CLOSE[1]))
    outside = (np.searchsorted(quotes, where_b) & 1) == 0  # an even count of quotes before it
    step = _BRACKET[raw[where_b[outside]]].astype(np.int64)
    nodes = int((step > 0).sum())
    if nodes > max_nodes:
        raise error(f"{where}: expected at most {max_nodes} arrays and objects, found {nodes}")
    depth = int(np.cumsum(step).max(initial=0))
    if depth > max_depth:
        raise error(f"{where}: expected at most {max_depth} levels of nesting, found {depth}")
    edges = np.diff((raw - _ZERO < 10).view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edges == 1)
    long = starts[np.flatnonzero(edges == -1) - starts > MAX_INT_DIGITS]
    return bool(((np.searchsorted(quotes, long) & 1) == 0).any())


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
    long_digits = _structure(data, where, error, max_depth, max_nodes)
    try:  # integers are checked one by one only where a run of digits is long enough to need it
        return json.loads(data, parse_int=_int) if long_digits else json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{where}: malformed JSON: {str(exc)[:200]}") from None
    except ValueError as exc:
        raise error(f"{where}: malformed JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise error(f"{where}: malformed JSON: nested too deeply") from None
    except MemoryError:
        raise error(f"{where}: the JSON does not fit in memory") from None


def check_writable(value: Any, where: str, error: type[Exception], *, depth_used: int = 0) -> str:
    """``value`` as JSON text, checked to be readable back by :func:`load_json` (what a writer must check).

    A value nested ``depth_used`` levels deep in its document may nest at most
    ``MAX_JSON_DEPTH - depth_used`` levels itself; integers may have at most
    :data:`MAX_INT_DIGITS` digits; objects and arrays count towards :data:`MAX_JSON_NODES`.
    Without this check a writer could commit a document its own reader refuses.

    Raises:
        error: naming ``where``: not JSON-serializable (a type, a cycle), nested too deeply,
            too many containers, or an integer too long.
    """
    try:
        text = json.dumps(value)
    except RecursionError:
        raise error(f"{where}: expected at most {MAX_JSON_DEPTH - depth_used} levels of nesting, "
                    "found more than Python's recursion limit") from None
    except (TypeError, ValueError) as exc:
        raise error(f"{where}: expected a JSON-serializable value, found one that is not: "
                    f"{str(exc)[:200]}") from None
    data = text.encode()
    _structure(data, where, error, MAX_JSON_DEPTH - depth_used, MAX_JSON_NODES)
    long = _LONG_INT.search(_STRING.sub(b'""', data))
    if long:
        raise error(f"{where}: expected integers of at most {MAX_INT_DIGITS} digits, found one of "
                    f"{long.end() - long.start()}")
    return text
