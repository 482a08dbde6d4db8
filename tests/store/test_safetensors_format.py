"""Unit tests of tenplex.store.safetensors_format, against the ``safetensors`` package itself."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load as st_load, save as st_save

from tenplex.errors import CorruptShardError
from tenplex.ptree.tree import DTYPES
from tenplex.store.manifest import TensorRecord
from tenplex.store.safetensors_format import (ST_CODES, Entry, check_header, header_bytes,
                                              header_length, parse_header)


def _header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def test_dtype_codes_are_the_packages():
    for name, dtype in DTYPES.items():
        header = _header_of(st_save({"t": torch.zeros(3, dtype=dtype)}))
        assert header["t"]["dtype"] == ST_CODES[name], name


def _tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    return (torch.arange(max(1, int(torch.tensor(shape).prod())) if shape else 1) % 7) \
        .to(dtype)[: int(torch.tensor(shape).prod()) if shape else 1].reshape(shape)


@given(st.lists(st.tuples(st.sampled_from(sorted(DTYPES)),
                          st.lists(st.integers(0, 5), max_size=3)), min_size=0, max_size=6))
def test_written_files_load_with_the_package_and_parse_back(items):
    entries = [Entry(f"leaf/{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(items)]
    tensors = {e[0]: _tensor(DTYPES[e[1]], e[2]) for e in entries}
    prefix, offsets = header_bytes(entries)
    data = prefix + b"".join(tensors[e[0]].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                             for e in entries)
    loaded = st_load(data)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)
    n = header_length(data[:8], len(data), "f")
    parsed = parse_header(data[8:8 + n], len(data), "f")
    by_name = {e[0]: e for e in parsed}
    for entry, offset in zip(entries, offsets):
        assert by_name[entry[0]][1:] == (entry[1], entry[2], offset, offset + entry.nbytes)
    records = [TensorRecord(e[0], 0, "f", o, e.nbytes, e[2], e[1]) for e, o in zip(entries, offsets)]
    check_header(parsed, records, "f")


def test_headers_the_package_writes_parse():
    data = st_save({"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
                   metadata={"k": "v"})
    n = header_length(data[:8], len(data), "f")
    names = [e[0] for e in parse_header(data[8:8 + n], len(data), "f")]
    assert sorted(names) == ["a", "b"]


def _file(header: dict, data_size: int) -> tuple[bytes, int]:
    text = json.dumps(header).encode()
    return text, 8 + len(text) + data_size


@pytest.mark.parametrize("header,data,message", [
    ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, 4, "dtype: expected one of"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "shape: expected a list"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "shape: expected a list"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 99]}}, 8, "data_offsets: expected"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, 8, "data_offsets: expected"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8,
     r"dtype F32 and shape \[3\] make 12 bytes, data_offsets \[0, 8\] hold 8"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, r"leave bytes \[0, 4\) unused"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, "tensors end at byte"),
    ({"a": [1, 2]}, 0, "expected an object, found list"),
])
def test_lying_headers_are_refused(header, data, message):
    text, size = _file(header, data)
    with pytest.raises(CorruptShardError, match=message):
        parse_header(text, size, "f")


def test_header_length_beyond_the_file_is_refused():
    with pytest.raises(CorruptShardError, match="header length: expected at most 92 bytes .*found 1000"):
        header_length(struct.pack("<Q", 1000), 100, "f")
    with pytest.raises(CorruptShardError, match="expected at least 8 bytes, the file has 3"):
        header_length(b"abc", 3, "f")


def test_check_header_names_each_disagreement():
    text, size = _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8)
    parsed = parse_header(text, size, "f")
    base = 8 + len(text)
    good = TensorRecord("a", 0, "f", base, 8, (2,), "float32")
    check_header(parsed, [good], "f")
    for field, bad, message in [
        ("dtype", good.__class__("a", 0, "f", base, 8, (2,), "int32"), "dtype: the manifest says int32"),
        ("shape", good.__class__("a", 0, "f", base, 8, (1, 2), "float32"), r"shape: the manifest says \(1, 2\)"),
        ("offset", good.__class__("a", 0, "f", base + 8, 8, (2,), "float32"), "offset: the manifest says"),
    ]:
        with pytest.raises(CorruptShardError, match=message):
            check_header(parsed, [bad], "f")
    with pytest.raises(CorruptShardError, match="lacks tensor 'b'"):
        check_header(parsed, [good, TensorRecord("b", 0, "f", base, 0, (0,), "float32")], "f")
    with pytest.raises(CorruptShardError, match="lists tensor 'a', which the manifest does not place"):
        check_header(parsed, [], "f")
