"""Hypothesis strategies: GPT-style specs (dense and mixture-of-experts) and valid config pairs."""

from functools import lru_cache

from hypothesis import strategies as st

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree.buffer import Bucketing
from tenplex.ptree.config import ParallelConfig

ORDERS = (("tp", "cp", "ep", "dp", "pp"), ("tp", "pp", "cp", "ep", "dp"))
"""megatron's default order, and one with pp in the middle (valid where edp == dp or pp == 1)."""


@st.composite
def gpt_specs(draw, optimizer=None, moe=None):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    head_dim = draw(st.sampled_from([1, 2, 3]))
    opt = draw(st.sampled_from([None, "adam", "distributed_adam"])) if optimizer is None else optimizer
    moe = draw(st.booleans()) if moe is None else moe
    experts = draw(st.integers(2, 8)) if moe else 0
    return GPTSpec(
        num_layers=draw(st.integers(1, 4)),
        hidden=heads * head_dim,
        heads=heads,
        query_groups=groups,
        ffn=8 * draw(st.integers(1, 3)),
        vocab=draw(st.sampled_from([5, 17, 50, 50257 % 97])),
        seq_len=draw(st.integers(1, 8)),
        swiglu=draw(st.booleans()),
        tied=draw(st.booleans()),
        rope=draw(st.booleans()),
        bias=draw(st.booleans()),
        layernorm=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 2, 8])),
        optimizer=opt,
        bucket_numel=draw(st.sampled_from([None, 40, 300])),
        bucketing=draw(st.sampled_from(list(Bucketing))),
        num_experts=experts,
        moe_ffn=draw(st.sampled_from([None, 4, 8])) if moe else None,
        topk=draw(st.integers(1, experts)) if moe else 2,
        shared_expert_ffn=draw(st.sampled_from([0, 8])) if moe else 0,
        shared_expert_gate=draw(st.booleans()) if moe else False,
        expert_bias=draw(st.booleans()) if moe else False,
        moe_layer_freq=draw(st.sampled_from([1, 2])) if moe else 1,
    )


def _candidates(moe: bool, num_layers: int, max_world: int):
    """Every config with world <= max_world (ep and etp varied only for MoE trees)."""
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4):
            for pp in (1, 2, 3, 4):
                for dp in range(1, max_world // (tp * cp * pp) + 1):
                    world = dp * tp * cp * pp
                    for ep in (1, 2, 4, 8) if moe else (1,):
                        for etp in (1, 2, 4, 8) if moe else (tp,):
                            if world % (ep * etp * pp):
                                continue
                            for vpp in (1, 2, 3) if pp > 1 else (1,):
                                for order in ORDERS:
                                    yield dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp,
                                               order=order)
                                if pp == 2 and vpp == 1 and num_layers >= 3:
                                    yield dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                               stage_layers=(1, num_layers - 1))


def valid_configs(tree, max_world=8):
    """Every config with world <= max_world that can hold ``tree``."""
    moe = any(leaf.layout.expert is not None for _, leaf in tree.tensors())
    return _valid(tree, moe, max_world)


def _valid(tree, moe, max_world):
    out = []
    for kwargs in _candidates(moe, tree.num_layers, max_world):
        try:
            config = ParallelConfig(**kwargs)
            tree.validate(config)
        except ConfigError:
            continue
        if config not in out:
            out.append(config)
    return out


@lru_cache(maxsize=256)
def _configs_of(spec):
    return valid_configs(gpt_tree(spec))


@st.composite
def tree_and_configs(draw, optimizer=None, moe=None):
    spec = draw(gpt_specs(optimizer, moe))
    tree = gpt_tree(spec)
    configs = _configs_of(spec)
    a = draw(st.sampled_from(configs))
    b = draw(st.sampled_from(configs))
    return spec, tree, a, b
