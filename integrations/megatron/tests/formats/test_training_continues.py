"""Training continues after a reshard: the next two losses equal the source job's."""

import pytest

from inprocess_cli import tenplex
from mcore_helpers import losses, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# vocab 128 with divisible-by 16 pads to 128 at every tp: Megatron's cross-entropy runs over the
# padded vocabulary, so a padding change would change the loss (see docs/megatron.md)
FLAGS = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope "
         "--untie --vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --train-steps 2 --dist-opt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``get(sharding)``: ``(directory, losses)``: megatron-core at tp=2, pp=1 after two Adam steps,
    saved as ``legacy/`` and as ``dist/`` with ``sharding``; then the same run takes two more steps
    (the job that was not interrupted) and ``losses`` are theirs."""
    cache: dict = {}

    def get(sharding: str):
        if sharding not in cache:
            d = tmp_path_factory.mktemp(sharding)
            got = losses(run_worker(2, 1, FLAGS, "--sharding-type", sharding, "--save", "both",
                                    "--save-dir", str(d), "--train-after-save", "2"))
            assert len(got) == 4, got
            cache[sharding] = d, got[2:]
        return cache[sharding]
    return get


@pytest.mark.parametrize("fmt,sharding", [("dist", "fully_reshardable"), ("dist", "dp_reshardable"),
                                          ("legacy", None)])
def test_two_more_steps_match_after_reshard(trained, tmp_path, fmt, sharding):
    src, expected = trained(sharding or "fully_reshardable")  # the worker's default sharding type
    done = tenplex("reshard", str(src / fmt), str(tmp_path / "dst"), "--to", "dp=2,tp=1,pp=2")
    assert done.returncode == 0, done.stderr
    got = losses(run_worker(1, 2, FLAGS, "--load", fmt, "--load-dir", str(tmp_path / "dst"), dp=2))
    assert len(expected) == len(got) == 2
    for e, g in zip(expected, got):
        assert abs(e - g) <= 1e-6, (expected, got)


def test_bf16_two_more_steps_match_after_reshard(tmp_path):
    """bf16 params with fp32 main params: megatron-core keys the distributed optimizer's buffers by
    (param_dtype, grad_dtype) = (bfloat16, float32). Both distrib_optim.pt and dp_reshardable are
    resharded to another pp (bf16 arithmetic is then the same) and loaded by megatron-core; the next
    two losses equal those of the run that saved it, going on uninterrupted."""
    from tenplex_megatron.formats.dist.read import describe_dist
    from tenplex_megatron.formats.legacy.read import describe_legacy

    flags = FLAGS + " --bf16"
    src = tmp_path / "src"
    expected = losses(run_worker(2, 1, flags, "--sharding-type", "dp_reshardable", "--save", "both",
                                 "--save-dir", str(src), "--train-after-save", "2"))[2:]
    assert describe_legacy(str(src / "legacy")).desc.meta["megatron"]["buffer_dtypes"] == \
        ["torch.bfloat16", "torch.float32"]
    for fmt in ("legacy", "dist"):
        dst = tmp_path / f"dst-{fmt}"
        done = tenplex("reshard", str(src / fmt), str(dst), "--to", "dp=1,tp=2,pp=2")
        assert done.returncode == 0, done.stderr
        if fmt == "dist":
            keys = describe_dist(str(dst)).md.state_dict_metadata
            assert any("dtype_(torch.bfloat16, torch.float32)" in k for k in keys)
        got = losses(run_worker(2, 2, flags, "--load", fmt, "--load-dir", str(dst)))
        assert len(expected) == len(got) == 2
        for e, g in zip(expected, got):
            assert abs(e - g) <= 1e-6, (fmt, expected, got)


def test_bf16_non_distributed_adam_two_more_steps_match_after_reshard(tmp_path):
    """bf16 params with a non-distributed Adam (``Float16OptimizerWithFloat16Params``), saved in both
    formats: legacy keeps moments and ``fp32_from_fp16_params`` in ``model_optim_rng.pt``; torch_dist
    (Megatron-LM's default ``--ckpt-format``) keeps them as ``optimizer.state.{exp_avg,exp_avg_sq,
    fp32_param}.*`` tensors and the groups under ``common.pt``'s ``optimizer.optimizer``. Each is
    resharded to tp 2, pp 2 (legacy: two sibling files per stage written at once, the optimizer tensors
    streamed in the order the pickle meets them; dist to dist: items copied directly; legacy to dist);
    megatron-core loads every result and the next two losses equal the uninterrupted run's.
    The torch_dist source was refused before (``unknown key optimizer.state.fp32_param...``)."""
    flags = FLAGS.replace(" --dist-opt", "") + " --bf16"
    src = tmp_path / "src"
    expected = losses(run_worker(2, 1, flags, "--save", "both", "--save-dir", str(src), "--dist-layout", "megatron",
                                 "--train-after-save", "2"))[2:]
    # dist -> legacy: test_dist_bf16_adam.py (through legacy and back, bit for bit)
    for src_fmt, dst_fmt in [("legacy", "legacy"), ("dist", "dist"), ("legacy", "dist")]:
        dst = tmp_path / f"{src_fmt}-to-{dst_fmt}"
        done = tenplex("reshard", str(src / src_fmt), str(dst), "--to", "dp=1,tp=2,pp=2",
                       "--format", f"megatron-{dst_fmt}")
        assert done.returncode == 0, done.stderr
        got = losses(run_worker(2, 2, flags, "--load", dst_fmt, "--load-dir", str(dst)))
        assert len(expected) == len(got) == 2
        for e, g in zip(expected, got):
            assert abs(e - g) <= 1e-6, (src_fmt, dst_fmt, expected, got)


def _grad_scalers(root) -> list:
    """The grad scaler state of every rank file (legacy) or of ``common.pt`` (torch_dist) under ``root``."""
    import argparse

    import torch

    files = sorted(root.glob("**/model_optim_rng.pt")) or sorted(root.glob("**/common.pt"))
    with torch.serialization.safe_globals([argparse.Namespace]):  # written by megatron-core or tenplex here
        return [torch.load(f, weights_only=False)["optimizer"]["grad_scaler"] for f in files]


@pytest.mark.parametrize("dist_opt", [False, True], ids=["adam", "distributed-optimizer"])
def test_fp16_two_more_steps_match_after_reshard(tmp_path, dist_opt):
    """fp16 params with megatron-core's dynamic loss scaler, whose state (``scale``, a tensor, and the
    growth and hysteresis trackers) sits beside the optimizer: in every ``model_optim_rng.pt`` and in
    ``common.pt``. Resharded across formats to tp 2, pp 2, the scaler is the source's in every target
    file and megatron-core's next two losses equal the uninterrupted run's. Legacy fp16 checkpoints
    were refused before (``grad_scaler.'scale': a TensorRef cannot be kept as JSON``)."""
    import torch

    flags = FLAGS.replace(" --dist-opt", " --dist-opt" if dist_opt else "") + " --fp16"
    src = tmp_path / "src"
    expected = losses(run_worker(2, 1, flags, "--save", "both", "--save-dir", str(src), "--dist-layout", "megatron",
                                 "--train-after-save", "2"))[2:]
    want = _grad_scalers(src / "legacy")[0]
    assert want["scale"].numel() == 1 and _grad_scalers(src / "dist") == [want]
    for src_fmt, dst_fmt in [("legacy", "dist"), ("dist", "legacy")]:
        dst = tmp_path / f"{src_fmt}-to-{dst_fmt}"
        done = tenplex("reshard", str(src / src_fmt), str(dst), "--to", "dp=1,tp=2,pp=2",
                       "--format", f"megatron-{dst_fmt}")
        assert done.returncode == 0, done.stderr
        got_scalers = _grad_scalers(dst)
        assert len(got_scalers) == (1 if dst_fmt == "dist" else 4)
        for s in got_scalers:
            assert set(s) == set(want) and torch.equal(s["scale"], want["scale"]), (s, want)
            assert all(s[k] == want[k] for k in want if k != "scale"), (s, want)
        got = losses(run_worker(2, 2, flags, "--load", dst_fmt, "--load-dir", str(dst)))
        assert len(expected) == len(got) == 2
        for e, g in zip(expected, got):
            assert abs(e - g) <= 1e-6, (src_fmt, dst_fmt, expected, got)
