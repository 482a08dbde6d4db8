"""Model directories whose weights are ``pytorch_model.bin``, or none that tenplex reads.

transformers wrote ``pytorch_model.bin`` (``torch.save`` of the state dict; sharded: ``pytorch_model-
0000i-of-0000N.bin`` with ``pytorch_model.bin.index.json``) before safetensors became its default
(v4.35), and many Hub models still have only that. transformers 5 writes safetensors only, so the
files here are made as transformers 4 made them: ``torch.save`` of a real model's ``state_dict()``
(an ``OrderedDict``; with tied embeddings, ``lm_head.weight`` and ``model.embed_tokens.weight``
share one storage). tenplex reads them through its restricted unpickler, and the import equals the
import of the same model's safetensors directory bit for bit. A pickle that would run code, tensors
that partly share bytes, and a directory with no weights tenplex reads are refused, each named.
(On the old code every ``.bin`` directory was "not a checkpoint of any known format".)
"""

import json

import pytest
import torch

from inprocess_cli import run_cli
from tenplex.api import load_global


def _model(root, tied: bool):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(root / "safetensors"))
    return model


def _import(src, out) -> dict:
    done = run_cli(["reshard", str(src), str(out), "--to", "tp=1", "--format", "tenplex"])
    assert done.returncode == 0, done.stderr
    return load_global(str(out))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("tied", [False, True])
