"""Hypothesis strategies for store tests: GPT trees with MB-sized tensors, configs, blocks.

Unlike ``tests/helpers/strategies.py`` (tiny models for the planner), these draw
hidden sizes up to 128 and vocabularies up to 3001 rows, so a stored tensor
is up to about 1.5 MB and spans hundreds or thousands of the small checksum
blocks drawn beside it (64 B to 4 KiB, powers of two or not).
"""

from __future__ import annotations

from hypothesis import strategies as st

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree import ParallelConfig

__all__ = ["blocks", "sized_gpt_specs", "configs_for", "differential_cases"]

blocks = st.one_of(st.sampled_from([64, 96, 1000, 4096]), st.integers(64, 4096))
"""Checksum block sizes in bytes."""


@st.composite
def sized_gpt_specs(draw) -> GPTSpec:
    """GPT specs from a few KB to about 25 MB of state."""
    heads = draw(st.sampled_from([2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    head_dim = draw(st.sampled_from([1, 3, 8, 16]))
    return GPTSpec(
        num_layers=draw(st.integers(1, 3)),
        hidden=heads * head_dim,
        heads=heads,
        query_groups=groups,
        ffn=draw(st.sampled_from([8, 40, 256, 1024])),
        vocab=draw(st.sampled_from([17, 300, 1001, 3001])),
        seq_len=draw(st.integers(1, 16)),
        swiglu=draw(st.booleans()),
        tied=draw(st.booleans()),
        rope=draw(st.booleans()),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 128])),
        optimizer=draw(st.sampled_from([None, "adam", "distributed_adam"])),
        bucket_numel=draw(st.sampled_from([None, 1000, 100_000])),
    )


def configs_for(tree, max_world: int = 8) -> list[ParallelConfig]:
    """Every (dp, tp, pp) config of at most ``max_world`` ranks that holds ``tree``, uneven stages too."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 3, 4):
            for dp in range(1, max_world // (tp * pp) + 1):
                candidates = [ParallelConfig(dp, tp, pp)]
                if pp == 2 and tree.num_layers >= 3:
                    candidates.append(ParallelConfig(dp, tp, pp, stage_layers=(1, tree.num_layers - 1)))
                for config in candidates:
                    try:
                        tree.validate(config)
                    except ConfigError:
                        continue
                    out.append(config)
    return out


@st.composite
def differential_cases(draw):
    """``(tree, A, B, block of the saved store, block of the resharded store)``."""
    tree = gpt_tree(draw(sized_gpt_specs()))
    configs = configs_for(tree)
    return (tree, draw(st.sampled_from(configs)), draw(st.sampled_from(configs)),
            draw(blocks), draw(blocks))
