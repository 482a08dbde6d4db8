"""Flat-buffer and pipeline rules against megatron-core 0.16's own code (no process group needed)."""

import types
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tenplex.errors import LayoutError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import Bucketing, FlatBuffer, ParallelConfig as P, Sharding
from tenplex.ptree.buffer import layout_buffer


class _Group:
    """Stands in for a process group: megatron's buffer only asks its size (and rank)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _megatron_buffer(numels, shared, group, bucket_size):
    """megatron-core's ``_ParamAndGradBuffer`` on CPU, for params in ``named_parameters`` order."""
    import megatron.core.distributed.param_and_grad_buffer as pgb
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                        overlap_grad_reduce=bucket_size is not None,
                                        bucket_size=bucket_size)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    for p, own in zip(params, shared):
        if own:
            p.shared_embedding = True
    pg = types.SimpleNamespace(tp=_Group(1), dp_cp=_Group(group))
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buf = pgb._ParamAndGradBuffer(ddp, torch.float32, torch.float32, params, _Group(group),
                                  bucket_size, names, 1.0, list(range(len(params))), False, pg)
    return params, buf


@pytest.fixture(scope="module")
def cpu_megatron():
    """Let megatron allocate its buffers on CPU and skip its rank-0 logging (undone after)."""
    warnings.filterwarnings("ignore", category=UserWarning)
    import megatron.core.distributed.param_and_grad_buffer as pgb

    patch = pytest.MonkeyPatch()
    patch.setattr(torch.cuda, "current_device", lambda: "cpu")
    patch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)
    yield
    patch.undo()


@given(st.lists(st.tuples(st.integers(1, 400), st.booleans()), min_size=1, max_size=8),
       st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([None, 1, 100, 500, 2000]))
def test_layout_buffer_is_megatron_cores_param_and_grad_buffer(cpu_megatron, params, group, size):
    numels = [n for n, _ in params]
    shared = [own for _, own in params]
    mparams, buf = _megatron_buffer(numels, shared, group, size)
    # tenplex's members are in buffer order: megatron lays params out in reverse
    entries = [(f"p{i}", numels[i], shared[i]) for i in reversed(range(len(numels)))]
    layout = layout_buffer(entries, group, align=64, pad_multiple=128, bucket_size=size)
    for i, p in enumerate(mparams):
        start, end, bucket = buf.param_index_map[p]
        assert layout.members[f"p{i}"] == (start, end - start, bucket)
    assert [(b.start, b.start + b.padded) for b in layout.buckets] == buf.bucket_indices
    assert [b.numel for b in layout.buckets] == [b.numel_unpadded for b in buf.buckets]
    # each group index holds 1/group of every bucket, as DistributedOptimizer cuts it
    for b in layout.buckets:
        assert b.padded % group == 0


