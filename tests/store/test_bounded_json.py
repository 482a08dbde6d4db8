"""The JSON structure scan (quote parity in numpy) agrees with blanking strings by a regular expression."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.errors import ManifestError
from tenplex.store.bounded_json import MAX_INT_DIGITS, _structure, load_json

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_LONG_INT = re.compile(rb"\d{%d,}" % (MAX_INT_DIGITS + 1))

_TEXT = st.text(alphabet='ab[]{}"\\:,0123456789 \n\u00e9', max_size=12)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 45, 10 ** 45) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=30)


def _reference(data: bytes) -> tuple[int, int, bool]:
    """Containers, depth and whether an integer is too long, from strings blanked by a regex."""
    bare = _STRING.sub(b'""', data)
    raw = np.frombuffer(bare, np.uint8)
    step = np.isin(raw, np.frombuffer(b"[{", np.uint8)).astype(int) - np.isin(raw, np.frombuffer(b"]}", np.uint8))
    return int((step > 0).sum()), int(np.cumsum(step).max(initial=0)), bool(_LONG_INT.search(bare))


@settings(max_examples=200, deadline=None)
@given(_VALUES, st.booleans())
def test_the_scan_counts_as_the_regex_does(value, ascii_only):
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    nodes, depth, long = _reference(data)
    assert _structure(data, "doc", ManifestError, depth, nodes) == long
    if nodes:
        with pytest.raises(ManifestError, match=f"at most {nodes - 1} arrays and objects, found {nodes}"):
            _structure(data, "doc", ManifestError, depth, nodes - 1)
    if depth:
        with pytest.raises(ManifestError, match=f"at most {depth - 1} levels of nesting, found {depth}"):
            _structure(data, "doc", ManifestError, depth - 1, nodes)
    if long:
        with pytest.raises(ManifestError, match="an integer of"):
            load_json(data, "doc")
    else:
        assert load_json(data, "doc") == value


def test_brackets_and_digits_inside_strings_do_not_count():
    data = b'{"a": "[[[[ 1' + b"0" * 60 + b'", "b\\"[[": [1' + b"0" * 39 + b"]}"
    assert load_json(data, "doc", max_depth=2) == {"a": "[[[[ 1" + "0" * 60, 'b"[[': [10 ** 39]}
