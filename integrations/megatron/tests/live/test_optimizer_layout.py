"""The live tree's dp-sharded optimizer leaves hold exactly what megatron-core's DistributedOptimizer holds.

megatron-core 0.16.1 itself is the oracle (``live_oracle.py``, one child
process): its ``DistributedDataParallel`` lays out the grad buffer and
``DistributedOptimizer._build_model_gbuf_range`` says which range of each
parameter every dp rank owns. Model shapes, parallel configs and DDP
options are drawn by hypothesis.
"""

import multiprocessing as mp

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import optimizer_path
from tenplex_megatron.live.spec import LiveSpec, megatron_dp_ranges

import live_oracle


@pytest.fixture(scope="module")
def oracle():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=live_oracle.serve, args=(child,), daemon=True)
    proc.start()

    def ask(cfg: MegatronConfig, config: ParallelConfig, stage: int, spec: LiveSpec) -> dict:
        ddp = dict(use_distributed_optimizer=True, overlap_grad_reduce=spec.overlap_grad_reduce,
                   bucket_size=spec.bucket_size, grad_reduce_in_fp32=spec.grad_reduce_in_fp32,
                   pad_buckets_for_high_nccl_busbw=spec.pad_buckets_for_high_nccl_busbw)
        parent.send((cfg.to_json(), config.to_json(), stage, ddp))
        status, value = parent.recv()
        assert status == "ok", value
        return {path: [tuple(r) if r else None for r in ranges] for path, ranges in value.items()}

    def spec(cfg: MegatronConfig, ddp: dict) -> dict:
        parent.send(("spec", cfg.to_json(), ddp))
        status, value = parent.recv()
        assert status == "ok", value
        return value

    ask.spec = spec
    yield ask
    parent.send(None)
    proc.join(30)


@st.composite
def cases(draw):
    layers = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([2, 4]))
    swiglu = draw(st.booleans())
    cfg = MegatronConfig(
        num_layers=layers, hidden_size=draw(st.sampled_from([32, 64])), num_attention_heads=4,
        num_query_groups=groups, ffn_hidden_size=draw(st.sampled_from([48, 96, 200])), swiglu=swiglu,
        vocab_size=draw(st.integers(50, 300)), make_vocab_size_divisible_by=draw(st.sampled_from([8, 64])),
        untie_embeddings_and_output_weights=draw(st.booleans()),
        position_embedding_type=draw(st.sampled_from(["rope", "learned_absolute"])),
        max_position_embeddings=16, add_bias_linear=draw(st.booleans()),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        params_dtype=draw(st.sampled_from(["bfloat16", "float32"])))
    overlap = draw(st.booleans())
    spec = LiveSpec(cfg, True, overlap, draw(st.sampled_from([None, 3000, 20000])) if overlap else None,
                    draw(st.booleans()), draw(st.booleans()))

    def config():
        return ParallelConfig(dp=draw(st.sampled_from([1, 2, 3, 4, 8])),
                              tp=draw(st.sampled_from([t for t in (1, 2, 4) if groups % t == 0])),
                              pp=draw(st.sampled_from([p for p in (1, 2, 4) if layers % p == 0])))
    return spec, config(), config()


def _tree_ranges(tree, config, stage, paths):
    sharding = Sharding(tree, config)
    return {p: [sharding.dp_range(tree[optimizer_path("exp_avg", p)], d, stage) for d in range(config.dp)]
            for p in paths}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_tree_holds_what_megatron_core_holds(oracle, case):
    spec, a, b = case
    truth = {(c, s): oracle(spec.model, c, s, spec) for c in {a, b} for s in range(c.pp)}
    for (c, s), ranges in truth.items():
        assert megatron_dp_ranges(spec, c, s) == ranges, (c, s)
    for configs in ((a,), (a, b)):
        try:
            tree = spec.tree(*configs)
        except ConfigError as exc:
            # only the layouts that need the pending core FlatBuffer rules are refused
            assert spec.overlap_grad_reduce or (spec.model.tied and {a.pp == 1, b.pp == 1} == {True, False}), exc
            continue
        for c in configs:
            for s in range(c.pp):
                assert _tree_ranges(tree, c, s, truth[(c, s)]) == truth[(c, s)], (c, s)


def test_shared_embedding_gets_its_own_bucket_at_pp_above_1(oracle):
    cfg = MegatronConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                         make_vocab_size_divisible_by=64, params_dtype="bfloat16")
    spec = LiveSpec(cfg)
    a, b = ParallelConfig(dp=4, tp=1, pp=2), ParallelConfig(dp=2, tp=2, pp=2)
    tree = spec.tree(a, b)
    assert [buf.name for buf in tree.buffers][1].endswith("shared_embedding")
    emb = "model/embedding/word_embeddings/weight"
    for c in (a, b):
        for s in (0, 1):
            truth = oracle(cfg, c, s, spec)
            assert _tree_ranges(tree, c, s, truth) == truth
            assert truth[emb] == [((d * 256 * 64) // c.tp // c.dp, ((d + 1) * 256 * 64) // c.tp // c.dp)
                                  for d in range(c.dp)]    # a bucket of its own, cut evenly
    with pytest.raises(ConfigError, match="cannot be described by one tree"):
        spec.tree(a, ParallelConfig(dp=4, tp=2, pp=1))     # pp 2 -> 1 needs the core rule


def test_spec_reads_megatron_cores_ddp_config(oracle):
    cfg = MegatronConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                         params_dtype="bfloat16")
    ddp = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=5000,
               grad_reduce_in_fp32=True, pad_buckets_for_high_nccl_busbw=True)
    assert oracle.spec(cfg, ddp) == {"distributed_optimizer": True, "overlap_grad_reduce": True,
                                     "bucket_size": 5000, "grad_reduce_in_fp32": True,
                                     "pad_buckets_for_high_nccl_busbw": True}
    assert oracle.spec(cfg, {})["distributed_optimizer"] is False      # megatron-core's defaults


def test_spec_refusals_name_what_is_missing():
    cfg = MegatronConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    with pytest.raises(ConfigError, match="fp16 params need the dynamic loss scaler"):
        LiveSpec(MegatronConfig(**{**cfg.to_json(), "params_dtype": "float16"}))
    with pytest.raises(ConfigError, match="give at least one parallel config"):
        LiveSpec(cfg).tree()
    with pytest.raises(ConfigError, match="tp=3 does not divide"):
        LiveSpec(cfg).tree(ParallelConfig(tp=3))
    # a bucket that splits stage 0 but not stage 1 (megatron-core buckets only the first stage)
    with pytest.raises(ConfigError, match="cannot be described by one tree"):
        LiveSpec(cfg, overlap_grad_reduce=True, bucket_size=2000).tree(ParallelConfig(dp=2, pp=2))
    plain = LiveSpec(cfg, distributed_optimizer=False).tree(ParallelConfig(dp=2, tp=2))
    assert not plain.buffers and all(leaf.layout.dp_shard is None for _, leaf in plain.tensors())
    assert "optimizer/param/embedding/word_embeddings/weight" not in plain.leaves    # fp32: no copy
