"""Real megatron-core checkpoints, resharded by the tenplex CLI, loaded by megatron-core again."""

import pytest
import torch

from inprocess_cli import tenplex
from mcore_helpers import MODELS, logits, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PAIRS = [((2, 1), (1, 2)), ((2, 2), (4, 1)), ((1, 4), (2, 2))]
CASES = [(m, f, a, b) for m in ("gqa", "mha") for f in ("legacy", "dist") for a, b in PAIRS
         if not (m == "gqa" and b[0] == 4)]  # tp=4 cannot split 2 query groups: see the error test


@pytest.fixture(scope="module")
def resharded(sources, model_config_file, tmp_path_factory):
    """``get(model, src, dst)``: ``{fmt: (CLI result, fresh logits, loaded logits)}`` for both formats.

    Both of the source's formats are resharded to ``dst`` by the CLI; one megatron-core run at
    ``dst`` then builds a fresh model from the seed, writes its logits, loads the output with
    strict=True and writes the logits again, once per format (a run costs seconds of start-up,
    the loads milliseconds; each load starts from a freshly built model).
    """
    cache: dict = {}

    def get(model: str, src: tuple, dst: tuple) -> dict:
        if (model, src, dst) not in cache:
            source, d = sources(model, *src), tmp_path_factory.mktemp(f"{model}-{src}-{dst}".replace(" ", ""))
            options = ["--model-config", str(model_config_file)] if model == "gqa" else []
            runs, loads = {}, []
            for fmt in ("legacy", "dist"):
                done = tenplex(*options, "reshard", str(source / fmt), str(d / fmt), "--to",
                               f"dp=1,tp={dst[0]},pp={dst[1]}")
                runs[fmt] = (done, d / f"fresh-{fmt}.pt", d / f"got-{fmt}.pt")
                if done.returncode == 0:
                    loads += ["--also-load", fmt, str(d / fmt), *map(str, runs[fmt][1:])]
            if loads:
                run_worker(*dst, MODELS[model], *loads)
            cache[(model, src, dst)] = runs
        return cache[(model, src, dst)]
    return get


@pytest.mark.parametrize("model,fmt,src,dst", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_reshard_loads_in_megatron_with_the_same_logits(sources, resharded, model, fmt, src, dst):
    done, fresh_path, got_path = resharded(model, src, dst)[fmt]
    assert done.returncode == 0, done.stderr
    assert "resharded" in done.stdout
    if src[0] != dst[0]:  # vocab 100 pads to 112 at tp=1 and 128 at tp=2, 4
        assert ("padding:" in done.stderr) == ((src[0] == 1) != (dst[0] == 1))
    # megatron-core at the target loads it with strict=True, and its logits match
    ref, got, fresh = logits(sources(model, *src) / "ref.pt"), logits(got_path), logits(fresh_path)
    if src[0] == dst[0]:
        assert torch.equal(ref, got)
    else:  # fp32 reduction order changes with tp
        assert (ref - got).abs().max().item() <= 1e-6
    assert (ref - fresh).abs().max().item() > 1e-3, "the load must matter"


def test_impossible_target_is_refused_with_no_output(sources, model_config_file, tmp_path):
    source = sources("gqa", 2, 2)
    for fmt in ("legacy", "dist"):
        done = tenplex("--model-config", str(model_config_file), "reshard", str(source / fmt),
                       str(tmp_path / fmt), "--to", "tp=3")  # tp=4 runs: megatron-core splits groups
        assert done.returncode == 1
        assert done.stderr.strip().endswith(
            "tp=3 does not divide num_attention_heads=8 (model/decoder/layers/0/self_attention/linear_proj/weight)")
        assert not (tmp_path / fmt).exists()
    done = tenplex("reshard", str(source / "legacy"), str(tmp_path / "pp3"), "--to", "pp=3")
    assert done.returncode == 1 and "pp=3 does not divide num_layers=4" in done.stderr
    assert not (tmp_path / "pp3").exists()


def test_missing_rank_directory_is_reported(sources, model_config_file, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(sources("gqa", 2, 1) / "legacy", broken)
    shutil.rmtree(broken / "iter_0000010" / "mp_rank_01")
    done = tenplex("reshard", str(broken), str(tmp_path / "out"), "--to", "tp=1")
    assert done.returncode == 1
    assert "mp_rank_01 is missing (expected tp=2 x pp=1 rank directories)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_legacy_megatron_lm_names_are_read(sources, tmp_path):
    """Rename a real checkpoint's keys to Megatron-LM's legacy model names; it reshards the same."""
    import shutil
    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.model.layouts import rank_keys

    source = sources("mha", 2, 1)
    legacy = tmp_path / "legacy-names"
    shutil.copytree(source / "legacy", legacy)
    for t in range(2):
        path = legacy / "iter_0000010" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        cfg = MegatronConfig.from_args(state["args"])
        renamed = {}
        for keys in rank_keys(cfg, ParallelConfig(tp=2), 0).values():
            renamed[keys[1]] = state["model"][keys[0]]
        assert any(k.startswith("language_model.encoder.layers.0.self_attention.query_key_value") for k in renamed)
        state["model"] = renamed
        torch.save(state, path)
    done = tenplex("reshard", str(legacy), str(tmp_path / "out"), "--to", "dp=1,tp=1,pp=2")
    assert done.returncode == 0, done.stderr
    run_worker(1, 2, MODELS["mha"], "--load", "legacy", "--load-dir", str(tmp_path / "out"),
               "--logits-out", str(tmp_path / "got.pt"))
    assert (logits(source / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6


def test_inspect_plan_and_format_conversions(sources, tmp_path):
    """inspect and plan auto-detect Megatron; --format converts to a tenplex store and back."""
    import json

    source = sources("mha", 2, 1)
    done = tenplex("inspect", str(source / "legacy"), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["format"] == "megatron-legacy" and info["config"]["tp"] == 2
    assert any(leaf["path"] == "model/decoder/layers/3/self_attention/linear_qkv/weight" for leaf in info["leaves"])
    done = tenplex("plan", str(source / "dist"), "--to", "tp=1,pp=2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lower_bound"] > 0
    store = tmp_path / "store"
    done = tenplex("reshard", str(source / "legacy"), str(store), "--to", "tp=2", "--format", "tenplex")
    assert done.returncode == 0 and (store / "manifest.json").exists(), done.stderr
    assert tenplex("verify", str(store)).returncode == 0
    back = tmp_path / "legacy"
    done = tenplex("reshard", str(store), str(back), "--to", "dp=1,tp=1,pp=2", "--format", "megatron-legacy")
    assert done.returncode == 0, done.stderr
    run_worker(1, 2, MODELS["mha"], "--load", "legacy", "--load-dir", str(back),
               "--logits-out", str(tmp_path / "got.pt"))
    assert (logits(source / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6
