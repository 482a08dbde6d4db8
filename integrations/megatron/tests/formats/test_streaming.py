"""Megatron checkpoints are read in place: metadata only for inspect and plan, files checked on disk
by verify, and every lie or gap refused (real megatron-core checkpoints, edited where a test says so)."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess_cli import tenplex
from mcore_helpers import run_worker
from tenplex.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# ~55 MB of fp32 weights: the files' pickles and DCP's metadata are a small fraction of it
BIG = ("--layers 4 --hidden 512 --heads 8 --ffn 2048 --position rope --untie --vocab 1024 "
       "--make-vocab-size-divisible-by 128 --seq 8")
SMALL = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
         "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    run_worker(2, 2, BIG, "--save", "both", "--save-dir", str(d))
    return d


def _bytes_read() -> int:
    """The kernel's count of bytes this process has read (``rchar``: read(2), pread(2) and the
    like), whatever opened the file: Python's ``open``, ``os.open`` + ``os.fdopen``, or torch's
    C++ reader. A wrapper around ``open`` alone misses the last two. (Memory-mapped pages are not
    counted; ``inspect`` and ``plan`` map nothing.)"""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_inspect_and_plan_read_under_one_percent_of_the_bytes(big, capsys, fmt):
    root = str(big / fmt)
    total = fsspec.filesystem("file").du(root, total=True)
    commands = (["inspect", root, "--json"], ["plan", root, "--to", "tp=1,pp=4", "--json"])
    for argv in commands:  # imports (numpy.ma, lazily by np.unique) and entry points loaded before counting
        assert main(argv) == 0
    for argv in commands:
        before = _bytes_read()
        assert main(argv) == 0
        read = _bytes_read() - before
        assert 0 < read < 0.01 * total, (argv[0], read, total)
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-2])
    assert info["config"]["tp"] == 2 and info["config"]["pp"] == 2


_NO_DCP = """
import json, sys
from tenplex.cli.main import main
root, out = sys.argv[1], sys.argv[2]
for argv in (["inspect", root], ["plan", root, "--to", "tp=1,pp=4"], ["verify", root],
             ["reshard", root, out, "--to", "tp=1,pp=4", "--format", "megatron-legacy"]):
    assert main(argv) == 0, argv
