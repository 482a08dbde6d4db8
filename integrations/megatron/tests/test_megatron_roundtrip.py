"""Real megatron-core checkpoints, resharded by the tenplex CLI, loaded by megatron-core again."""

import pytest
import torch

from mcore_helpers import MODELS, logits, run_worker, tenplex

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PAIRS = [((2, 1), (1, 2)), ((2, 2), (4, 1)), ((1, 4), (2, 2))]
CASES = [(m, f, a, b) for m in MODELS for f in ("legacy", "dist") for a, b in PAIRS
         if not (m == "gqa" and b[0] == 4)]  # tp=4 cannot split 2 query groups: see the error test


@pytest.mark.parametrize("model,fmt,src,dst", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_reshard_loads_in_megatron_with_the_same_logits(sources, model_config_file, tmp_path,
                                                          model, fmt, src, dst):
    source = sources(model, *src)
    out = tmp_path / "out"
    options = ["--model-config", str(model_config_file)] if model == "gqa" else []
    done = tenplex(*options, "reshard", str(source / fmt), str(out), "--to", f"dp=1,tp={dst[0]},pp={dst[1]}")
    assert done.returncode == 0, done.stderr
    assert "resharded" in done.stdout
    if src[0] != dst[0]:  # vocab 100 pads to 112 at tp=1 and 128 at tp=2, 4
        assert ("padding:" in done.stderr) == ((src[0] == 1) != (dst[0] == 1))
    # megatron-core at the target loads it with strict=True, and its logits match
    run_worker(*dst, MODELS[model], "--load", fmt, "--load-dir", str(out),
               "--logits-out", str(tmp_path / "got.pt"), "--fresh-logits-out", str(tmp_path / "fresh.pt"))
    ref, got, fresh = logits(source / "ref.pt"), logits(tmp_path / "got.pt"), logits(tmp_path / "fresh.pt")
    if src[0] == dst[0]:
        assert torch.equal(ref, got)
    else:  # fp32 reduction order changes with tp
        assert (ref - got).abs().max().item() <= 1e-6
    assert (ref - fresh).abs().max().item() > 1e-3, "the load must matter"


def test_impossible_target_is_refused_with_no_output(sources, model_config_file, tmp_path):
    source = sources("gqa", 2, 2)
    for fmt in ("legacy", "dist"):
        done = tenplex("--model-config", str(model_config_file), "reshard", str(source / fmt),
                       str(tmp_path / fmt), "--to", "tp=4")
        assert done.returncode == 1
        assert done.stderr.strip().endswith(
            "tp=4 does not divide num_query_groups=2 (model/decoder/layers/0/self_attention/linear_qkv/weight)")
        assert not (tmp_path / fmt).exists()
    done = tenplex("reshard", str(source / "legacy"), str(tmp_path / "pp3"), "--to", "pp=3")
    assert done.returncode == 1 and "pp=3 does not divide num_layers=4" in done.stderr
    assert not (tmp_path / "pp3").exists()
