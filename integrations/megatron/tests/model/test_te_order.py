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


def _experts(cfg, config, ep_rank=0, layer=1):
    return [s.path.split("/mlp/experts/")[1] for s in param_order(cfg, config, 0, 0, ep_rank)
            if s.layer == layer and s.expert is not None]


def test_te_grouped_gemm_experts_follow_te_grouped_mlp_order():
    """megatron-core's ``TEGroupedMLP`` builds ``linear_fc1`` then ``linear_fc2``, and TE's ``GroupedLinear``
    registers ``weight0``, ``weight1``, ...: a layer's experts are every fc1, then every fc2, where
    ``SequentialMLP`` (the local spec, or TE without ``--moe-grouped-gemm``) has each expert's pair in turn.
    Everything else keeps its place. (The end-to-end check: formats/test_te_grouped_experts.py.)"""
    grouped = MegatronConfig(**DENSE, num_moe_experts=4, moe_grouped_gemm=True, transformer_impl="transformer_engine")
    sequential = grouped.with_overrides({"moe_grouped_gemm": False})
    assert _experts(grouped, ParallelConfig()) == [f"{g}/linear_fc{n}/weight" for n in (1, 2) for g in range(4)]
    assert _experts(grouped, ParallelConfig(dp=2, ep=2), ep_rank=1) == [
        "2/linear_fc1/weight", "3/linear_fc1/weight", "2/linear_fc2/weight", "3/linear_fc2/weight"]
    for cfg in (sequential, grouped.with_impl("local")):
        assert _experts(cfg, ParallelConfig()) == [f"{g}/linear_fc{n}/weight" for g in range(4) for n in (1, 2)]
    a, b = ([s.path for s in param_order(c, ParallelConfig(), 0)] for c in (grouped, sequential))
    assert len(a) == len(b) and all((x == y) or ("/experts/" in x and "/experts/" in y) for x, y in zip(a, b))


def test_single_grouped_expert_parameters_are_refused():
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, num_experts=4,
                moe_grouped_gemm=True, transformer_impl="transformer_engine")
    assert MegatronConfig.from_args({**args, "moe_single_grouped_weight": False}).moe_grouped_gemm
    for flag in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
        with pytest.raises(ConfigError, match=f"{flag}=True .*one parameter per expert"):
            MegatronConfig.from_args({**args, flag: True})


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