print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint"))))
"""


def test_reading_torch_dist_imports_no_dcp_module(big, tmp_path):
    """inspect, plan, verify and a reshard to legacy read a ``torch_dist`` checkpoint with
    tenplex's own DCP records: importing DCP (and DTensor) costs about 0.6 s of start-up."""
    done = subprocess.run([sys.executable, "-c", _NO_DCP, str(big / "dist"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()


def test_verify_checks_the_files_on_disk(sources, tmp_path):
    source = sources("mha", 2, 2)
    for fmt in ("legacy", "dist"):
        done = tenplex("verify", str(source / fmt), "--checksums")
        assert done.returncode == 0, done.stderr
        assert "CRC-32 verified" in done.stdout and done.stdout.count("xxh3-128 ") >= 4
    legacy = tmp_path / "legacy"
    shutil.copytree(source / "legacy", legacy)
    path = legacy / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    _flip_byte_of(path, torch.load(path, weights_only=False)["model"]["decoder.layers.1.mlp.linear_fc1.weight"])
    done = tenplex("verify", str(legacy))
    assert done.returncode == 1 and "fails its CRC-32 check" in done.stderr and "mp_rank_01_001" in done.stderr
    dist = tmp_path / "dist"
    shutil.copytree(source / "dist", dist)
    with open(dist / "__3_1.distcp", "r+b") as f:  # truncated: items now end past the file
        f.truncate(os.path.getsize(dist / "__3_1.distcp") - 100)
    done = tenplex("verify", str(dist))
    assert done.returncode == 1 and "__3_1.distcp" in done.stderr, done.stderr


def _flip_byte_of(path, tensor) -> None:
    """Flip one byte inside ``tensor``'s stored bytes (found by its exact content)."""
    data = bytearray(open(path, "rb").read())
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    data[at + len(raw) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_tied_copies_are_compared(sources, tmp_path):
    legacy = tmp_path / "legacy"
    shutil.copytree(sources("mha", 2, 2) / "legacy", legacy)
    path = legacy / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["output_layer.weight"][3, 5] += 1.0
    torch.save(state, path)
    done = tenplex("reshard", str(legacy), str(tmp_path / "out"), "--to", "tp=1,pp=2")
    assert done.returncode == 1 and not (tmp_path / "out").exists()
    assert "copies differ: model/embedding/word_embeddings/weight (tp rank 1) on stage 0 and on stage 1" \
        in done.stderr


def _model_config(tmp_path, **fields):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_no_dtype_casts_on_read(sources, tmp_path):
    """The model config says bfloat16, the files hold float32: refused, never cast."""
    cfg = _model_config(tmp_path, params_dtype="bfloat16")
    for fmt in ("legacy", "dist"):
        done = tenplex("--model-config", cfg, "reshard", str(sources("mha", 2, 2) / fmt),
                       str(tmp_path / fmt), "--to", "tp=1,pp=2")
        assert done.returncode == 1 and not (tmp_path / fmt).exists()
        assert "torch.float32; the model config gives" in done.stderr and "never casts" in done.stderr


def test_a_smaller_vocab_is_refused_not_truncated(sources, model_config_file, tmp_path):
    fields = json.loads(model_config_file.read_text())
    cfg = _model_config(tmp_path, **{**fields, "vocab_size": 50})
    done = tenplex("--model-config", cfg, "reshard", str(sources("gqa", 2, 1) / "dist"),
                   str(tmp_path / "out"), "--to", "tp=1")
    assert done.returncode == 1 and not (tmp_path / "out").exists()
    assert "stores 128 vocabulary rows, but vocab_size=50 (make_vocab_size_divisible_by=16) pads to that " \
        "at no tp" in done.stderr
    done = tenplex("--model-config", _model_config(tmp_path, vocab_size=50), "inspect",
                   str(sources("mha", 2, 2) / "legacy"))
    assert done.returncode == 1 and "the args say vocab_size=100" in done.stderr


def test_unknown_tensors_are_refused_by_name(sources, tmp_path):
    """An extra key (say an MoE router) is an error naming it, in both formats."""
    legacy = tmp_path / "legacy"
    shutil.copytree(sources("mha", 2, 2) / "legacy", legacy)
    path = legacy / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 64)
    torch.save(state, path)
    done = tenplex("inspect", str(legacy))
    assert done.returncode == 1 and "unexpected key decoder.layers.0.mlp.router.weight" in done.stderr
    dist = tmp_path / "dist"
    shutil.copytree(sources("mha", 2, 2) / "dist", dist)
    _alias_key(dist, "decoder.layers.mlp.linear_fc2.weight", "decoder.layers.mlp.router.weight")
    done = tenplex("reshard", str(dist), str(tmp_path / "out"), "--to", "tp=1,pp=2", "--format", "tenplex")
    assert done.returncode == 1 and "unknown key decoder.layers.mlp.router.weight" in done.stderr


def _alias_key(root, existing: str, new: str) -> None:
    """Add the DCP tensor ``new`` to ``.metadata``: a copy of ``existing`` (its items' bytes appended
    to their files, so that no bytes are shared, which is refused on its own)."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    with open(root / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata[new] = md.state_dict_metadata[existing]
    for index, info in list(md.storage_data.items()):
        if index.fqn == existing:
            with open(root / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                data = f.read(info.length)
                end = f.seek(0, os.SEEK_END)
                f.write(data)
            md.storage_data[MetadataIndex(new, index.offset)] = dataclasses.replace(info, offset=end)
    with open(root / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_a_missing_adam_moment_is_an_error(tmp_path):
    run_worker(1, 1, SMALL + " --train-steps 1", "--save", "legacy", "--save-dir", str(tmp_path / "src"))
    path = tmp_path / "src" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["optimizer"]["state"][3]["exp_avg_sq"]
    torch.save(state, path)
    done = tenplex("reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "tp=2")
    assert done.returncode == 1 and not (tmp_path / "out").exists()
    assert "Adam exp_avg_sq of" in done.stderr and "(optimizer index 3) is missing" in done.stderr


OPT = SMALL + " --train-steps 1 --dist-opt"


@pytest.fixture(scope="module")
def opt_source(tmp_path_factory):
    """Adam state from megatron-core's distributed optimizer: legacy distrib_optim.pt and dp_reshardable."""
    d = tmp_path_factory.mktemp("opt")
    run_worker(2, 1, OPT, "--sharding-type", "dp_reshardable", "--save", "both", "--save-dir", str(d))
    return d


def _open(path: str):
    from tenplex.store.reader import StoreReader
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    for plugin in (LEGACY, DIST):
        if plugin.detect(path):
            return plugin.open_source(path)
    return StoreReader(path)


def _global(source, path: str) -> torch.Tensor:
    """Leaf ``path``'s global tensor (logical rows), assembled from every rank that holds part of it."""
    from tenplex.ptree.shards import assemble

    config = source.config
    shards = {r: {} for r in range(config.world_size)}
    for r in range(config.world_size):
        if source.sharding.holding(path, config.coord(r)) is not None:
            shards[r][path] = source.read(source.record(path, r))
    sub = type(source.tree)({path: source.tree[path]}, source.tree.num_layers)
    return assemble(sub, config, shards, padded=False)[path]


@given(st.sampled_from(["mha/legacy", "mha/dist", "opt/legacy", "opt/dist"]),
       st.sampled_from(["megatron-legacy", "megatron-dist", "tenplex"]),
       st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 3]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_conversions_keep_every_global_tensor(sources, opt_source, tmp_path_factory, src, fmt, tp, pp, dp):
    """Any source format to any target format and config: every global tensor (model and optimizer
    state, logical rows) is bit-for-bit the source's, read back through tenplex's readers."""
    from tenplex.formats import write_store
    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    model, kind = src.split("/")
    root = str((sources("mha", 2, 2) if model == "mha" else opt_source) / kind)
    out = str(tmp_path_factory.mktemp("conv") / "out")
    source, to = _open(root), ParallelConfig(dp, tp, pp)
    if fmt == "tenplex":
        write_store(source, out, to)
    else:
        (LEGACY if fmt == "megatron-legacy" else DIST).write(source, out, to)
    back = _open(out)
    assert back.config.tp == tp and back.config.pp == pp
    assert [p for p, _ in back.tree.tensors()] == [p for p, _ in source.tree.tensors()]
    for path, _ in source.tree.tensors():
        assert torch.equal(_global(source, path), _global(back, path)), path


@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 2)])
def test_a_read_error_mid_write_stops_every_writer_and_leaves_nothing(opt_source, tmp_path, tp, pp):
    """Legacy files are written a stage at a time (at tp 2 two sibling files, each leaf built once for
    both): when a source read fails while files are being written, the error reaches the caller
    (every sibling waiting for that build too), no later file starts, and no directory is left."""
    from tenplex.errors import CorruptShardError
    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.formats.legacy import write as legacy_write
    from tenplex_megatron.formats.plugin import LEGACY

    source = _open(str(opt_source / "legacy"))
    reads, real_read = [], source.read

    def failing_read(record, *runs):
        reads.append(record)
        if len(reads) == 40:
            raise CorruptShardError("injected: a bad byte range")
        return real_read(record, *runs)

    source.read = failing_read
    started, real_rank = [], legacy_write._write_rank
    legacy_write._write_rank = lambda *a: started.append(a[8]) or real_rank(*a)
    try:
        with pytest.raises(CorruptShardError, match="injected"):
            LEGACY.write(source, str(tmp_path / "out"), ParallelConfig(tp=tp, pp=pp))
    finally:
        legacy_write._write_rank = real_rank
    assert legacy_write.FILES_AT_ONCE >= 2 and len(started) < 4, started  # later ranks never started
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing left behind


