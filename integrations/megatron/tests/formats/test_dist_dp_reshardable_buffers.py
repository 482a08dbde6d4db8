"""``dp_reshardable`` buffer keys of MoE and VPP models without megatron-core.

The sizes below are what megatron-core 0.16.1 saved here for the model of
``formats/test_moe_optimizer_state.py`` (NOTES.md, "Optimizer state of MoE
checkpoints"); the rule must reproduce them from shapes alone.
"""

import pytest

from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.formats.dist.buffers import expected_flat, flat_index, optimizer_buffers

MOE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
           swiglu=True, vocab_size=128, make_vocab_size_divisible_by=16, add_bias_linear=False,
           untie_embeddings_and_output_weights=True, position_embedding_type="rope",
           normalization="RMSNorm", num_moe_experts=4)
DT = ("torch.float32", "torch.float32")
KEY = "optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{g}.dtype_(torch.float32, torch.float32).bucket_idx_0.param"


def _params(flat: dict) -> dict:
    return {k: n for k, n in flat.items() if k.endswith(".param")}


@pytest.mark.parametrize("config,want", [
    (ParallelConfig(dp=2, ep=2), {"chained_0." + KEY.format(m=0, g=0): 67136,
                                  "chained_1." + KEY.format(m=0, g=0): 147456,
                                  "chained_1." + KEY.format(m=1, g=0): 147456}),
    (ParallelConfig(dp=2, pp=2, vpp=2, ep=2), {
        **{"chained_0." + KEY.format(m=m, g=g): n for (m, g), n in
           {(0, 0): 20864, (0, 1): 12672, (1, 0): 12672, (1, 1): 20928}.items()},
        **{"chained_1." + KEY.format(m=m, g=g): 36864 for m in range(4) for g in range(2)}}),
], ids=["ep2", "pp2vpp2ep2"])
def test_buffer_keys_and_sizes_are_megatron_cores(config, want):
    assert _params(expected_flat(MegatronConfig(**MOE), config, DT)) == want


def test_one_optimizer_has_no_prefix_and_holds_the_experts():
    cfg = MegatronConfig(**MOE)
    flat = _params(expected_flat(cfg, ParallelConfig(dp=1), DT))
    assert list(flat) == [KEY.format(m=0, g=0)]
    path = "model/decoder/layers/0/mlp/experts/3/linear_fc1/weight"
    buf, b, start, numel = flat_index(cfg, ParallelConfig(dp=1), path, ParallelConfig(dp=1).coord(0))
    assert (buf.prefix, buf.expert, numel) == ("", False, 192 * 64)


def test_expert_group_idx_follows_etp_ep_pp_ranks():
    """The expert optimizer's dp_group_idx is the rank in the etp x ep x pp group (tp-ep-pp order)."""
    cfg = MegatronConfig(**MOE)
    config = ParallelConfig(dp=4, tp=2, pp=2, ep=2, etp=2)  # world 16: edp 2
    for rank in range(config.world_size):  # every rank: a layer of its stage, an expert of its ep rank
        c = config.coord(rank)
        layer, expert = 2 * c.pp + 1, 2 * c.ep + 1  # 4 layers over pp 2; 4 experts over ep 2
        path = f"model/decoder/layers/{layer}/mlp/experts/{expert}/linear_fc2/weight"
        found = flat_index(cfg, config, path, c)
        assert found is not None, (rank, path)
        buf = found[0]
        assert (buf.prefix, buf.group_idx, buf.chunk) == ("chained_1.", c.etp + 2 * (c.ep + 2 * c.pp), 0), rank
    groups = {(b.prefix, b.group_idx) for b in optimizer_buffers(cfg, config)}
    assert groups == {("chained_0.", m) for m in range(4)} | {("chained_1.", x) for x in range(8)}
