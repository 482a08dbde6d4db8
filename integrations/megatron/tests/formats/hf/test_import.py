"""Hugging Face models made by transformers (``save_pretrained``), imported into Megatron checkpoints
that megatron-core loads strictly at the target config, with transformers' logits within 1e-5."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from hf_cases import hf_logits, run_worker
from inprocess_cli import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5
COMMON = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=8, tie_word_embeddings=False)
MODELS = {
    # name: (transformers config class, its extra fields, hf_worker flags of the same model)
    "llama": ("LlamaConfig", dict(intermediate_size=96, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
              "--ffn 96 --eps 1e-6 --rotary-base 500000"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=False, head_dim=8, rms_norm_eps=1e-6,
                                         rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
                  "--ffn 48 --experts 4 --topk 2 --moe-ffn 48 --qk-layernorm --pre-softmax --eps 1e-6 "
                  "--rotary-base 1000000"),
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                      rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1000000.0,
                                                                          "rope_type": "default"}),
                "--ffn 48 --experts 4 --topk 2 --moe-ffn 48 --eps 1e-5 --rotary-base 1000000"),
    "mistral": ("MistralConfig", dict(intermediate_size=96, rms_norm_eps=1e-6, sliding_window=None,
                                      rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
                "--ffn 96 --eps 1e-6 --rotary-base 1000000"),
    "qwen2": ("Qwen2Config", dict(intermediate_size=96, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
              "--ffn 96 --add-qkv-bias --eps 1e-6 --rotary-base 1000000"),
}
WORKER = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --swiglu --position rope --untie --vocab 100 "
          "--make-vocab-size-divisible-by 128 --seq 8")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    import transformers

    root, made = tmp_path_factory.mktemp("hf_models"), {}

    def get(name):
        if name not in made:
            cls, extra, _ = MODELS[name]
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **extra))
            with torch.no_grad():  # transformers starts biases at 0 and norms at 1: draw them apart
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.1)
            model.save_pretrained(str(root / name))
            made[name] = root / name
        return made[name]
    return get


@pytest.mark.parametrize("name,n,to,fmt", [
    ("llama", 4, "tp=2,pp=2", "megatron-dist"),
    ("qwen2", 4, "tp=2,pp=2", "megatron-legacy"),  # qkv bias
    ("mistral", 2, "tp=2", "megatron-dist"),
    ("qwen3_moe", 2, "dp=2,ep=2", "megatron-dist"),
    ("mixtral", 2, "dp=2,ep=2", "megatron-legacy"),
])
def test_import_loads_in_megatron_core(hf_models, tmp_path, name, n, to, fmt):
    src = hf_models(name)
    out = tmp_path / "megatron"
    done = run_cli(["reshard", str(src), str(out), "--to", to, "--format", fmt])
    assert done.returncode == 0, done.stderr
    parallel = " ".join(f"--{k} {v}" for k, v in (kv.split("=") for kv in to.split(",")) if k != "dp")
    run_worker(n, f"{parallel} {WORKER} {MODELS[name][2]}", "--load", fmt.removeprefix("megatron-"),
               "--load-dir", str(out), "--logits-out", str(tmp_path / "got.pt"),
               "--tokens-out", str(tmp_path / "tok.pt"))
    got = torch.load(tmp_path / "got.pt")["logits"]
    tokens = torch.load(tmp_path / "tok.pt")["tokens"]
    ref = hf_logits(src, tokens)
    assert (got - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 1e-3, "the logits must not be trivially zero"


def test_import_to_a_tenplex_store_and_back_is_bit_exact(hf_models, tmp_path):
    src = hf_models("qwen3_moe")
    done = run_cli(["reshard", str(src), str(tmp_path / "store"), "--to", "dp=2,tp=2,ep=2", "--format", "tenplex"])
    assert done.returncode == 0, done.stderr
    done = run_cli(["reshard", str(tmp_path / "store"), str(tmp_path / "back"), "--to", "dp=1", "--format", "hf"])
    assert done.returncode == 0, done.stderr
    with safe_open(str(src / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "back" / "model-00001-of-00001.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_inspect_and_verify_read_an_hf_directory(hf_models):
    import json

    src = hf_models("llama")
    done = run_cli(["inspect", str(src), "--json"])
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["format"] == "hf" and got["num_layers"] == 4 and got["config"]["tp"] == 1
    assert any(r["path"] == "model/decoder/layers/3/self_attention/linear_qkv/weight" and r["shape"] == [96, 64]
               for r in got["leaves"])
    done = run_cli(["verify", str(src)])
    assert done.returncode == 0 and "OK (hf)" in done.stdout, done.stderr