@pytest.mark.slow
def test_api_reshard_of_megatron_to_1024_store_ranks_keeps_open_files_at_the_cap(opt_source, tmp_path,
                                                                                  monkeypatch):
    """``tenplex.reshard`` takes a Megatron checkpoint through the format protocol; a store target of
    1024 ranks is written through the bounded stream, never more than ``max_open_files`` files open
    at once (Megatron's optimizer state is model-space, so the dp replicas share the (tp, pp)
    ranks' files: 4 files, written at most 2 at a time)."""
    import tenplex
    from tenplex.formats.conformance import count_open_store_files, global_tensors
    from tenplex.ptree.config import ParallelConfig
    from tenplex.store.reader import StoreReader

    peak = count_open_store_files(monkeypatch)
    src, out = str(opt_source / "legacy"), str(tmp_path / "wide")
    to = ParallelConfig(dp=256, tp=2, pp=2)
    assert to.world_size == 1024
    report = tenplex.reshard(src, out, to, format="tenplex", max_open_files=2)
    files = len(list((tmp_path / "wide" / "shards").iterdir()))
    assert (report.src_format, report.format, report.files) == ("megatron-legacy", "tenplex", files)
    assert files >= 4 and 1 < peak[0] <= 2, (files, peak[0])
    want, got = global_tensors(_open(src)), global_tensors(StoreReader(out))
    assert list(got) == list(want)
    for path, tensor in want.items():
        assert torch.equal(got[path], tensor), path


