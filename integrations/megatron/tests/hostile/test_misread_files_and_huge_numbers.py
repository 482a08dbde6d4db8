"""Issue 20: valid files that tenplex read wrong, and tiny files whose numbers hung or blew up.

Every file is a copy of a real megatron-core checkpoint (:func:`hostile_corpus.real_checkpoint`)
with one file rewritten (:mod:`hostile_round2`). A valid file must be read to exactly what
``torch.load`` reads; a hostile one must be refused by the CLI with exit 1 and one stderr line
naming the file and the field, nothing written.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import struct

import pytest
import torch

from hostile_corpus import DOPT_PT, MODEL_PT, real_checkpoint
from hostile_pickles import pt_edit, replace_value
from hostile_round2 import args_edit, case_twin_item, own_storages, rezip
from inprocess_cli import run_cli

from tenplex.errors import CorruptShardError, UnsafePickleError

TIMEOUT = 120


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return real_checkpoint(tmp_path_factory.mktemp("round2-real"))


def _copy(real: pathlib.Path, fmt: str, tmp: pathlib.Path) -> pathlib.Path:
    ckpt = tmp / "ckpt"
    shutil.copytree(real / fmt, ckpt, symlinks=True)
    (tmp / "cwd").mkdir()
    return ckpt


def _refused(tmp: pathlib.Path, argv: list[str], file: str, message: str) -> str:
    done = run_cli(argv, cwd=tmp / "cwd", timeout=TIMEOUT)
    assert done.returncode == 1, f"exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line:\n{done.stderr[-3000:]}"
    assert lines[0].startswith("tenplex ") and "Traceback" not in done.stderr, lines[0]
    assert pathlib.PurePath(file).name in lines[0], f"the message does not name {file}: {lines[0]}"
    assert re.search(message, lines[0]), f"{message!r} not in: {lines[0]}"
    assert not (tmp / "out").exists(), "a refused command left output behind"
    assert os.listdir(tmp / "cwd") == []
    return lines[0]


def _torch_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, weights_only=False)
    return {k: v for k, v in obj["model"].items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------- wrong weights, exit 0

def test_rezipped_legacy_pt_is_read_exactly(real, tmp_path):
    """A legacy ``.pt`` (one storage per tensor) re-zipped by Python's zipfile is valid (torch.load
    reads it exactly); tenplex placed its tensors where torch's own writer would have put them."""
    from tenplex_megatron.torchfiles.ptfile import load_refs
    ckpt = _copy(real, "legacy", tmp_path)
    own_storages(ckpt / MODEL_PT)
    want = _torch_tensors(ckpt / MODEL_PT)
    for rel in (MODEL_PT, DOPT_PT):
        rezip(ckpt / rel)
    assert {k: torch.equal(v, want[k]) for k, v in _torch_tensors(ckpt / MODEL_PT).items()} == \
        {k: True for k in want}, "torch.load does not read the re-zipped file exactly"
    refs, _ = load_refs(str(ckpt / MODEL_PT))
    got = {k: r.read()[0] for k, r in refs["model"].items() if hasattr(r, "read")}
    assert got.keys() == want.keys()
    wrong = [k for k in want if not torch.equal(got[k], want[k])]
    assert not wrong, f"{len(wrong)} tensors read wrong: {wrong[:4]}"


