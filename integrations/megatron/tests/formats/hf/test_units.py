"""The hf format's pieces in one process: transforms both ways, family choice and refusals,
shard sizes, and safetensors headers that lie."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from tenplex.errors import ConfigError, CorruptShardError, ManifestError
from tenplex_megatron.formats.hf import transforms as tf
from tenplex_megatron.formats.hf.catalog import choose, families
from tenplex_megatron.formats.hf.export import parse_size
from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.formats.hf.hfdir import is_hf_dir, tensors
from tenplex_megatron.model.config import MegatronConfig

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=100,
             ffn_hidden_size=96, swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             normalization="RMSNorm", untie_embeddings_and_output_weights=True)


def cfg(**kw) -> MegatronConfig:
    return MegatronConfig(**{**LLAMA, **kw})


# ------------------------------------------------------------------------------------- transforms
@pytest.mark.parametrize("transform,shape", [("qkv", (96, 64)), ("qkv", (96,)), ("gate_up", (192, 64)),
                                             ("vocab", (112, 64)), ("copy", (64, 96)), ("norm", (64,))])
def test_row_runs_write_what_apply_makes(tmp_path, transform, shape):
    """The export writes row-moving transforms straight from the read buffers (``segments``), from
    parts that split the tensor anywhere: the file holds ``apply``'s tensors bit for bit. Where a
    value changes (another dtype, interleaved rope rows, ``+ 1`` norms) there are no runs."""
    from safetensors.torch import load_file

    from tenplex_megatron.formats.hf.family import Transform
    from tenplex_megatron.formats.hf.mapping import Job, apply, out_shapes, segments
    from tenplex_megatron.formats.hf.stwriter import ShardFile

    t, c = Transform(transform), cfg()
    names = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}.get(transform, ("w",))
    shapes = out_shapes(t, shape, c)
    geo = tf.Geometry(heads=8, groups=2, d=8, vocab=100)
    job = Job("model/x", names, t, 0, shapes)
    tensor = torch.randn(shape)
    runs = segments(job, shape, geo, same_dtype=True)
    f = ShardFile(str(tmp_path / "a.safetensors"), [(n, torch.float32, s) for n, s in zip(names, shapes)])
    flat, position = tensor.reshape(-1), 0
    for part in flat.split([7, flat.numel() // 3, flat.numel() - 7 - flat.numel() // 3]):  # cuts inside rows
        for start, n, name, at in runs:
            lo, hi = max(position, start), min(position + part.numel(), start + n)
            if lo < hi:
                f.write_range(name, at + lo - start, part[lo - position: hi - position])
        position += part.numel()
    f.close()
    got, want = load_file(str(tmp_path / "a.safetensors")), apply(job, tensor, geo, torch.float32)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert segments(job, shape, geo, same_dtype=False) is None
    if transform in ("qkv", "norm"):
        changed = tf.Geometry(heads=8, groups=2, d=8, vocab=100, interleaved=True, layernorm_1p=True)
        assert segments(job, shape, changed, same_dtype=True) is None


def test_a_shard_file_refuses_a_range_twice_or_outside(tmp_path):
    from tenplex.errors import ShardError
    from tenplex_megatron.formats.hf.stwriter import ShardFile

    f = ShardFile(str(tmp_path / "a.safetensors"), [("w", torch.float32, (4, 2))])
    f.write_range("w", 0, torch.zeros(6))
    with pytest.raises(ShardError, match="outside"):
        f.write_range("w", 6, torch.zeros(3))
    f.write_range("w", 6, torch.zeros(2))
    with pytest.raises(ShardError, match="twice"):
        f.write_range("w", 0, torch.zeros(2))
    with pytest.raises(CorruptShardError, match="never written"):
        ShardFile(str(tmp_path / "b.safetensors"), [("w", torch.float32, (4,))]).close()


@pytest.mark.parametrize("interleaved", [False, True])
def test_qkv_split_and_merge_are_inverse(interleaved):
    geo = tf.Geometry(heads=8, groups=2, d=8, interleaved=interleaved)
    fused = torch.randn((8 + 4) * 8, 64)
    q, k, v = tf.qkv_out(fused, geo)
    assert q.shape == (64, 64) and k.shape == (16, 64) and v.shape == (16, 64)
    assert torch.equal(tf.qkv_in(q, k, v, geo), fused)
    assert torch.equal(tf.qkv_in(*tf.qkv_out(fused[:, 0], geo), geo), fused[:, 0])  # biases


def test_qkv_split_takes_each_groups_rows():
    geo = tf.Geometry(heads=4, groups=2, d=1)
    rows = torch.arange(8.0)  # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    q, k, v = tf.qkv_out(rows, geo)
    assert q.tolist() == [0, 1, 4, 5] and k.tolist() == [2, 6] and v.tolist() == [3, 7]


def test_interleaved_rope_rows_become_even_then_odd():
    geo = tf.Geometry(heads=1, groups=1, d=4, interleaved=True)
    assert tf.rope_rows_out(torch.arange(8.0), geo).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert tf.rope_rows_in(tf.rope_rows_out(torch.arange(8.0), geo), geo).tolist() == list(range(8))


def test_norm_1p_vocab_and_gate_up():
    geo = tf.Geometry(heads=1, groups=1, d=1, layernorm_1p=True, vocab=3)
    w = torch.zeros(4)
    assert tf.norm_out(w, geo).tolist() == [1.0] * 4 and torch.equal(tf.norm_in(tf.norm_out(w, geo), geo), w)
    assert tf.vocab_out(torch.arange(5.0), geo).tolist() == [0, 1, 2]
    gate, up = tf.gate_up_out(torch.arange(4.0))
    assert gate.tolist() == [0, 1] and up.tolist() == [2, 3]
    with pytest.raises(Exception, match="rows"):
        tf.qkv_out(torch.zeros(5, 2), tf.Geometry(heads=2, groups=1, d=1))


# -------------------------------------------------------------------------------- family choice
@pytest.mark.parametrize("kw,fields,family", [
    ({}, {}, "llama"),
    ({"add_bias_linear": True}, {}, "llama"),
    ({"add_qkv_bias": True}, {}, "qwen2"),
    ({"qk_layernorm": True}, {}, "qwen3"),
    ({"num_moe_experts": 4}, {}, "mixtral"),
    ({"num_moe_experts": 4, "qk_layernorm": True}, {"moe_router_pre_softmax": True}, "qwen3_moe"),
])
def test_the_family_follows_the_features(kw, fields, family):
    assert choose(cfg(**kw), ModelFields(**fields)).name == family


@pytest.mark.parametrize("kw,fields,phrase", [
    ({}, {"multi_latent_attention": True}, "multi-latent attention"),
    ({}, {"mtp_num_layers": 1}, "multi-token prediction"),
    ({"num_moe_experts": 4, "moe_shared_expert_intermediate_size": 32}, {}, "shared experts"),
    ({"num_moe_experts": 4}, {"moe_router_score_function": "sigmoid"}, "sigmoid"),
    ({"num_moe_experts": 4}, {"moe_router_pre_softmax": True}, "softmaxes before top-k"),
    ({"normalization": "LayerNorm"}, {}, "LayerNorm"),
    ({"swiglu": False}, {}, "non-gated MLP"),
    ({"position_embedding_type": "learned_absolute"}, {}, "learned absolute"),
    ({}, {"rotary_percent": 0.5}, "partial rotary"),
])
def test_an_uncovered_feature_is_refused_in_one_line(kw, fields, phrase):
    with pytest.raises(ConfigError, match=phrase) as info:
        choose(cfg(**kw), ModelFields(**fields))
    assert "\n" not in str(info.value)


def test_hf_arch_overrides_and_refuses_what_it_cannot_express():
    assert choose(cfg(add_qkv_bias=True), ModelFields(), "qwen2").name == "qwen2"
    with pytest.raises(ConfigError, match="query/key layernorm.*LlamaForCausalLM"):
        choose(cfg(qk_layernorm=True), ModelFields(), "llama")
    with pytest.raises(ConfigError, match="unknown; expected one of"):
        choose(cfg(), ModelFields(), "gpt2")
    assert {"llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"} <= set(families())


def test_mistral_imports_with_full_attention_only():
    """transformers' MistralConfig defaults to a 4096-token sliding window (Mistral 7B v0.1); v0.2 on
    set null. megatron-core GPTs here attend to every token, so only null imports."""
    import transformers

    from tenplex_megatron.formats.hf.hfconfig import args_from_config

    mistral = families()["mistral"]
    base = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100).to_dict()
    with pytest.raises(ConfigError, match="sliding-window attention"):
        args_from_config(base, mistral, "config.json")
    args = args_from_config({**base, "sliding_window": None}, mistral, "config.json")
    assert (args["num_query_groups"], args["kv_channels"], args["add_bias_linear"]) == (2, 8, False)
    with pytest.raises(ConfigError, match="attention_bias=true in mistral"):
        args_from_config({**base, "sliding_window": None, "attention_bias": True}, mistral, "config.json")


def test_fields_come_from_args_with_megatron_defaults():
    f = ModelFields.from_args({"layernorm_epsilon": 1e-6, "rotary_base": 500000, "use_rope_scaling": True})
    assert (f.norm_epsilon, f.rotary_base, f.use_rope_scaling, f.in_args) == (1e-6, 500000.0, True, True)
    assert ModelFields.from_args(None) == ModelFields() and not ModelFields().in_args
    with pytest.raises(ConfigError, match="rotary_interleaved"):
        ModelFields.from_args({"rotary_interleaved": "yes"})


def test_shard_sizes():
    assert parse_size(None) == 5_000_000_000 and parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 << 30 and parse_size(1234) == 1234
    for bad in ("lots", "-1GB", 0, "inf", "1e400GB", "nan"):  # inf: an OverflowError before
        with pytest.raises(ConfigError):
            parse_size(bad)


# ------------------------------------------------------------------------ safetensors headers
def _file(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_header_that_lies_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    good = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    _file(tmp_path / "model.safetensors", good, bytes(16))
    assert is_hf_dir(str(tmp_path)) and tensors(str(tmp_path))["w"].shape == (2, 2)
    lies = {
        "past the end": {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}},
        "needs 16 bytes": {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}},
        "malformed": {"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}},
        "floating-point": {"w": {"dtype": "I32", "shape": [2, 2], "data_offsets": [0, 16]}},
    }
    for phrase, header in lies.items():
        _file(tmp_path / "model.safetensors", header, bytes(16))
        with pytest.raises(CorruptShardError, match=phrase if phrase != "past the end" else "file of"):
            tensors(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(CorruptShardError, match="header of"):
        tensors(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x"}}))
    with pytest.raises(ManifestError, match="plain file names"):
        tensors(str(tmp_path))


def test_a_link_out_of_an_hf_directory_is_refused(tmp_path):
    """The HF reader opens every file under the one path rule: a config.json that links out of the
    model directory is refused before it is read."""
    from tenplex.errors import TenplexError
    from tenplex_megatron.formats.hf.hfdir import read_config

    secret = tmp_path / "secret.json"
    secret.write_text('{"model_type": "llama"}')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    with pytest.raises(TenplexError, match="config.json"):
        read_config(str(model))


def test_the_parts_split_the_shard_files_by_bytes_each_file_once():
    """Under torchrun each process writes whole shard files, heaviest first onto the least loaded
    process; fewer files than processes leave processes idle."""
    from tenplex.formats.protocol import Part
    from tenplex_megatron.formats.hf.parts import my_files

    sizes = [100, 5, 5, 90, 3]
    split = [my_files(sizes, Part(i, 2, "t")) for i in range(2)]
    assert sorted(f for files in split for f in files) == list(range(len(sizes)))
    assert sorted(sum(sizes[f] for f in files) for files in split) == [100, 103]  # {90, 5, 5} and {100, 3}
    assert [my_files([100], Part(i, 4, "t")) for i in range(4)] == [[0], [], [], []]