@pytest.mark.parametrize("src", ["mha/legacy", "mha/dist", "opt/legacy", "opt/dist"])
def test_a_shared_source_reads_what_the_opened_one_does_without_its_metadata(sources, opt_source, src):
    """Under torchrun process 0 opens a Megatron source and sends it to the others as JSON
    (``share``); ``open_shared`` rebuilds it reading no byte of the checkpoint (no pickle, no
    ``.metadata``, no item header), and every global tensor (model and Adam state: distrib_optim.pt,
    dp_reshardable buffers), every value and the tree are the opened source's."""
    from count_reads import counting
    from tenplex.transform.agree import tree_digest
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    model, kind = src.split("/")
    root = str((sources("mha", 2, 2) if model == "mha" else opt_source) / kind)
    fmt = LEGACY if kind == "legacy" else DIST
    source = fmt.open_source(root)
    shared = json.loads(json.dumps(fmt.share(source), allow_nan=False))  # plain JSON
    with counting(root) as opened:
        back = fmt.open_shared(root, shared)
    assert opened.bytes == 0 and opened.opens == 0 and opened.uncounted == 0
    assert tree_digest(back.tree) == tree_digest(source.tree) and back.config == source.config
    assert back.desc.values == source.desc.values and back.meta == source.meta
    for path, _ in source.tree.tensors():
        a, b = _global(source, path), _global(back, path)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    for path, _ in source.tree.values():
        for key in source.desc.values[path] if path == "megatron/rng_state" else [""]:
            assert back.value(path, key) == source.value(path, key), (path, key)


def _tamper(shared: dict, fmt: str, how: str) -> None:
    """Make one lie in a shared form (``how`` names it)."""
    items = shared["refs"] if fmt == "legacy" else shared["chunks"]
    ref = items[0][-1]
    rel = ref[0]
    if how == "offset past the end":
        ref[1] = shared["files"][rel] - 4
    elif how == "file outside":
        shared["files"]["../../etc/passwd"] = 10
        ref[0] = "../../etc/passwd"
    elif how == "size differs":
        shared["files"][rel] += 1
    elif how == "negative offset":
        ref[1] = -1
    elif how == "unknown dtype":
        ref[3] = "object"
    elif how == "another root":
        shared["meta"]["megatron"]["root"] = "/elsewhere"
    elif how == "wrong shape":
        ref[2] = [ref[2][0] + 1, *ref[2][1:]]
        ref[1] = 0