@pytest.mark.slow
def test_rezipped_legacy_reshards_to_the_same_weights(real, tmp_path):
    ckpt = _copy(real, "legacy", tmp_path)
    own_storages(ckpt / MODEL_PT)
    for rel in (MODEL_PT, DOPT_PT):
        rezip(ckpt / rel)
    out = tmp_path / "out"
    done = run_cli(["reshard", str(ckpt), str(out), "--to", "dp=1,tp=1,pp=1", "--format", "megatron-legacy"],
                   cwd=tmp_path / "cwd", timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    want, got = _torch_tensors(real / "legacy" / MODEL_PT), _torch_tensors(out / MODEL_PT)
    wrong = [k for k in want if k in got and not torch.equal(got[k], want[k])]
    assert not wrong and set(want) <= set(got), f"{len(wrong)} tensors written wrong: {wrong[:4]}"


@pytest.mark.parametrize("command", ["verify", "reshard"])
def test_dcp_item_with_a_case_twin_record_is_refused(real, tmp_path, command):
    """A DCP item with a stored decoy ``data/0`` and a deflated twin ``DATA/0``: torch.load reads the
    twin; tenplex checked the decoy and read the compressed stream as float32.

    Evidence on e4220c6 (the real checkpoint of this module, item ``embedding.word_embeddings.weight``
    made a case twin by :func:`hostile_round2.case_twin_item`; the e4220c6 CLI run with its own entry
    points): ``tenplex verify`` exit 0 ("OK (megatron-dist): 3 files, ... every record's CRC-32
    verified on disk"); ``tenplex reshard CKPT OUT --to dp=1,tp=1,pp=1 --format megatron-legacy``
    exit 0, and the output's ``embedding.word_embeddings.weight`` begins ``[1.059, -1.88e-39,
    -9.13e-36, 8.22e-33, -2.31e+36, 1.75e+11]`` where torch.load of the twin reads ``[-0.00223,
    -0.00993, 0.00326, -0.0176, 0.00108, 0.0134]``: wrong weights, exit 0. On 79514cb both commands
    exit 1 with the one line this test expects.
    """
    ckpt = _copy(real, "dist", tmp_path)
    true = case_twin_item(ckpt)
    assert true.numel() > 0  # torch.load reads the twin, the real values
    argv = ["reshard", str(ckpt), str(tmp_path / "out"), "--to", "dp=1,tp=1,pp=1", "--format", "megatron-legacy"]
    _refused(tmp_path, argv if command == "reshard" else ["verify", str(ckpt)], "evil.distcp",
             r"embedding\.word_embeddings\.weight.*record.*same name without regard to case")


# ---------------------------------------------------------------- numbers that size loops

@pytest.mark.parametrize("field,value", [
    ("expert_model_parallel_size", 2 ** 40), ("data_parallel_size", 2 ** 40),
    ("num_layers", 2 ** 24), ("num_experts", 2 ** 24), ("num_attention_heads", 2 ** 30),
    ("tensor_model_parallel_size", 2 ** 40), ("vocab_size", 2 ** 50)])
def test_args_with_huge_counts_are_refused(real, tmp_path, field, value):
    """``ep=2**40`` looped forever (``dp += 1``) and ``num_layers=2**24`` built a leaf per layer,
    even in ``inspect``."""
    ckpt = _copy(real, "legacy", tmp_path)
    args_edit(ckpt / MODEL_PT, **{field: value})
    _refused(tmp_path, ["inspect", str(ckpt)], "model_optim_rng.pt", rf"args\.{field}: expected an integer")


def test_common_pt_args_with_huge_degree_are_refused(real, tmp_path):
    ckpt = _copy(real, "dist", tmp_path)
    args_edit(ckpt / "common.pt", expert_model_parallel_size=2 ** 40)
    _refused(tmp_path, ["inspect", str(ckpt)], "common.pt", r"args\.expert_model_parallel_size")


# ---------------------------------------------------------------- messages and walks over shared references

def _shared(depth: int, base: int = 1 << 20) -> bytes:
    """A value nested ``depth`` deep, each level a pair of the level below (memo ``base``..)."""
    out = b"]r" + struct.pack("<I", base)
    for i in range(1, depth):
        out += b"j" + struct.pack("<I", base + i - 1) + b"\x86r" + struct.pack("<I", base + i)
    return out


def test_shared_references_in_args_are_refused_quickly(real, tmp_path):
    """A 700-byte value with a 2**60-leaf repr: the messages that walked it (``!r:.80``) and
    ``to_jsonable`` never returned."""
    ckpt = _copy(real, "legacy", tmp_path)
    pt_edit(ckpt / MODEL_PT, lambda data: replace_value(data, "checkpoint_version", _shared(60)))
    _refused(tmp_path, ["inspect", str(ckpt)], "model_optim_rng.pt",
             r"checkpoint_version|nested objects|more than")


def test_shared_references_in_a_refused_call_give_a_short_message(tmp_path):
    from hostile_pickles import call, glob2
    from tenplex_megatron.torchfiles.safe_load import safe_load
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)
    pt_edit(path, lambda data: replace_value(data, "a", call(glob2("_codecs", "encode"), _shared(60),
                                                              b"X\x06\x00\x00\x00latin1")))
    with pytest.raises(UnsafePickleError, match=r"only encode\(str, 'latin1'\) is allowed") as info:
        safe_load(path)
    assert len(str(info.value)) < 600