def test_distributed_optimizer_ranges_follow_megatrons_shard_ranges(cpu_megatron):
    """``BufferLayout.shard`` is ``DistributedOptimizer._build_model_gbuf_range``'s param range."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    numels, group = [300, 70, 5, 900], 4
    mparams, buf = _megatron_buffer(numels, [False, True, False, False], group, 500)
    layout = layout_buffer([(f"p{i}", numels[i], i == 1) for i in reversed(range(4))], group, 64,
                           128, 500)
    for d in range(group):
        buf.data_parallel_group = types.SimpleNamespace(rank=lambda d=d: d, size=lambda: group)
        held = {}
        for b in range(len(buf.buckets)):
            ranges = DistributedOptimizer._build_model_gbuf_range(buf, b)["param_map"]
            held.update({p: (r["param"].start, r["param"].end) for p, r in ranges.items()})
        for i, p in enumerate(mparams):
            assert layout.shard(f"p{i}", d) == held.get(p), (d, i)


@pytest.mark.parametrize("pp,vpp,first,last,layers", [
    (2, 2, None, None, 8), (4, 2, None, None, 16), (2, 4, None, None, 8), (4, 3, None, None, 24),
    (3, 2, 2, 4, 10), (3, 1, 1, None, 7), (4, 2, None, 2, 14), (4, 2, 2, 4, 14), (3, 2, 4, 2, 10)])
def test_virtual_chunks_are_megatron_cores_layer_offsets(pp, vpp, first, last, layers):
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    mc = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                           pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                           num_layers_in_first_pipeline_stage=first,
                           num_layers_in_last_pipeline_stage=last, use_cpu_initialization=True)
    middle = layers - (first or 0) - (last or 0)
    n_middle = pp - (first is not None) - (last is not None)
    counts = [middle // n_middle] * n_middle if n_middle else []
    stage_layers = ([first] if first else []) + counts + ([last] if last else [])
    config = P(pp=pp, vpp=vpp, stage_layers=None if first is None and last is None
               else tuple(stage_layers))
    for s in range(pp):
        for v in range(vpp):
            offset = get_transformer_layer_offset(mc, v if vpp > 1 else None, s)
            count = get_num_layers_to_build(mc, v if vpp > 1 else None, s)
            assert config.chunk_layers(s, v, layers) == range(offset, offset + count), (s, v)


def test_buffer_instances_per_chunk_and_expert_part_hand_checked():
    """pp=2, vpp=2, ep=2: each (stage, chunk) has its own buffer; experts in a part of their own."""
    spec = GPTSpec(num_layers=4, hidden=8, heads=2, query_groups=2, ffn=16, vocab=20, seq_len=4,
                   bias=False, layernorm=False, rope=True, num_experts=4, moe_ffn=8,
                   optimizer="distributed_adam", make_vocab_size_divisible_by=1)
    tree = gpt_tree(spec)
    s = Sharding(tree, P(dp=2, pp=2, vpp=2, ep=2))
    # stage 0 chunk 1 holds layer 2 only (chunks: s0 [0] [2], s1 [1] [3])
    dense = s.buffer_layout("grad", 0, 1)
    assert {k.split("/")[2] for k in dense.members} == {"2"}
    assert not any("experts" in k for k in dense.members) and dense.group_size == 2
    # layer 2's expert part on ep rank 1: experts 3 and 2 (reverse order), 64 elements each
    # tensor ([8, 8]: moe_ffn 8, hidden 8) on 64-element starts, over edp = 4 / (ep 2 * pp 2) = 1
    part = s.buffer_layout("grad", 0, 1, expert_part=True, ep_rank=1)
    assert list(part.members) == [f"model/layers/2/mlp/experts/{g}/fc{f}/weight"
                                  for g in (3, 2) for f in (2, 1)]
    assert part.group_size == 1 and [m[0] for m in part.members.values()] == [0, 64, 128, 192]
    # with ep = 1 the experts are in the dense part, sharded over dp
    one = Sharding(tree, P(dp=2, pp=2, vpp=2))
    assert sum("experts" in k for k in one.buffer_layout("grad", 0, 1).members) == 8


def test_bucketing_and_own_bucket():
    members = ("a", "b", "c")
    first = FlatBuffer("g", members, bucket_numel=10, bucketing=Bucketing.FIRST_CHUNK,
                       own_bucket=("b",))
    assert [first.bucket_size(s, v) for s, v in [(0, 0), (0, 1), (1, 0)]] == [10, None, None]
    stage = FlatBuffer("g", members, bucket_numel=10, bucketing=Bucketing.FIRST_STAGE)
    assert [stage.bucket_size(s, v) for s, v in [(0, 0), (0, 1), (1, 0)]] == [10, 10, None]
    assert FlatBuffer.from_json(first.to_json()) == first
    old = {"name": "g", "members": ["a"], "align": 64, "pad_multiple": 128, "bucket_numel": None}
    assert FlatBuffer.from_json(old).to_json() == old   # JSON of older trees reads unchanged
    for bad, message in [(dict(own_bucket=("z",)), "own_bucket keys"),
                         (dict(bucket_numel=0), "bucket_numel must be"),
                         (dict(align=0), "align must be")]:
        with pytest.raises(LayoutError, match=message):
            FlatBuffer("g", members, **bad)
    with pytest.raises(LayoutError, match="malformed buffer JSON"):
        FlatBuffer.from_json({**old, "bucketing": "sometimes"})
