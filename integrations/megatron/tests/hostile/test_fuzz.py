"""Fuzz the two parsers of torch files with mutated valid files (issue 20).

A real ``torch.save`` archive (a Megatron-like dict: a Namespace of args,
tensors, an OrderedDict, nested lists) is mutated by hypothesis in its zip
central directory and local headers, and its ``data.pkl`` is mutated on its
own. :func:`~tenplex_megatron.torchfiles.safe_load.safe_load` (torch's zip
reader, Python's zip directory, the restricted unpickler, then torch.load)
and :func:`~tenplex_megatron.torchfiles.ptfile.load_refs` must either read
the file or raise a :class:`~tenplex.errors.TenplexError` subclass. Each
test runs a fixed number of examples under a deadline.

The random edits alone passed on the old code. The ``targeted`` tests aim at
what broke: a differential check of zip edits (a case twin of a data record,
the archive re-zipped, a local-header offset moved: whatever tenplex reads must
equal what ``torch.load`` reads) and hostile pickle values (shared references
with a 2**60-leaf repr, 4 MiB integers, refused calls on them). Run against
e4220c6 (this file copied into an archive of it, imports pointed at its flat
module names): the zip test fails with ``AssertionError: tensors read wrong:
['b']`` (found in 17 s), and the pickle test does not return (no example
finished; killed by ``timeout 180``). On 79514cb all six pass in about 16 s.
"""

from __future__ import annotations

import argparse
import functools
import io
import struct
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.errors import TenplexError

from hostile_pickles import call, glob2, pt_records, pt_write, text
from hostile_round2 import long_int_pickle, mutated, shared_refs_pickle, zip_targeted
from tenplex_megatron.torchfiles.restricted_unpickler import unpickle
from tenplex_megatron.torchfiles.ptfile import load_refs
from tenplex_megatron.torchfiles.safe_load import safe_load
from tenplex.limits import short

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


def _torch_reads(blob: bytes):
    """What ``torch.load`` reads from ``blob`` (the reference), or None where it cannot read it."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:
        return None


def _tensors(obj) -> dict:
    return {k: v for k, v in obj["model"].items()}


@FUZZ
@given(data=st.data())
def test_targeted_zip_edits_are_read_as_torch_reads_them_or_refused(data, tmp_path):
    """Differential: where tenplex reads a file at all, every tensor equals what torch.load reads.

    The edits aim at what broke (a case twin of a data record, a re-zipped archive, a local-header
    offset moved); ``load_refs`` places tensors from its own pass over the zip directory, so a
    record it finds in the wrong place is wrong weights, not an error.
    """
    blob = data.draw(zip_targeted(_archive()))
    want = _torch_reads(blob)
    path = tmp_path / "fuzz.pt"
    path.write_bytes(blob)
    try:
        refs, _ = load_refs(str(path))
        got = {k: r.read()[0] for k, r in refs["model"].items()}
    except TenplexError:
        return
    assert want is not None, "tenplex read a file that torch.load cannot read"
    wrong = [k for k, v in _tensors(want).items() if not torch.equal(got[k].reshape(v.shape), v)]
    assert not wrong, f"tensors read wrong: {wrong}"
    try:
        obj = safe_load(path)
    except TenplexError:
        return
    assert all(torch.equal(obj["model"][k], v) for k, v in _tensors(want).items())


def _shared(depth: int, base: int = 1 << 20) -> bytes:
    """A value nested ``depth`` deep, each level a pair of the level below (memo ``base``..)."""
    out = b"]r" + struct.pack("<I", base)
    for i in range(1, depth):
        out += b"j" + struct.pack("<I", base + i - 1) + b"\x86r" + struct.pack("<I", base + i)
    return out


HOSTILE_VALUES = {"shared-60": _shared(60), "long-int": long_int_pickle(1 << 16),
                  "long-int-huge": long_int_pickle(1 << 22),
                  "refused-call-shared": call(glob2("_codecs", "encode"), _shared(60), text("latin1")),
                  "refused-global-long-int": call(glob2("builtins", "eval"), long_int_pickle(1 << 22))}
"""Pickle fragments that broke the old reader: a list of shared references with a 2**60-leaf
repr (the messages and walks that built it never returned), integers of 64 KiB and 4 MiB, and
calls the allow-list refuses with those as arguments (the refusal's message described them)."""


@settings(FUZZ, max_examples=20)  # 2 keys x 5 fragments: 20 draws cover them
@given(data=st.data())
def test_targeted_pickle_values_raise_only_tenplex_errors(data, tmp_path):
    """A value of ``data.pkl`` (the iteration, the checkpoint version, an RNG entry) replaced by a
    hostile fragment; ``safe_load`` and ``load_refs`` either read it or refuse it, quickly."""
    from hostile_pickles import replace_value
    records = pt_records(_archive())
    key = data.draw(st.sampled_from(["iteration", "checkpoint_version"]))
    pkl = replace_value(records["data.pkl"], key, HOSTILE_VALUES[data.draw(st.sampled_from(sorted(HOSTILE_VALUES)))])
    path = tmp_path / "fuzz.pt"
    pt_write(path, {**records, "data.pkl": pkl})
    for read in (lambda: safe_load(path), lambda: load_refs(str(path))):
        try:
            obj = read()
        except TenplexError:
            continue
        short(obj)  # a description of what was read is cheap whatever it holds


def test_mutation_strategy_reaches_the_directory():
    raw = _archive()
    assert 0 < _directory_span(raw) < len(raw)
    assert safe_load(io.BytesIO(raw), "fuzz.pt")["iteration"] == 10


pytestmark = pytest.mark.filterwarnings("ignore")
