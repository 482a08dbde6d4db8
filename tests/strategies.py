"""Hypothesis strategies: GPT-style specs and valid config pairs."""

from hypothesis import strategies as st

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree.config import ParallelConfig


@st.composite
def gpt_specs(draw, optimizer=None):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    head_dim = draw(st.sampled_from([1, 2, 3]))
    opt = draw(st.sampled_from([None, "adam", "distributed_adam"])) if optimizer is None else optimizer
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
    )


def valid_configs(tree, max_world=8):
    """Every config with dp*tp*pp <= max_world that can hold ``tree`` (even and uneven stages)."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 3, 4):
            for dp in range(1, max_world // (tp * pp) + 1):
                cands = [ParallelConfig(dp, tp, pp)]
                if pp == 2 and tree.num_layers >= 3:
                    cands.append(ParallelConfig(dp, tp, pp, stage_layers=(1, tree.num_layers - 1)))
                for c in cands:
                    try:
                        tree.validate(c)
                    except ConfigError:
                        continue
                    out.append(c)
    return out


@st.composite
def tree_and_configs(draw, optimizer=None):
    spec = draw(gpt_specs(optimizer))
    tree = gpt_tree(spec)
    configs = valid_configs(tree)
    a = draw(st.sampled_from(configs))
    b = draw(st.sampled_from(configs))
    return spec, tree, a, b
