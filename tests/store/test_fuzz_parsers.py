"""Fuzz the store's two parsers of untrusted bytes with mutated valid files (issue 20).

A real manifest and a real safetensors header (written by :func:`tenplex.api.save`)
are mutated by hypothesis: bytes flipped, inserted, deleted, the file cut,
digits repeated, brackets nested. Each parser must either accept the bytes or
raise a :class:`~tenplex.errors.TenplexError` subclass; nothing else escapes
(no ``ValueError``, ``RecursionError``, ``MemoryError``, ``KeyError``...). Each
test is bounded: a fixed number of examples, each under a deadline.
"""

from __future__ import annotations

import functools
import pathlib
import tempfile

from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.api import save
from tenplex.errors import TenplexError
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


def _manifest() -> bytes:
    return (_store() / "manifest.json").read_bytes()


def _header_file() -> tuple[bytes, int]:
    shard = sorted((_store() / "shards").iterdir())[0]
    data = shard.read_bytes()
    return data, len(data)


@FUZZ
@given(st.data())
def test_manifest_parser_raises_only_tenplex_errors(data):
    blob = data.draw(mutated(_manifest()))
    try:
        parse_manifest(blob, "fuzz/manifest.json")
    except TenplexError:
        pass


@FUZZ
@given(st.data())
def test_safetensors_header_parser_raises_only_tenplex_errors(data):
    raw, size = _header_file()
    n = header_length(raw[:8], size, "fuzz")
    blob = data.draw(mutated(raw[: 8 + n]))
    try:
        m = header_length(blob[:8], size, "fuzz.safetensors")
        parse_header(blob[8: 8 + m], size, "fuzz.safetensors")
    except TenplexError:
        pass
