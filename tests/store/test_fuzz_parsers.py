"""Fuzz the store's two parsers of untrusted bytes with mutated valid files (issue 20).

A real manifest and a real safetensors header (written by :func:`tenplex.api.save`)
are mutated by hypothesis: bytes flipped, inserted, deleted, the file cut,
digits repeated, brackets nested, and (:func:`targeted`) the fields that broke the
old parsers aimed at: integer literals replaced by integers past every limit,
degrees at the world-size limit, values nested deeper than the recursion
limit, arrays of a million empty arrays. Each parser must either accept the bytes or
raise a :class:`~tenplex.errors.TenplexError` subclass; nothing else escapes
(no ``ValueError``, ``RecursionError``, ``MemoryError``, ``KeyError``...). Each
test is bounded: a fixed number of examples, each under a deadline.

Run against older code (this file copied into an archive of the commit, with
``PYTHONPATH`` at it): on e4220c6 both tests fail, each with ``ValueError:
Exceeds the limit (4300 digits) for integer string conversion: value has 5000
digits`` (the manifest's ``config.dp``; a safetensors ``shape``); on 79514cb
the manifest test fails with ``OverflowError: cannot convert float infinity to
integer`` (``1e400`` in the tree, read by ``int(...)``), a defect this fuzz found
and the manifest parser now refuses (``expected an integer, found inf``). The
same aimed edits, tried one by one, found ``tree.num_layers = 2**40`` building
a list per layer (a hang; now refused against ``MAX_LAYERS``).
"""

from __future__ import annotations

import functools
import pathlib
import re
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.api import save
from tenplex.errors import ManifestError, TenplexError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.store.manifest_parse import parse_manifest
from tenplex.store.safetensors_format import header_length, parse_header

FUZZ = settings(max_examples=150, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""At most 150 examples of at most 2 s each (in practice: a few seconds per test)."""


@functools.cache
def _store() -> pathlib.Path:
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-fuzz-")) / "ck"
    spec = GPTSpec(num_layers=1, hidden=16, heads=2, query_groups=2, ffn=32, vocab=40,
                   optimizer="distributed_adam", bucket_numel=500)
    tree, a = gpt_tree(spec), P(dp=2, tp=2)
    state = random_state(tree, a, 1)
    save(str(root), tree, a, {r: materialize(tree, state, a, r) for r in range(a.world_size)}, block=256)
    return root


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with a few random edits (flips, inserts, deletes, a cut, repeats of one byte)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut", "repeat"]))
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[i:i + draw(st.integers(1, 16))]
        elif kind == "cut":
            del out[i:]
        elif kind == "repeat" and out:
            out[i:i] = bytes([out[i]]) * draw(st.sampled_from([2, 100, 5000]))
    return bytes(out)


HOSTILE_NUMBERS = [b"1" + b"0" * 60, b"9" * 5000, b"18446744073709551616", b"1099511627776", b"65536",
                   b"4096", b"-1", b"0", b"1e400", b"-0.5"]
"""Integers past every limit (a 61-digit one, one past Python's 4300-digit ``int`` string limit,
2**64, 2**40), degrees at the world-size limit (65536: ``tp`` of that size made the old parser
compute every holder class), and numbers of the wrong kind."""

_NUMBER = re.compile(rb"(?<=[:\[,\s])-?\d+(?=[,\]}\s])")


@st.composite
def targeted(draw, data: bytes) -> bytes:
    """``data`` (JSON) with the fields that broke the old parsers aimed at: one integer literal
    replaced by a hostile number, a value nested ``k`` deep, or a huge array of empty arrays."""
    spans = [m.span() for m in _NUMBER.finditer(data)]
    if not spans:
        return data
    start, end = draw(st.sampled_from(spans))
    kind = draw(st.sampled_from(["number", "number", "nested", "count"]))
    if kind == "number":
        new = draw(st.sampled_from(HOSTILE_NUMBERS))
    elif kind == "nested":
        k = draw(st.sampled_from([70, 5000, 200_000]))
        new = b"[" * k + data[start:end] + b"]" * k
    else:
        new = b"[" + b"[]," * draw(st.sampled_from([1000, 1_000_000])) + b"[]]"
    return data[:start] + new + data[end:]


def hostile(data: bytes):
    """Half random edits (:func:`mutated`), half edits aimed at the fields that broke (:func:`targeted`)."""
    return st.one_of(mutated(data), targeted(data))


def _manifest() -> bytes:
    return (_store() / "manifest.json").read_bytes()


def _header_file() -> tuple[bytes, int]:
    shard = sorted((_store() / "shards").iterdir())[0]
    data = shard.read_bytes()
    return data, len(data)


@FUZZ
@given(st.data())
def test_manifest_parser_raises_only_tenplex_errors(data):
    blob = data.draw(hostile(_manifest()))
    try:
        parse_manifest(blob, "fuzz/manifest.json")
    except TenplexError:
        pass


@FUZZ
@given(st.data())
def test_safetensors_header_parser_raises_only_tenplex_errors(data):
    raw, size = _header_file()
    n = header_length(raw[:8], size, "fuzz")
    if data.draw(st.booleans()):  # the whole prefix: length field and JSON
        blob = data.draw(mutated(raw[: 8 + n]))
    else:  # the JSON aimed at, its length field kept true (so the JSON itself is parsed)
        text = data.draw(hostile(raw[8: 8 + n]))
        blob, size = struct.pack("<Q", len(text)) + text, size - n + len(text)
    try:
        m = header_length(blob[:8], size, "fuzz.safetensors")
        parse_header(blob[8: 8 + m], size, "fuzz.safetensors")
    except TenplexError:
        pass


@pytest.mark.parametrize("field,value,message", [
    (b'"num_layers": ', b"1e400", r"tree\.num_layers: expected an integer, found inf"),
    (b'"num_layers": ', b"1.5", r"tree\.num_layers: expected an integer, found 1\.5"),
    (b'"num_layers": ', b"1099511627776", r"tree\.num_layers: expected an integer in \[1, 4096\]"),
    (b'"align": ', b"1e400", r"tree\.buffers\[0\]\.align: expected an integer, found inf"),
])
def test_what_the_aimed_edits_found_is_refused(field, value, message):
    """Found by :func:`targeted` on 79514cb: ``1e400`` in the tree escaped as ``OverflowError``
    (this test fails there with it) and ``num_layers = 2**40`` built a list per layer (it hangs there)."""
    data = _manifest()
    i = data.index(field) + len(field)
    j = re.match(rb"-?\d+", data[i:]).end() + i
    with pytest.raises(ManifestError, match=message):
        parse_manifest(data[:i] + value + data[j:], "fuzz/manifest.json")