def test_expanded_view_in_common_pt_is_refused(real, tmp_path):
    """A stride-0 view: 2.7 KB on disk, 2 GiB once made contiguous for the JSON form."""
    ckpt = _copy(real, "dist", tmp_path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(ckpt / "common.pt", weights_only=False)
    common["checkpoint_version"] = torch.zeros(1).expand(1 << 29)
    torch.save(common, ckpt / "common.pt")
    _refused(tmp_path, ["inspect", str(ckpt)], "common.pt", r"expanded or overlapping view")


def test_object_count_per_pickle_is_bounded(monkeypatch):
    from tenplex_megatron.torchfiles import restricted_unpickler as ru
    monkeypatch.setattr(ru, "MAX_PICKLE_OBJECTS", 1000)
    data = b"\x80\x02]" + b"]a" * 2000 + b"."
    with pytest.raises(UnsafePickleError, match=r"more than 1000 objects"):
        ru.unpickle(data, ru.Profile("test", {}, opcodes=frozenset({"PROTO", "EMPTY_LIST", "APPEND", "STOP"})),
                    "x.pkl")


def test_refused_legacy_write_leaves_no_output_folder(real, tmp_path, monkeypatch):
    """A ``reshard --format megatron-legacy`` refused while files are written left an empty folder."""
    from tenplex_megatron.formats.legacy import write as legacy_write

    def refuse(*args, **kwargs):
        raise CorruptShardError("model_optim_rng.pt: refused while writing (a source lie found mid-write)")

    monkeypatch.setattr(legacy_write, "_write_rank", refuse)
    ckpt = _copy(real, "legacy", tmp_path)
    _refused(tmp_path, ["reshard", str(ckpt), str(tmp_path / "out"), "--to", "dp=1,tp=1,pp=1",
                        "--format", "megatron-legacy"], "model_optim_rng.pt", "refused while writing")


# ---------------------------------------------------------------- reads outside the checkpoint

def _move_out(ckpt: pathlib.Path, rel: str) -> None:
    """Move ``rel`` beside the checkpoint and leave a symlink to it: a valid file, outside the root."""
    outside = ckpt.parent / f"outside-{pathlib.PurePath(rel).name}"
    os.replace(ckpt / rel, outside)
    os.symlink(outside, ckpt / rel)


@pytest.mark.parametrize("fmt,rel", [("legacy", MODEL_PT), ("legacy", DOPT_PT), ("legacy", "iter_0000010"),
                                     ("dist", "common.pt"), ("dist", ".metadata")])
def test_links_out_of_the_checkpoint_are_refused(real, tmp_path, fmt, rel):
    """Symlinks were followed everywhere but DCP's relative_path: a link to a private file printed
    its size (and block digests would have leaked its hashes)."""
    ckpt = _copy(real, fmt, tmp_path)
    _move_out(ckpt, rel)
    _refused(tmp_path, ["inspect", str(ckpt)], pathlib.PurePath(rel).name,
             r"resolves to .*outside-.*, outside the checkpoint directory")
