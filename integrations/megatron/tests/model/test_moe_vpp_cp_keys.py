"""MoE, VPP and CP key rules without megatron-core: expert ids, chunk-local layers, buffers, args."""

import argparse

import pytest

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.model.config import MegatronConfig, args_for
from tenplex_megatron.model.flatbuf import buffer_layout
from tenplex_megatron.model.layouts import chunk_keys, extra_state_keys, megatron_tree, param_order

MOE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
           swiglu=True, vocab_size=128, make_vocab_size_divisible_by=16, add_bias_linear=False,
           untie_embeddings_and_output_weights=True, position_embedding_type="rope",
           normalization="RMSNorm", num_moe_experts=8)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_local_expert_ids_map_to_contiguous_global_blocks(ep):
    cfg = MegatronConfig(**MOE)
    config = ParallelConfig(dp=ep, ep=ep)
    seen = {}
    for e in range(ep):
        for path, keys in chunk_keys(cfg, config, 0, 0, e).items():
            if "/experts/" in path and path.endswith("linear_fc1/weight") and "/layers/1/" in path:
                g = int(path.split("/experts/")[1].split("/")[0])
                j = g - e * (8 // ep)
                assert 0 <= j < 8 // ep
                assert keys == [f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight",
                                f"decoder.layers.1.mlp.experts.linear_fc1.weight{j}"]
                assert g not in seen
                seen[g] = e
    assert sorted(seen) == list(range(8))  # every expert on exactly one ep rank


def test_vpp_chunks_hold_megatron_layers_with_chunk_local_indices():
    cfg = MegatronConfig(**{**MOE, "num_layers": 8})
    config = ParallelConfig(pp=2, vpp=2)
    # megatron-core: chunk c = v*pp + p holds layers [c*L/(pp*vpp), ...) (FACTS 4.4)
    want = {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    for (p, v), layers in want.items():
        keys = chunk_keys(cfg, config, p, v)
        got = sorted({int(path.split("/")[3]) for path in keys if "/layers/" in path})
        assert got == layers
        assert f"decoder.layers.{len(layers) - 1}.input_layernorm.weight" in \
            keys[f"model/decoder/layers/{layers[-1]}/input_layernorm/weight"]
        assert ("model/embedding/word_embeddings/weight" in keys) == ((p, v) == (0, 0))
        assert ("model/output_layer/weight" in keys) == ((p, v) == (1, 1))


def test_expert_buffers_hold_only_their_experts_at_ep_above_one():
    cfg = MegatronConfig(**MOE)
    config = ParallelConfig(dp=2, ep=2)
    dense = [s.path for entries, _, _ in buffer_layout(cfg, config, 0) for s, _, _ in entries]
    expert = [s.path for entries, _, _ in buffer_layout(cfg, config, 0, expert=True, ep_rank=1)
              for s, _, _ in entries]
    assert not any("/experts/" in p for p in dense)
    assert expert and all(int(p.split("/experts/")[1].split("/")[0]) in range(4, 8) for p in expert)
    # reverse named_parameters() order: the last layer's last local expert first
    assert expert[0] == "model/decoder/layers/3/mlp/experts/7/linear_fc2/weight"
    single = [s.path for entries, _, _ in buffer_layout(cfg, ParallelConfig(), 0) for s, _, _ in entries]
    assert sum("/experts/" in p for p in single) == 4 * 8 * 2  # at ep = 1 experts are dense members


def test_expert_bias_is_a_buffer_without_optimizer_state():
    cfg = MegatronConfig(**MOE, moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=32)
    tree = megatron_tree(cfg, optimizer=True)
    assert "model/decoder/layers/0/mlp/router/expert_bias" in tree.leaves
    assert tree["model/decoder/layers/0/mlp/router/expert_bias"].dtype == "float32"
    assert not any(p.startswith("optimizer/") and p.endswith("expert_bias") for p in tree.leaves)
    assert all(not s.path.endswith("expert_bias") for s in param_order(cfg, ParallelConfig(), 0))
    keys = extra_state_keys(cfg, 0, 2)
    assert "decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc2._extra_state" in keys
    assert "decoder.layers.{i}.mlp.shared_experts.linear_fc1._extra_state" in keys
    assert "decoder.layers.{i}.mlp.linear_fc1._extra_state" not in keys


def test_args_are_read_and_rewritten_for_every_axis():
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                              num_experts=8, moe_layer_freq="[1,0,1,0]", moe_grouped_gemm=True,
                              make_vocab_size_divisible_by=16)
    cfg = MegatronConfig.from_args(args)
    assert cfg.num_moe_experts == 8 and cfg.moe_layer_freq == (1, 0, 1, 0) and cfg.moe_grouped_gemm
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False] and cfg.dist_per_layer
    assert MegatronConfig.from_json(cfg.to_json()) == cfg
    out = args_for(args, cfg, ParallelConfig(dp=2, pp=2, cp=2, ep=4, etp=1, vpp=2))
    assert (out.context_parallel_size, out.expert_model_parallel_size, out.expert_tensor_parallel_size,
            out.virtual_pipeline_model_parallel_size, out.data_parallel_size) == (2, 4, 1, 2, 2)
    with pytest.raises(ConfigError, match="evaluates no expressions"):
        MegatronConfig.from_args(argparse.Namespace(**{**vars(args), "moe_layer_freq": "__import__('os')"}))
    dense = MegatronConfig(**{k: v for k, v in MOE.items() if k != "num_moe_experts"})
    assert "num_moe_experts" not in dense.to_json()  # dense JSON unchanged
