"""Megatron state that must come through whole: QK norms, a QKV-only bias, RNG states (real megatron-core)."""

import pytest

from inprocess_cli import tenplex
from mcore_checkpoint import rng_digest
from mcore_helpers import MODELS, logits, rng_lines, run_worker
from tenplex_megatron.model.rng import derive

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def qk_source(tmp_path_factory):
    """megatron-core at tp=2, pp=1 with QK layernorm and add_qkv_bias; dist saved with RNG states."""
    d = tmp_path_factory.mktemp("qk")
    out = run_worker(2, 1, MODELS["qk"], "--save", "both", "--save-dir", str(d), "--logits-out", str(d / "ref.pt"))
    return d, rng_lines(out)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_qk_layernorm_and_qkv_bias_reshard_and_load(qk_source, tmp_path, fmt):
    source, _ = qk_source
    done = tenplex("inspect", str(source / fmt))
    assert done.returncode == 0, done.stderr
    for name in ("self_attention/q_layernorm/weight", "self_attention/k_layernorm/weight",
                 "self_attention/linear_qkv/bias"):
        assert f"model/decoder/layers/3/{name}" in done.stdout
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / fmt), str(out), "--to", "dp=1,tp=1,pp=2")
    assert done.returncode == 0, done.stderr
    got = run_worker(1, 2, MODELS["qk"], "--load", fmt, "--load-dir", str(out), "--load-rng",
                     "--logits-out", str(tmp_path / "got.pt"))
    assert (logits(source / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6
    _check_rng(qk_source[1], rng_lines(got), done.stderr)


def _check_rng(saved: dict, loaded: dict, stderr: str) -> None:
    """(tp 0, pp 0) existed at the source: its state is kept; (tp 0, pp 1) is new: derived from the
    seed for the source's generator kind (CPU here), and megatron-core restored and drew from it."""
    assert set(saved) == {(0, 0), (1, 0)} and set(loaded) == {(0, 0), (0, 1)}
    assert loaded[(0, 0)] == saved[(0, 0)]
    assert loaded[(0, 1)] == rng_digest(derive(1234, 0, 1, kind="cpu"))
    assert "rng: tp=0,pp=1 is a new coordinate" in stderr


@pytest.mark.parametrize("src_fmt", ["legacy", "dist"])
def test_torch_dist_rng_state_is_keyed_by_the_new_grid(qk_source, tmp_path, src_fmt):
    """A torch_dist output holds rng_state/shard_<pp>.<tp>_<PP>.<TP> for the target grid only
    (the direct dist copy re-keys it; the planner path writes it per target coordinate)."""
    from tenplex_megatron.formats.dist.read import describe_dist

    source, _ = qk_source
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / src_fmt), str(out), "--to", "dp=2,tp=1,pp=2", "--format",
                   "megatron-dist")
    assert done.returncode == 0, done.stderr
    keys = sorted(k for k in describe_dist(str(out)).md.state_dict_metadata if k.startswith("rng_state/"))
    assert keys == ["rng_state/shard_0.0_2.1", "rng_state/shard_1.0_2.1"]