MESSAGES = {"offset past the end": "past the file", "file outside": "outside the checkpoint|not a relative path",
            "size differs": "process 0 read", "negative offset": "expected a non-negative int",
            "unknown dtype": "not a torch dtype", "another root": "this process reads|outside the checkpoint",
            "wrong shape": "the model gives|outside the tensor's size|elements"}


@pytest.mark.parametrize("how", ["offset past the end", "file outside", "size differs", "negative offset",
                                 "unknown dtype", "another root", "wrong shape"])
@pytest.mark.parametrize("kind", ["legacy", "dist"])
def test_a_shared_source_that_lies_is_refused(sources, kind, how):
    """What arrives from process 0 is checked as untrusted input before any byte is read: every file a
    plain path inside the checkpoint with the size process 0 saw, every tensor inside its file, of a
    known dtype, and of its leaf's local shape (legacy) or tiling its tensor with the other chunks (dist)."""
    from tenplex.errors import ManifestError, PathError
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    root = str(sources("mha", 2, 2) / kind)
    fmt = LEGACY if kind == "legacy" else DIST
    shared = json.loads(json.dumps(fmt.share(fmt.open_source(root))))
    _tamper(shared, kind, how)
    with pytest.raises((ManifestError, PathError), match=MESSAGES[how]):
        fmt.open_shared(root, shared)


def _same_files(a, b) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("src,fmt,to", [
    ("big", "megatron-legacy", "tp=4,pp=1"),
    ("big", "megatron-dist", "tp=4,pp=2"),
    ("opt", "megatron-legacy", "tp=2,pp=1"),  # distrib_optim.pt: flat states, two files at a time
    ("opt", "megatron-dist", "tp=2,pp=1"),  # dp_reshardable buffers
])
def test_a_store_to_megatron_reads_each_needed_byte_once(big, opt_source, tmp_path, monkeypatch, src, fmt, to):
    """The Megatron writers built each target rank's leaves alone: a stored tensor that tp cuts across
    its rows (linear_proj, linear_fc2: a column range of every row) was read and verified once per
    rank, whole checksum blocks each time (tp=8 from a 443 MB store read 1.00 GB). Sibling ranks'
    files are now written at once and each leaf is built once for them: bytes read <= 1.05 x the
    bytes needed (the shard files' bytes, counted at the file level), and the files equal rank-by-rank
    builds, and builds under a tight bound on what siblings keep, byte for byte."""
    from count_reads import counting
    from tenplex_megatron.formats import siblings

    store = tmp_path / "store"
    done = tenplex("reshard", str((big if src == "big" else opt_source) / "legacy"), str(store),
                   "--to", "tp=1,pp=1", "--format", "tenplex")
    assert done.returncode == 0, done.stderr
    with counting(str(store)) as counter:
        done = tenplex("reshard", str(store), str(tmp_path / "out"), "--to", to, "--format", fmt, "--json")
    assert done.returncode == 0, done.stderr
    needed = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])["bytes_needed"]
    assert counter.uncounted == 0 and needed > 0
    read = sum(n for name, n in counter.files.items() if "/shards/" in name)  # not the manifest
    assert read <= 1.05 * needed, (read, needed)
    # every leaf built for its own rank alone; and a bound of 64 KiB: some siblings' parts fit,
    # kept leaves are dropped for newer ones and built again alone
    for limit, name in ((0, "alone"), (64 << 10, "tight")):
        monkeypatch.setattr(siblings, "SHARE_BYTES", limit)
        done = tenplex("reshard", str(store), str(tmp_path / name), "--to", to, "--format", fmt)
        assert done.returncode == 0, done.stderr
        _same_files(tmp_path / "out", tmp_path / name)
