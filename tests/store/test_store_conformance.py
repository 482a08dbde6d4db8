"""One conformance suite, run on file://, memory:// and s3:// (a local moto server)."""

import json

import fsspec
import pytest
import torch

from tenplex.api import assemble, load, reshard, save, verify
from tenplex.errors import (AlreadyExistsError, CorruptShardError, ManifestError, ShardError)
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.store import StoreReader, StoreWriter

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100, swiglu=True,
               tied=True, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=3000,
               make_vocab_size_divisible_by=8)
SRC = P(dp=2, tp=2, pp=1)


@pytest.fixture(scope="module")
def state():
    tree = gpt_tree(SPEC)
    st = random_state(tree, SRC, 7)
    shards = {r: materialize(tree, st, SRC, r) for r in range(SRC.world_size)}
    return tree, st, shards


def _same(tree, expected, got):
    for path, _ in tree.tensors():
        assert bitwise_equal(expected[path], got[path]), path


def _fs(url):
    return fsspec.core.url_to_fs(url)


def test_save_assemble_round_trip(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards, block=4096)
    got = assemble(f"{root}/ck")
    _same(tree, st, got)
    assert got["optimizer/step"] == st["optimizer/step"]
    assert got["rng/tensor_parallel"] == st["rng/tensor_parallel"]
    assert verify(f"{root}/ck")["tensors"] > 0


@pytest.mark.parametrize("target", ["dp=1,tp=1,pp=2", "dp=3,tp=2,pp=1", "dp=1,tp=1,pp=1"])
def test_reshard_round_trip(root, state, target):
    tree, st, shards = state
    save(f"{root}/a", tree, SRC, shards, block=4096)
    report = reshard(f"{root}/a", f"{root}/b", P.parse(target))
    _same(tree, st, assemble(f"{root}/b"))
    verify(f"{root}/b")
    assert report.bytes_needed <= report.bytes_read


def test_load_one_rank_reads_only_its_ranges(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards, block=4096)
    reader = StoreReader(f"{root}/ck")
    total = sum(f.size for f in reader.manifest.files.values())
    target = P(dp=1, tp=2, pp=2)
    local = load(f"{root}/ck", target, 3)
    expected = materialize(tree, st, target, 3)
    assert set(local) == set(expected)
    for path, t in expected.items():
        if isinstance(t, torch.Tensor):
            assert bitwise_equal(local[path], t), path
    # one stage's tp half: range reads fetch far less than the whole checkpoint
    from tenplex.store.execute import StorePlanRunner
    from tenplex.transform import make_plan
    runner = StorePlanRunner(reader, make_plan(tree, SRC, target))
    for path, _ in tree.tensors():
        runner.leaf(path, [3])
    assert reader.bytes_read < 0.5 * total
    assert runner.bytes_needed <= reader.bytes_read


def test_never_overwrites_a_committed_checkpoint(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards)
    before = _fs(f"{root}/ck")[0].cat_file(_fs(f"{root}/ck/manifest.json")[1])
    with pytest.raises(AlreadyExistsError, match="a committed checkpoint exists"):
        save(f"{root}/ck", tree, SRC, shards)
    assert _fs(f"{root}/ck")[0].cat_file(_fs(f"{root}/ck/manifest.json")[1]) == before
    verify(f"{root}/ck")


def test_uncommitted_save_is_invisible_and_rerun_succeeds(root, state):
    tree, st, shards = state
    writer = StoreWriter(f"{root}/ck", tree, SRC)
    for rank, entries in writer.entries().items():
        for path, _, _ in entries:
            writer.write(rank, path, shards[rank][path])
    # no commit: as if the process died before the manifest
    with pytest.raises(ManifestError, match="not a committed checkpoint .*incomplete save"):
        StoreReader(f"{root}/ck")
    save(f"{root}/ck", tree, SRC, shards)
    _same(tree, st, assemble(f"{root}/ck"))


def test_failed_save_leaves_nothing(root, state):
    tree, st, shards = state
    bad = {r: dict(s) for r, s in shards.items()}
    path = "model/layers/1/mlp/fc2/weight"
    bad[0][path] = bad[0][path].float()
    with pytest.raises(ShardError, match=f"tensor {path}: expected .* bfloat16, found .* float32"):
        save(f"{root}/ck", tree, SRC, bad)
    fs, p = _fs(f"{root}/ck")
    assert not fs.exists(f"{p}/manifest.json") and not fs.exists(f"{p}/shards")


