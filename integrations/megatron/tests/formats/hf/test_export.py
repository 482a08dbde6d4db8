"""Megatron checkpoints made by real megatron-core, exported to Hugging Face and loaded by transformers.

Each source is saved by megatron-core (hf_worker.py) in both formats; the
export runs through the CLI (``tenplex reshard SRC DST --format hf``);
``transformers.AutoModelForCausalLM.from_pretrained`` must load the result
and give megatron-core's logits on the same tokens within 1e-5 (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hf_cases import FORMATS, export, hf_logits, reference

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5


@pytest.mark.parametrize("n,parallel", [(4, "--tp 2 --pp 2"), (2, "--pp 2 --vpp 2")], ids=["tp2pp2", "pp2vpp2"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_llama_export_loads_in_transformers(hf_sources, tmp_path, n, parallel, fmt):
    src = hf_sources("llama", n, parallel)
    out = tmp_path / "hf"
    done = export(src / fmt, out)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "optimizer state" in line]
    assert len(said) == 1 and "not exported" in said[0], done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rms_norm_eps"] == 1e-5
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00001.safetensors"]
    with safe_open(str(out / files[0]), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").shape == (100, 64)  # padding (112) dropped
    ref, tokens = reference(src)
    assert (hf_logits(out, tokens) - ref).abs().max().item() <= TOL


def test_export_in_several_shards(hf_sources, tmp_path):
    src = hf_sources("llama", 4, "--tp 2 --pp 2")
    out = tmp_path / "hf"
    done = export(src / "dist", out, "--max-shard-size", "100000")
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((out / f).stat().st_size <= 100_000 + 20_000 for f in files)
    ref, tokens = reference(src)
    assert (hf_logits(out, tokens) - ref).abs().max().item() <= TOL


def test_a_feature_no_family_covers_is_refused_in_one_line(sources, tmp_path):
    src = sources("mha", 1, 1)  # megatron-core GPT with LayerNorm, GeLU and learned positions
    done = export(src / "legacy", tmp_path / "hf")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "tenplex reshard: cannot export to Hugging Face: the checkpoint has a non-gated MLP (swiglu off), "
        "which no family (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe) expresses with its other features")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.tenplex-partial-*"))


def test_float32_from_a_bf16_checkpoint_exports_the_main_params(tmp_path):
    from mcore_helpers import MODELS, run_worker
    from safetensors import safe_open as st_open

    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.formats.hf.plugin import HF
    from tenplex_megatron.formats.plugin import LEGACY
    from tenplex_megatron.formats.target import TargetBuilder

    src = tmp_path / "bf16"
    run_worker(2, 1, MODELS["gqa"], "--bf16", "--dist-opt", "--train-steps", "1", "--save", "legacy",
               "--save-dir", str(src))
    HF.write(LEGACY.open_source(str(src)), str(tmp_path / "f32"), None, dtype="float32")
    HF.write(LEGACY.open_source(str(src)), str(tmp_path / "bf"), None)
    leaf = "decoder/layers/1/mlp/linear_fc2/weight"
    with TargetBuilder(LEGACY.open_source(str(src)), ParallelConfig()) as b:
        main, param = b.leaf("optimizer/param/" + leaf, 0), b.leaf("model/" + leaf, 0)
    with st_open(str(tmp_path / "f32" / "model-00001-of-00001.safetensors"), "pt") as f32, \
            st_open(str(tmp_path / "bf" / "model-00001-of-00001.safetensors"), "pt") as bf:
        got, kept = f32.get_tensor("model.layers.1.mlp.down_proj.weight"), bf.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert got.dtype == main.dtype == torch.float32 and torch.equal(got, main)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, param)
    assert not torch.equal(got, param.float()), "the main params must not be the upcast bf16 weights"