def test_pytorch_model_bin_imports_as_its_safetensors_twin(tmp_path, tied):
    model = _model(tmp_path, tied)
    state = model.state_dict()
    single = tmp_path / "bin"
    single.mkdir()
    (single / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
    torch.save(state, single / "pytorch_model.bin")  # transformers 4's save_pretrained(safe_serialization=False)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((single / "config.json").read_bytes())
    layers = [n for n in state if ".layers." in n]  # the tied pair in one file, whose pickle keeps it shared
    weight_map = {}
    for i, part in enumerate((layers, [n for n in state if n not in layers])):
        file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: state[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = _import(tmp_path / "safetensors", tmp_path / "from-safetensors")
    assert _same(_import(single, tmp_path / "from-bin"), want)
    assert _same(_import(sharded, tmp_path / "from-sharded"), want)
    assert run_cli(["verify", str(single)]).returncode == 0


def _with_inv_freq(tmp_path):
    """A ``.bin`` directory of the real model with what ``LlamaRotaryEmbedding`` registered before
    transformers v4.31 (``1 / theta^(2j / head_dim)``, per layer)."""
    model = _model(tmp_path, False)
    state = dict(model.state_dict())
    head_dim = 32 // 4
    for i in range(2):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = \
            1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
    torch.save(state, old / "pytorch_model.bin")
    return old


NOTE = "note: ignored 2 rotary_emb.inv_freq buffers"


def test_rotary_inv_freq_buffers_of_old_checkpoints_are_ignored_with_a_note(tmp_path):
    """transformers before v4.31 kept each layer's ``rotary_emb.inv_freq`` in the state dict (a
    persistent buffer, float32 ``[head_dim / 2]``), so checkpoints of that time hold them; transformers
    ignores them on load. tenplex does too, and says so, whatever the target format (on the old code:
    "has no place"; before a640f51 a tenplex target did not say so)."""
    old = _with_inv_freq(tmp_path)
    for fmt in ("megatron-dist", "tenplex"):
        done = run_cli(["reshard", str(old), str(tmp_path / fmt), "--to", "tp=2", "--format", fmt])
        assert done.returncode == 0 and NOTE in done.stderr, done.stderr
    assert _same(_import(old, tmp_path / "from-old"), _import(tmp_path / "safetensors", tmp_path / "from-new"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_note_is_reported_under_torchrun(tmp_path):
    """Two processes resharding to a tenplex store report the source's notes as one process does."""
    import os
    import subprocess
    import sys

    old = _with_inv_freq(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.5", "-m", "tenplex", "reshard", str(old), str(tmp_path / "store"),
           "--to", "dp=2", "--format", "tenplex", "--json"]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert any(n.startswith(NOTE.removeprefix("note: ")) for n in report["notes"]), report
    assert len(report["processes"]) == 2


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    _model(tmp_path, False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
    torch.save({"model.norm.weight": torch.ones(32), "x": Payload()}, bad / "pytorch_model.bin")
    done = run_cli(["inspect", str(bad)])
    assert done.returncode == 1 and "io.open" in done.stderr and "allow-list" in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


def test_tensors_that_partly_share_bytes_are_refused(tmp_path):
    model = _model(tmp_path, False)
    state = dict(model.state_dict())
    base = torch.arange(64 * 32, dtype=torch.float32)
    state["model.embed_tokens.weight"] = base[:64 * 32].view(64, 32)
    state["lm_head.weight"] = base[32:].view(-1)[:63 * 32].view(63, 32)  # one row off: overlaps, not equal
    lying = tmp_path / "lying"
    lying.mkdir()
    (lying / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
    torch.save(state, lying / "pytorch_model.bin")
    done = run_cli(["inspect", str(lying)])
    assert done.returncode == 1 and "share bytes" in done.stderr, done.stderr


def test_a_directory_without_weights_tenplex_reads_is_named(tmp_path):
    _model(tmp_path, False)
    for name, tail in (("bare", "found 'config.json'"),
                       ("tf", "'tf_model.h5'; its weights are TensorFlow weights, which the hf format does not read")):
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
        if name == "tf":
            (src / "tf_model.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
        for args in (["inspect", str(src)], ["reshard", str(src), str(tmp_path / "out"), "--to", "tp=2",
                                            "--format", "megatron-dist"]):
            done = run_cli(args)
            assert done.returncode == 1, (args, done.stderr)
            assert "a Hugging Face model directory (config.json) without weights tenplex reads: expected " \
                   "model.safetensors, model.safetensors.index.json, pytorch_model.bin or " \
                   "pytorch_model.bin.index.json" in done.stderr and tail in done.stderr, (args, done.stderr)
            assert not (tmp_path / "out").exists()


def _hub_cache(tmp_path, model_dir, links=None):
    """``model_dir`` laid out as huggingface_hub's cache keeps it (its "Manage the cache" guide):
    ``models--<org>--<name>/snapshots/<revision>/<file>`` -> ``../../blobs/<hash>``; ``links`` overrides
    some files' link targets. Returns the snapshot folder, which is what users name."""
    import hashlib
    import os
    import shutil

    repo = tmp_path / "cache" / "models--org--llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        os.symlink((links or {}).get(f.name, f"../../blobs/{blob}"), snapshot / f.name)
    return snapshot


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_a_hub_cache_snapshot_is_read_and_links_elsewhere_are_refused(tmp_path, weights):
    """``snapshot_download`` and transformers' cache give a snapshot folder of symlinks into the
    model's ``blobs``: read like the plain folder (on the old code: "resolves to .../blobs/..., outside
    the checkpoint directory"). A link anywhere else is refused as before, naming both places."""
    model = _model(tmp_path, False)
    plain = tmp_path / "safetensors"
    if weights == "bin":
        plain = tmp_path / "bin"
        plain.mkdir()
        (plain / "config.json").write_bytes((tmp_path / "safetensors" / "config.json").read_bytes())
        torch.save(model.state_dict(), plain / "pytorch_model.bin")
    snapshot = _hub_cache(tmp_path, plain)
    assert _same(_import(snapshot, tmp_path / "from-cache"), _import(plain, tmp_path / "from-plain"))
    done = run_cli(["inspect", str(snapshot.parent.parent)])  # the model's cache folder: which snapshot
    assert done.returncode == 1 and "a Hugging Face hub cache folder; name one of its snapshot folders" in \
        done.stderr and snapshot.name in done.stderr, done.stderr
    assert run_cli(["verify", str(snapshot)]).returncode == 0
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    outside = _hub_cache(tmp_path / "other", plain, links={"config.json": str(secret)})
    done = run_cli(["reshard", str(outside), str(tmp_path / "out"), "--to", "tp=1", "--format", "tenplex"])
    assert done.returncode == 1 and "outside the model directory" in done.stderr \
        and "and its hub cache's" in done.stderr and "secret.json" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