def _corrupt(url, key, fn):
    fs, p = _fs(f"{url}/{key}")
    data = fs.cat_file(p)
    with fs.open(p, "wb") as f:
        f.write(fn(data))


def test_flipped_byte_is_reported(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards, block=4096)
    reader = StoreReader(f"{root}/ck")
    rec = reader.manifest.tensors[("model/layers/0/mlp/fc1/weight", 0)]
    flip = lambda d: d[:rec.offset + 10] + bytes([d[rec.offset + 10] ^ 0xFF]) + d[rec.offset + 11:]
    _corrupt(f"{root}/ck", rec.file, flip)
    pattern = (rf"{rec.file}: checksum mismatch in block \d+ \(bytes \d+..\d+\) holding "
               rf".*model/layers/0/mlp/fc1/weight.*: "
               r"expected xxh3-128 [0-9a-f]{32}, found [0-9a-f]{32}")
    with pytest.raises(CorruptShardError, match=pattern):
        assemble(f"{root}/ck")
    with pytest.raises(CorruptShardError, match=pattern):
        verify(f"{root}/ck")


def test_truncated_and_missing_shards_are_reported(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards)
    _corrupt(f"{root}/ck", "shards/rank-00001.safetensors", lambda d: d[: len(d) // 2])
    with pytest.raises(CorruptShardError, match=r"rank-00001.safetensors: shard file is truncated .*expected \d+ bytes, found \d+"):
        verify(f"{root}/ck")
    fs, p = _fs(f"{root}/ck/shards/rank-00001.safetensors")
    fs.rm(p)
    with pytest.raises(CorruptShardError, match="rank-00001.safetensors: shard file is missing"):
        assemble(f"{root}/ck")


@pytest.mark.parametrize("edit,message", [
    (lambda m: {**m, "format": "tenplex.store/99"}, "unknown format 'tenplex.store/99'"),
    (lambda m: "{not json", "malformed JSON"),
    (lambda m: {**m, "tensors": [{**m["tensors"][0], "file": "../escape.safetensors"}] + m["tensors"][1:]},
     r"segment '\.\.' is not allowed"),
    (lambda m: {**m, "tensors": [{**m["tensors"][0], "file": "/abs/x.safetensors"}] + m["tensors"][1:]},
     "expected a relative"),
    (lambda m: {**m, "tree": {**m["tree"], "leaves": {"../x": {"kind": "value", "scope": "global"},
                                                      **m["tree"]["leaves"]}}},
     r"segment '\.\.' is not allowed"),
    (lambda m: {**m, "tensors": [{**m["tensors"][0], "dtype": "float16"}] + m["tensors"][1:]},
     "has dtype float16, the tree says bfloat16"),
    (lambda m: {**m, "values": {}}, "value leaf .* has no value"),
])
def test_bad_manifests_are_refused(root, state, edit, message):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards)
    fs, p = _fs(f"{root}/ck/manifest.json")
    obj = json.loads(fs.cat_file(p))
    new = edit(obj)
    with fs.open(p, "wb") as f:
        f.write(new.encode() if isinstance(new, str) else json.dumps(new).encode())
    with pytest.raises(ManifestError, match=message):
        StoreReader(f"{root}/ck")


def test_missing_leaf_in_index_is_reported(root, state):
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards)
    fs, p = _fs(f"{root}/ck/manifest.json")
    obj = json.loads(fs.cat_file(p))
    obj["tensors"] = [t for t in obj["tensors"] if t["path"] != "model/final_norm/weight"]
    with fs.open(p, "wb") as f:
        f.write(json.dumps(obj).encode())
    with pytest.raises(ManifestError, match="no stored tensor holds leaf model/final_norm/weight"):
        assemble(f"{root}/ck")


def test_files_are_real_safetensors(root, state):
    from safetensors.torch import load as st_load
    tree, st, shards = state
    save(f"{root}/ck", tree, SRC, shards)
    fs, p = _fs(f"{root}/ck/shards/rank-00000.safetensors")
    loaded = st_load(fs.cat_file(p))
    assert torch.equal(loaded["model/final_norm/weight"], shards[0]["model/final_norm/weight"])
    assert loaded["model/layers/0/mlp/fc1/weight"].shape == shards[0]["model/layers/0/mlp/fc1/weight"].shape
