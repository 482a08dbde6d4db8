"""Shared by the Hugging Face tests: real megatron-core sources (hf_worker.py), the CLI with the ``hf``
format, and transformers' logits on the worker's tokens."""

from __future__ import annotations

import os

import torch

from inprocess_cli import run_cli
from mcore_helpers import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")
BASE = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope "
        "--vocab 100 --make-vocab-size-divisible-by 16 --seq 8")
MODELS = {
    # Llama: GQA, SwiGLU, RMSNorm, rope base 5e5, Megatron's eps 1e-5 (HF's default is 1e-6), untied
    "llama": BASE + " --untie --eps 1e-5 --rotary-base 500000",
    # Qwen2: qkv bias, interleaved rope, llama3 scaling; d = 16, 64 tokens so that scaling shows
    "qwen2": ("--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --vocab 100 "
              "--make-vocab-size-divisible-by 16 --seq 64 --untie --add-qkv-bias --rotary-interleaved "
              "--rotary-base 1000000 --rope-scaling 32 --eps 1e-6"),
    # Qwen3: q/k layernorm, tied embeddings
    "qwen3": BASE + " --qk-layernorm --eps 1e-6 --rotary-base 1000000",
    # Mixtral: 4 experts, top-2, Megatron's default router (top-k, then softmax over them)
    "mixtral": BASE + " --untie --experts 4 --topk 2 --moe-ffn 48 --eps 1e-5 --rotary-base 1000000 --distinct-experts",
    # Qwen3-MoE: q/k layernorm, softmax before top-k (norm_topk_prob false)
    "qwen3_moe": BASE + " --untie --experts 4 --topk 2 --moe-ffn 48 --qk-layernorm --pre-softmax --eps 1e-6 "
                 "--distinct-experts",
}
FORMATS = {"legacy": "megatron-legacy", "dist": "megatron-dist"}


def run_worker(n: int, flags: str, *extra: str, timeout: int = 400) -> str:
    """hf_worker.py under torchrun with ``n`` processes.

    Raises:
        AssertionError: the worker failed (its output's tail in the message).
    """
    return torchrun(WORKER, n, [*flags.split(), *extra], timeout)


def source_cache(root):
    """``get(model, n, parallel)``: a directory with ``legacy/``, ``dist/``, ``ref.pt`` and ``tok.pt``,
    saved once per (model, n, parallel flags) by megatron-core."""
    cache: dict = {}

    def get(model: str, n: int, parallel: str):
        key = (model, n, parallel)
        if key not in cache:
            d = root / f"{model}_{n}_{parallel.replace('--', '').replace(' ', '')}"
            run_worker(n, f"{parallel} {MODELS[model]}", "--save", "both", "--save-dir", str(d),
                       "--logits-out", str(d / "ref.pt"), "--tokens-out", str(d / "tok.pt"))
            cache[key] = d
        return cache[key]
    return get


def export(src, dst, *extra: str):
    """``tenplex reshard SRC DST --format hf`` in-process; the completed run."""
    return run_cli(["reshard", str(src), str(dst), "--format", "hf", *extra])


def hf_logits(model_dir, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits ``[batch, seq, vocab]`` of ``AutoModelForCausalLM.from_pretrained``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def reference(source):
    """megatron-core's logits and their input tokens, as the worker wrote them."""
    return torch.load(source / "ref.pt")["logits"], torch.load(source / "tok.pt")["tokens"]
