"""Real megatron-core MoE models whose layers differ (``moe_layer_freq`` != 1), resharded by the CLI.

megatron-core 0.16.1 then keys ``torch_dist`` tensors per layer
(``decoder.layers.<l>.mlp.linear_fc1.weight`` on a dense layer,
``decoder.layers.<l>.mlp.experts.experts.linear_fc1.weight`` ``[E, 2F, h]`` on an MoE
layer, no layer axis), with the optimizer state under the same keys; legacy
files are per layer anyway. Each case: megatron-core trains 2 steps with the
distributed optimizer, saves both formats and trains 2 more (the static run);
tenplex reshards; megatron-core at the target loads with ``strict=True``, its
logits match the source's within 1e-6 (a fresh model's do not) and 2 more steps
match the static run within 1e-6.
"""

import pytest

from inprocess_cli import tenplex
from mcore_checkpoint import megatron_load_dir
from moe_cases import FORMATS, check_resumed, source_cache

# (name, source world, source flags, target world, target flags, target config, [(in, out) formats])
CASES = [
    # MoE on layers 0 and 2, one of each per stage; pp 2 -> 1 and ep 2 -> 1 at once
    ("freq2_pp2ep2_to_pp1ep1", 4, "--moe-layer-freq 2 --pp 2 --ep 2", 1, "--moe-layer-freq 2", "dp=1",
     [("legacy", "legacy"), ("dist", "dist"), ("legacy", "dist"), ("dist", "legacy")]),
    # MoE on layers 0, 1, 2: pp 1 -> 2 puts two MoE layers on stage 0 and one (and the dense layer)
    # on stage 1; ep 2 -> 1
    ("list1110_ep2_to_pp2", 2, "--moe-layer-freq [1,1,1,0] --ep 2", 2, "--moe-layer-freq [1,1,1,0] --pp 2",
     "dp=1,pp=2", [("legacy", "dist"), ("dist", "legacy")]),
]
PARAMS = [(c, a, b) for c in CASES for a, b in c[6]]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``get(case)``: the case's source, trained and saved with the distributed optimizer (see moe_cases)."""
    get = source_cache(tmp_path_factory.mktemp("moe_layers"))
    return lambda case: get(case[1], case[2] + " --dist-opt")


@pytest.mark.parametrize("case,fmt,out_fmt", PARAMS, ids=[f"{c[0]}-{a}-{b}" for c, a, b in PARAMS])
@pytest.mark.slow
@pytest.mark.multiprocess
def test_mixed_layers_reshard_loads_and_trains_on(sources, tmp_path, case, fmt, out_fmt):
    name, _, _, n_dst, dst, to, _ = case
    source, static = sources(case)
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / fmt), str(out), "--to", to, "--format", FORMATS[out_fmt])
    assert done.returncode == 0, done.stderr
    check_resumed(source, static, tmp_path, n_dst, dst + " --dist-opt", out_fmt, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_written_dist_keys_are_megatrons(sources, tmp_path):
    """tenplex's torch_dist output of a mixed model has exactly megatron-core's keys, shapes and
    extra-state objects (those of megatron's own save at the same config)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    case = CASES[1]
    source, _ = sources(case)
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / "legacy"), str(out), "--to", "dp=2,ep=2", "--format", "megatron-dist")
    assert done.returncode == 0, done.stderr

    def table(root):
        md = FileSystemReader(megatron_load_dir(str(root))).read_metadata().state_dict_metadata
        return {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None for k, v in md.items()
                if not k.startswith("rng_state/")}  # the legacy source has RNG states, megatron's save none

    want, got = table(source / "dist"), table(out)
    assert got == want
    assert want["decoder.layers.3.mlp.linear_fc1.weight"] == (192, 64)
    assert want["optimizer.state.exp_avg.decoder.layers.2.mlp.experts.experts.linear_fc1.weight"] == (4, 192, 64)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in got


def test_expected_keys_follow_the_layer_pattern():
    """Per-layer keys exactly when megatron-core uses them: an int above 1 or a list, even one that
    puts experts on every layer; stacked keys otherwise."""
    from tenplex.ptree.config import ParallelConfig
    from tenplex.ptree.sharding import Sharding
    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.formats.dist.keys import expected_tensors, extra_state_objects, known_extra_state
    from tenplex_megatron.model.layouts import megatron_tree

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                ffn_hidden_size=96, swiglu=True, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                add_bias_linear=False, untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                num_moe_experts=4)

    def keys(**kw):
        cfg = MegatronConfig(**base, **kw)
        tree = megatron_tree(cfg, optimizer=True)
        return cfg, expected_tensors(cfg, Sharding(tree, ParallelConfig(tp=2)), "fully_reshardable")

    cfg, got = keys(moe_layer_freq=2)
    assert got["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"][0] == (4, 192, 64)
    assert got["decoder.layers.1.mlp.linear_fc1.weight"][0] == (192, 64)
    assert got["optimizer.state.param.decoder.layers.3.mlp.linear_fc1.layer_norm_weight"][0] == (64,)
    assert not any(k.startswith("decoder.layers.1.mlp.experts") or k.startswith("decoder.layers.mlp.")
                   for k in got)
    assert extra_state_objects(cfg, 1)[-1] == "decoder.layers.1.mlp.linear_fc2._extra_state/shard_0_1"
    assert known_extra_state(cfg, "decoder.layers.0.mlp.experts.experts.linear_fc1._extra_state/shard_3_4")
    assert not known_extra_state(cfg, "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_4")
    assert not known_extra_state(cfg, "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.3_4.4")
    _, got = keys(moe_layer_freq=[1, 1, 1, 1])
    assert got["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"][0] == (4, 64, 96)
    cfg, got = keys()
    assert got["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0] == (4, 4, 192, 64)
    assert not any(k.startswith("decoder.layers.0.") for k in got)
    assert known_extra_state(cfg, "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_3.1_4.4")

