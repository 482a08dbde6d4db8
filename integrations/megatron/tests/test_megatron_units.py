"""Unit tests of the Megatron integration that need no megatron-core processes."""

import argparse
import json

import pytest
import torch

from tenplex.errors import ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.config import MegatronConfig, stage_layers, uneven_args
from tenplex_megatron.jsonable import from_jsonable, to_jsonable
from tenplex_megatron.layouts import megatron_tree, param_specs, rank_keys
from tenplex_megatron.rng import derive
from tenplex_megatron.safe_load import safe_load

CFG = MegatronConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                     ffn_hidden_size=96, swiglu=True, vocab_size=100, make_vocab_size_divisible_by=16,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     add_bias_linear=False, normalization="RMSNorm")


def test_stage_local_names_map_to_global_layers():
    keys = rank_keys(CFG, ParallelConfig(tp=1, pp=2), 1)
    assert keys["model/decoder/layers/2/mlp/linear_fc1/weight"][0] == "decoder.layers.0.mlp.linear_fc1.weight"
    assert "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight" in \
        keys["model/decoder/layers/2/mlp/linear_fc1/weight"]
    assert "model/embedding/word_embeddings/weight" not in keys
    uneven = ParallelConfig(tp=1, pp=2, stage_layers=(1, 3))
    assert "model/decoder/layers/1/mlp/linear_fc1/weight" in rank_keys(CFG, uneven, 1)


def test_tied_last_stage_reads_the_output_layer_as_the_embedding():
    tied = MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    keys = rank_keys(tied, ParallelConfig(pp=2), 1)
    assert keys["model/embedding/word_embeddings/weight"] == ["output_layer.weight",
                                                              "word_embeddings_for_head.weight"]


def test_layouts_follow_megatron():
    tree = megatron_tree(CFG, optimizer=True)
    qkv = tree["model/decoder/layers/0/self_attention/linear_qkv/weight"]
    assert qkv.shape == ((8 + 2 * 2) * 8, 64) and qkv.layout.split.granularity == (8 // 2 + 2) * 8
    fc1 = tree["model/decoder/layers/0/mlp/linear_fc1/weight"]
    assert fc1.layout.split.parts == (96, 96)
    with pytest.raises(ConfigError, match="tp=4 does not divide num_query_groups=2"):
        tree.validate(ParallelConfig(tp=4))
    assert [s.path for s in param_specs(CFG)][:3] == [
        "model/embedding/word_embeddings/weight", "model/decoder/layers/0/input_layernorm/weight",
        "model/decoder/layers/0/self_attention/linear_proj/weight"]


def test_config_from_args_needs_the_logical_vocab():
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128)
    with pytest.raises(ConfigError, match="no vocab_size; pass the tokenizer's vocabulary size"):
        MegatronConfig.from_args(args)
    assert MegatronConfig.from_args(args, {"vocab_size": 100}).vocab_size == 100
    assert MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                          make_vocab_size_divisible_by=16).padded_vocab(2) == 128


def test_uneven_pipeline_args():
    args = argparse.Namespace(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    assert stage_layers(args, 8, 3) == (1, 4, 3)
    assert uneven_args((1, 4, 3)) == {"decoder_first_pipeline_num_layers": 1,
                                      "decoder_last_pipeline_num_layers": 3}
    with pytest.raises(ConfigError, match="uneven first and last stages only"):
        uneven_args((1, 2, 3, 2))
    with pytest.raises(ConfigError, match="leave 5 layers for 2 middle stages"):
        stage_layers(argparse.Namespace(decoder_first_pipeline_num_layers=3), 8, 3)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_unsafe_pickles_are_refused(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {}, "evil": Evil()}, path)
    with pytest.raises(ManifestError, match="refusing unsafe unpickling"):
        safe_load(path)
    ok = tmp_path / "ok.pt"
    torch.save({"args": argparse.Namespace(a=1), "t": torch.ones(2)}, ok)
    assert safe_load(ok)["args"].a == 1


def test_rng_state_round_trips_through_json():
    state = [derive(1234, tp_rank=1, pp_rank=0, kind="cpu")]
    back = from_jsonable(json.loads(json.dumps(to_jsonable(state))))
    assert torch.equal(back[0]["torch_rng_state"], state[0]["torch_rng_state"])
    assert back[0]["random_rng_state"] == state[0]["random_rng_state"]
    assert (back[0]["np_rng_state"][1] == state[0]["np_rng_state"][1]).all()
