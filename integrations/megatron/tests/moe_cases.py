"""Shared by the real megatron-core MoE tests: the worker launch, the saved sources and the resume check.

The model (``MODEL``): 4 layers, SequentialMLP with 4 experts, top-2 routing,
GQA + SwiGLU, RoPE, untied embeddings. A source is saved by megatron-core
after 2 training steps in both formats (``legacy/``, ``dist/``), with its
logits (``ref.pt``) and 2 more steps (the static run's losses 3 and 4).
The ``torch_dist`` save is Megatron-LM's default, ``--ckpt-fully-parallel-save``:
the data-parallel ranks share the writing of the tensors they replicate, so a
replicated tensor lies in any rank's file (``FullyParallelSaveStrategyWrapper``).
"""

from __future__ import annotations

import os

from mcore_helpers import logits, losses, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "moe_worker.py")
MODEL = ("--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
         "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --experts 4 --topk 2 --batch 4")
FORMATS = {"legacy": "megatron-legacy", "dist": "megatron-dist"}


def run_moe(n: int, flags: str, *extra: str, timeout: int = 300) -> str:
    """Run moe_worker.py under torchrun with ``n`` processes and ``MODEL``; return its output.

    Raises:
        AssertionError: the worker exited non-zero (its output's tail in the message).
    """
    return torchrun(WORKER, n, [*flags.split(), *MODEL.split(), *extra], timeout)


def source_cache(root, save: str = "both"):
    """``get(world, flags)``: a directory under ``root`` with ``legacy/``, ``dist/`` and ``ref.pt`` (with
    ``save="legacy"``: the legacy files themselves and ``ref.pt``), and the static run's 4 losses;
    each (world, flags) is trained and saved once."""
    cache: dict = {}

    def get(n: int, flags: str):
        if (n, flags) not in cache:
            d = root / "_".join(["w" + str(n)] + flags.replace("--", "").split()).replace("[", "").replace("]", "")
            out = run_moe(n, flags, "--train-steps", "2", "--save", save, "--save-dir", str(d),
                          "--fully-parallel-save",
                          "--logits-out", str(d / "ref.pt"), "--train-after-save", "2")
            static = losses(out)
            assert len(static) == 4, out
            cache[(n, flags)] = (d, static)
        return cache[(n, flags)]
    return get


def check_resumed(source, static, tmp_path, n: int, flags: str, fmt: str, out, *extra: str) -> None:
    """megatron-core at the target (``n`` processes, ``flags``) loads ``out`` in format ``fmt``: logits
    within 1e-6 of the source's (a fresh model's are not: the load matters), and 2 more steps within
    1e-6 of the static run (training continuity)."""
    got = run_moe(n, flags, "--load", fmt, "--load-dir", str(out), "--train-steps", "2", *extra,
                  "--loaded-logits-out", str(tmp_path / "got.pt"),
                  "--fresh-logits-out", str(tmp_path / "fresh.pt"))
    ref, loaded, fresh = logits(source / "ref.pt"), logits(tmp_path / "got.pt"), logits(tmp_path / "fresh.pt")
    assert (ref - loaded).abs().max().item() <= 1e-6
    assert (ref - fresh).abs().max().item() > 1e-3, "the load must matter"
    resumed = losses(got)
    assert len(resumed) == 2, got
    assert max(abs(a - b) for a, b in zip(resumed, static[2:])) <= 1e-6, (resumed, static)
