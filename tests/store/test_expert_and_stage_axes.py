"""The store with experts, expert tp, context parallelism and virtual stages: save, reshard, load."""

import json

import torch

from tenplex.api import load, reshard, save
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal

SPEC = GPTSpec(num_layers=4, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100, swiglu=True,
               num_experts=4, moe_ffn=32, shared_expert_ffn=32, expert_bias=True, tied=True,
               dtype="bfloat16", optimizer="distributed_adam", bucket_numel=5000,
               make_vocab_size_divisible_by=8)


def test_save_reshard_load_across_ep_cp_etp_vpp(tmp_path):
    tree = gpt_tree(SPEC)
    src, dst = P(dp=1, tp=2, cp=2, ep=4, etp=1), P(dp=2, tp=1, pp=2, vpp=2, ep=2)
    state = random_state(tree, src, 3)
    save(str(tmp_path / "a"), tree, src, {r: materialize(tree, state, src, r)
                                          for r in range(src.world_size)})
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["config"] == src.to_json() and P.from_json(manifest["config"]) == src
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), dst)
    for rank in range(dst.world_size):
        got = load(str(tmp_path / "b"), rank=rank)
        want = materialize(tree, state, dst, rank)
        assert set(got) >= {p for p, v in want.items() if isinstance(v, torch.Tensor)}
        for path, tensor in want.items():
            if isinstance(tensor, torch.Tensor):
                assert bitwise_equal(got[path], tensor), (rank, path)
            else:  # value leaves (counters, per-rank and per-coordinate values) as well
                assert got[path] == tensor, (rank, path)
    # a rank of a third config reads straight from the stored one
    third = P(dp=2, ep=2, etp=2, tp=2)
    for rank in (0, 3):
        got = load(str(tmp_path / "b"), third, rank)
        want = materialize(tree, state, third, rank)
        assert all(bitwise_equal(got[p], t) for p, t in want.items() if isinstance(t, torch.Tensor))
