"""RankTable.groups: ranks on some stages (and one ep rank) grouped by some coordinates.

The groups are built on demand (:class:`~tenplex.ptree.ranks.Groups`); this
checks them, as a whole mapping and key by key, against a grouping of
``config.coord(rank)`` worked out rank by rank.
"""

from hypothesis import given, settings, strategies as st

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.ranks import RankTable

KEYS = [(), ("tp",), ("etp",), ("tp", "pp", "dpcp"), ("etp", "pp", "edp"), ("pp", "dpcp")]


def _brute(config: ParallelConfig, stages, owner, keys) -> dict:
    table = RankTable(config)
    out: dict = {}
    for rank in range(config.world_size):
        c = config.coord(rank)
        if c.pp not in stages or (owner is not None and c.ep != owner):
            continue
        key = tuple(int(table.coord[k][rank]) for k in keys)
        out.setdefault(key, []).append(rank)
    return {k: tuple(v) for k, v in out.items()}


@st.composite
def cases(draw):
    tp, pp, cp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if (dp * cp * tp) % e == 0]))
    etp = draw(st.sampled_from([e for e in (1, tp) if (dp * cp * tp) % (e * ep) == 0]))
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    stages = tuple(sorted(draw(st.sets(st.integers(0, pp - 1), min_size=1))))
    owner = draw(st.one_of(st.none(), st.integers(0, ep - 1)))
    return config, stages, owner, draw(st.sampled_from(KEYS))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_groups_are_the_ranks_of_each_coordinate_combination_in_rank_order(case):
    config, stages, owner, keys = case
    want = _brute(config, stages, owner, keys)
    groups = RankTable(config).groups(stages, owner, keys)
    assert dict(groups.items()) == want and len(groups) == len(want)
    for key, ranks in want.items():  # on demand, key by key, in any order
        assert groups[key] == ranks and groups.get(key) == ranks
    absent = tuple(99 for _ in keys)
    assert groups.get(absent, ()) == () if keys else True
    assert groups.get("not a key") is None
