"""Fuzz the two parsers of torch files with mutated valid files (issue 20).

A real ``torch.save`` archive (a Megatron-like dict: a Namespace of args,
tensors, an OrderedDict, nested lists) is mutated by hypothesis in its zip
central directory and local headers, and its ``data.pkl`` is mutated on its
own. :func:`~tenplex_megatron.torchfiles.safe_load.safe_load` (torch's zip
reader, Python's zip directory, the restricted unpickler, then torch.load)
and :func:`~tenplex_megatron.torchfiles.ptfile.load_refs` must either read
the file or raise a :class:`~tenplex.errors.TenplexError` subclass. Each
test runs a fixed number of examples under a deadline.
"""

from __future__ import annotations

import argparse
import functools
import io
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.errors import TenplexError

from hostile_pickles import pt_records, pt_write
from hostile_round2 import mutated
from tenplex_megatron.torchfiles.restricted_unpickler import unpickle
from tenplex_megatron.torchfiles.safe_load import safe_load

FUZZ = settings(max_examples=150, deadline=3000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@functools.cache
def _archive() -> bytes:
    obj = {"args": argparse.Namespace(num_layers=2, tensor_model_parallel_size=1, params_dtype=torch.float32),
           "model": OrderedDict(w=torch.arange(12, dtype=torch.float32).reshape(3, 4), b=torch.ones(5)),
           "iteration": 10, "checkpoint_version": 3.0, "rng": [(1, 2.5, "x"), {"k": [None, True]}]}
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _directory_span(data: bytes) -> int:
    """Where the zip's central directory starts (the mutations aim at it and what follows)."""
    return data.rfind(b"PK\x01\x02", 0, data.rfind(b"PK\x05\x06")) - 512


@FUZZ
@given(st.data())
def test_zip_directory_mutations_raise_only_tenplex_errors(data):
    raw = _archive()
    cut = max(_directory_span(raw), 0)
    blob = raw[:cut] + data.draw(mutated(raw[cut:]))
    try:
        safe_load(io.BytesIO(blob), "fuzz.pt")
    except TenplexError:
        pass


@FUZZ
@given(st.data())
def test_whole_archive_mutations_raise_only_tenplex_errors(data):
    blob = data.draw(mutated(_archive()))
    try:
        safe_load(io.BytesIO(blob), "fuzz.pt")
    except TenplexError:
        pass


@FUZZ
@given(data=st.data())
def test_pickle_mutations_raise_only_tenplex_errors(data, tmp_path):
    from tenplex_megatron.torchfiles import safe_load as sl
    from tenplex_megatron.torchfiles.restricted_unpickler import Profile
    records = pt_records(_archive())
    pkl = data.draw(mutated(records["data.pkl"]))
    profile = Profile("torch file", sl.TORCH_GLOBALS, builders=sl._BUILDERS, must_build=(sl._NpDtype, sl._NpArray),
                      opcodes=sl._OPCODES, persistent_load=lambda pid: None, dict_types=(dict, OrderedDict))
    try:
        unpickle(pkl, profile, "fuzz/data.pkl")
    except TenplexError:
        pass
    path = tmp_path / "fuzz.pt"
    pt_write(path, {**records, "data.pkl": pkl})
    try:
        safe_load(path)
    except TenplexError:
        pass


def test_mutation_strategy_reaches_the_directory():
    raw = _archive()
    assert 0 < _directory_span(raw) < len(raw)
    assert safe_load(io.BytesIO(raw), "fuzz.pt")["iteration"] == 10


pytestmark = pytest.mark.filterwarnings("ignore")
