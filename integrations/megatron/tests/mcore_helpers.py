"""Helpers that run real megatron-core (torchrun, gloo, CPU) for the integration tests."""

import os
import pathlib
import subprocess
import sys

import torch

TESTS = pathlib.Path(__file__).parent  # the workers and helpers (tests in subfolders import them from here)
WORKER = TESTS / "mcore_worker.py"

MODELS = {
    # GQA (8 heads, 2 groups) + SwiGLU + rope + untied; vocab 100 needs padding (112 at tp=1, 128 at tp=2, 4)
    "gqa": ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope "
            "--untie --vocab 100 --make-vocab-size-divisible-by 16 --seq 8 --dist-args off"),
    # classic multi-head + GeLU + learned positions + tied embeddings
    "mha": ("--layers 4 --hidden 64 --heads 8 --ffn 128 --position learned_absolute "
            "--vocab 100 --make-vocab-size-divisible-by 16 --seq 8"),
}
# GQA + SwiGLU with per-head query/key norms and a bias on linear_qkv only; RNG states saved in dist
MODELS["qk"] = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope "
                "--untie --vocab 100 --make-vocab-size-divisible-by 16 --seq 8 --qk-layernorm "
                "--add-qkv-bias --save-rng")
MODEL_JSON = {
    "gqa": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
            "ffn_hidden_size": 96, "swiglu": True, "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "vocab_size": 100,
            "make_vocab_size_divisible_by": 16, "add_bias_linear": False, "normalization": "RMSNorm"},
}


def torchrun(worker, n: int, args, timeout: int = 300, python: str = sys.executable) -> str:
    """Run ``worker`` (a worker entry point's path) under ``python``'s torchrun with ``n`` processes;
    its output.

    Raises:
        AssertionError: the worker exited non-zero (its output's tail in the message).
    """
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(worker), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise AssertionError(f"worker failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


def run_worker(tp: int, pp: int, flags: str, *extra: str, dp: int = 1, timeout: int = 300) -> str:
    """Run the worker under torchrun with tp * pp * dp processes; return its output."""
    return torchrun(WORKER, tp * pp * dp, ["--tp", str(tp), "--pp", str(pp), *flags.split(), *extra], timeout)


def rng_lines(output: str) -> dict[tuple[int, int], str]:
    """``{(tp, pp): digest}`` from the worker's ``RNG tp=T pp=P dp=D <digest>`` lines (dp 0)."""
    import re

    # ranks print concurrently, so lines may run together: match the records, not the lines
    found = re.findall(r"RNG tp=(\d+) pp=(\d+) dp=(\d+) ([0-9a-f]{16})", output)
    return {(int(tp), int(pp)): digest for tp, pp, dp, digest in found if dp == "0"}


def losses(output: str) -> list[float]:
    return [float(line.split()[2]) for line in output.splitlines() if line.startswith("LOSS step=")]


def logits(path) -> torch.Tensor:
    return torch.load(path, weights_only=True)["logits"]


def core_torchrun_helpers():
    """The core's ``tests/helpers/torchrun_reshard.py`` as a module (``torchrun``, ``descendants``,
    ``worker_rank``, ``kill_mid_run``): integration tests import ``tests.helpers`` only when the
    repository root is on ``sys.path``, so it is loaded from its file."""
    import importlib.util

    path = TESTS.parents[2] / "tests" / "helpers" / "torchrun_reshard.py"
    spec = importlib.util.spec_from_file_location("torchrun_reshard_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
