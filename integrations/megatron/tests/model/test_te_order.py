"""The layer spec (``transformer_impl``) and the parameter order it gives: unit cases.

The end-to-end check, real megatron-core runs continuing after a reshard, is
``formats/test_te_optimizer.py``.
"""

import pytest

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.formats.dist.keys import dist_names
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import param_order

DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, add_bias_linear=False)


def _names(cfg):
    return [s.mcore for s in param_order(cfg, ParallelConfig(), 0)]


def test_te_moves_the_attention_norm_behind_linear_proj():
    local = _names(MegatronConfig(**DENSE))
    te = _names(MegatronConfig(**DENSE, transformer_impl="transformer_engine"))
    layer = [n for n in local if n.startswith("decoder.layers.{i}")][:6]
    assert layer == ["decoder.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.input_layernorm.bias",
                     "decoder.layers.{i}.self_attention.linear_proj.weight",
                     "decoder.layers.{i}.self_attention.linear_qkv.weight",
                     "decoder.layers.{i}.pre_mlp_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.bias"]
    assert [n for n in te if n.startswith("decoder.layers.{i}")][:6] == [
        layer[2], layer[0], layer[1], layer[3], layer[4], layer[5]]
    assert sorted(te) == sorted(local) and te[0] == local[0] and te[-1] == local[-1]


def test_te_grouped_gemm_experts_are_refused_where_order_matters():
    cfg = MegatronConfig(**DENSE, num_moe_experts=4, moe_grouped_gemm=True, transformer_impl="transformer_engine")
    with pytest.raises(ConfigError, match="TEGroupedMLP"):
        param_order(cfg, ParallelConfig(), 0)
    assert param_order(cfg.with_impl("local"), ParallelConfig(), 0)  # the local spec's sequential order


def test_transformer_impl_from_args():
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    assert MegatronConfig.from_args(args).transformer_impl == "local"  # args without the field
    cfg = MegatronConfig.from_args({**args, "transformer_impl": "transformer_engine"})
    assert cfg.to_json()["transformer_impl"] == "transformer_engine"
    assert MegatronConfig.from_json(cfg.to_json()) == cfg
    assert "transformer_impl" not in cfg.with_impl("local").to_json()
    with pytest.raises(ConfigError, match="transformer_impl: expected one of local, transformer_engine, "
                                          "found 'inference_optimized'"):
        MegatronConfig.from_args({**args, "transformer_impl": "inference_optimized"})


def test_dist_names_keys_first_then_args():
    dense, te_args = MegatronConfig(**DENSE), MegatronConfig(**DENSE, transformer_impl="transformer_engine")
    keys = ["decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.mlp.linear_fc1.weight"]
    assert dist_names(dense, keys) == "local" and dist_names(te_args, keys) == "te"
    assert dist_names(dense, keys + ["decoder.layers.self_attention.core_attention._extra_state/shard_0_2"]) == "te"
    moe = dict(DENSE, num_moe_experts=4)
    local_moe = ["decoder.layers.mlp.linear_fc1.layer_norm_weight"]  # the local spec renames an MoE layer's norm
    assert dist_names(MegatronConfig(**moe, transformer_impl="transformer_engine"), local_moe) == "local"
    assert dist_names(MegatronConfig(**moe), ["decoder.layers.pre_mlp_layernorm.weight"]) == "te"
