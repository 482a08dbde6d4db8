"""Each family exported from a real megatron-core model and loaded by transformers, and a negative
control per transform: the export with that one transform left out gives other logits (or no model).

Sources: Qwen2 at (tp2), Qwen3 (tied) at (pp2), Mixtral at (tp2, cp2, ep2, etp2), Qwen3-MoE at (ep2),
Llama at (tp2, pp2), saved by megatron-core in both formats (hf_worker.py, flags in hf_cases.MODELS).
Mixtral's source has cp replicas of every dense tensor and each expert split in two by etp (the
shards drawn apart by ``--distinct-experts``).
"""

from __future__ import annotations

import json

import pytest

from hf_cases import FORMATS, export, hf_logits, reference, source_cache
from tenplex_megatron.formats.hf import export as export_mod, mapping, transforms
from tenplex_megatron.formats.hf.plugin import HF
from tenplex_megatron.formats.plugin import DIST

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5
WHERE = {"llama": (4, "--tp 2 --pp 2"), "qwen2": (2, "--tp 2"), "qwen3": (2, "--pp 2"),
         "mixtral": (4, "--tp 2 --cp 2 --ep 2 --etp 2"), "qwen3_moe": (2, "--ep 2")}
ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    get = source_cache(tmp_path_factory.mktemp("hf_fam"))
    return lambda model: get(model, *WHERE[model])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("model", sorted(ARCH))
def test_family_export_matches_megatron(sources, tmp_path, model, fmt):
    src = sources(model)
    done = export(src / fmt, tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [ARCH[model]], config
    ref, tokens = reference(src)
    assert (hf_logits(tmp_path / "hf", tokens) - ref).abs().max().item() <= TOL


def test_mistral_on_request(sources, tmp_path):
    """Mistral expresses no more than Llama: a plain model exports as Llama by default and as
    ``MistralForCausalLM`` with ``--hf-arch mistral`` (full attention: ``sliding_window`` null), whose
    logits transformers computes as megatron-core did."""
    src = sources("llama")
    done = export(src / "dist", tmp_path / "hf", "--hf-arch", "mistral")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] is None, config
    ref, tokens = reference(src)
    assert (hf_logits(tmp_path / "hf", tokens) - ref).abs().max().item() <= TOL


def test_expert_tensor_parallel_halves_are_joined_in_order(sources, tmp_path):
    """Negative control for the etp source: Mixtral's export (tp2, cp2, ep2, etp2) with one expert's
    two etp halves of ``w2`` swapped misses megatron-core's logits."""
    import torch
    from safetensors.torch import load_file, save_file

    src = sources("mixtral")
    ref, tokens = reference(src)
    out = tmp_path / "hf"
    HF.write(DIST.open_source(str(src / "dist")), str(out), None)
    assert (hf_logits(out, tokens) - ref).abs().max().item() <= TOL
    file = out / "model-00001-of-00001.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"  # [H, F]: etp splits F
    tensors[name] = torch.cat(tensors[name].chunk(2, dim=1)[::-1], dim=1)
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert (hf_logits(out, tokens) - ref).abs().max().item() > 100 * TOL


# ---------------------------------------------------------------------------------- negative controls
def _naive_qkv(t, geo):  # q, k, v as contiguous blocks, ignoring Megatron's per-group order
    q, k = geo.heads * geo.d, geo.groups * geo.d
    return [t[:q].contiguous(), t[q:q + k].contiguous(), t[q + k:].contiguous()]


def _swap_experts(key_of):
    def patched(path):
        key, layer, expert = key_of(path)
        return key, layer, None if expert is None else (expert + 2) % 4
    return patched


CONTROLS = {
    "qkv split per query group": ("llama", lambda mp: mp.setattr(transforms, "qkv_out", _naive_qkv)),
    "[gate; up] order": ("llama", lambda mp: mp.setattr(transforms, "gate_up_out",
                                                         lambda t: transforms.torch.chunk(t, 2)[::-1])),
    "norm epsilon": ("llama", lambda mp: _patch_config(mp, lambda c: c.pop("rms_norm_eps"))),
    "rope_theta": ("llama", lambda mp: _patch_config(mp, lambda c: c.pop("rope_parameters"))),
    "vocab padding dropped": ("llama", lambda mp: mp.setattr(transforms, "vocab_out", lambda t, geo: t)),
    "rotary interleaved rows": ("qwen2", lambda mp: mp.setattr(transforms, "rope_rows_out", lambda t, geo: t)),
    "llama3 rope scaling": ("qwen2", lambda mp: _patch_config(
        mp, lambda c: c.update(rope_parameters={"rope_theta": c["rope_parameters"]["rope_theta"],
                                                "rope_type": "default"}))),
    "tied embeddings": ("qwen3", lambda mp: _patch_config(mp, lambda c: c.update(tie_word_embeddings=False))),
    "experts by global id": ("mixtral", lambda mp: mp.setattr(mapping, "generic_key",
                                                              _swap_experts(mapping.generic_key))),
    "router top-k normalisation": ("qwen3_moe", lambda mp: _patch_config(
        mp, lambda c: c.update(norm_topk_prob=not c["norm_topk_prob"]))),
}


def _patch_config(monkeypatch, edit):
    original = export_mod._config_json

    def patched(*args):
        config = original(*args)
        edit(config)
        return config
    monkeypatch.setattr(export_mod, "_config_json", patched)


@pytest.mark.parametrize("transform", sorted(CONTROLS))
def test_each_transform_is_needed(sources, tmp_path, monkeypatch, transform):
    model, patch = CONTROLS[transform]
    src = sources(model)
    ref, tokens = reference(src)
    HF.write(DIST.open_source(str(src / "dist")), str(tmp_path / "good"), None)
    assert (hf_logits(tmp_path / "good", tokens) - ref).abs().max().item() <= TOL
    patch(monkeypatch)
    # The export writes row-moving transforms as copy-free runs (mapping.segments), which
    # test_hf_units.py::test_row_runs_write_what_apply_makes shows equal to apply(); the controls
    # patch transforms.py, so the bad export takes apply() for every tensor.
    monkeypatch.setattr(export_mod, "segments", lambda *args: None)
    try:
        HF.write(DIST.open_source(str(src / "dist")), str(tmp_path / "bad"), None)
        got = hf_logits(tmp_path / "bad", tokens)
    except (RuntimeError, ValueError) as exc:  # e.g. a padded embedding: the writer or transformers refuses
        print(f"{transform} left out: refused ({str(exc).splitlines()[0][:160]})")
        return
    err = (got - ref).abs().max().item() if got.shape == ref.shape else float("inf")
    print(f"{transform} left out: max logit error {err:.3g}")
    assert err > TOL, f"leaving out {transform} changes nothing ({err:.3g})"
