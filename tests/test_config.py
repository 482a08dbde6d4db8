import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenplex.errors import ConfigError
from tenplex.models import GPTSpec, gpt_tree
from tenplex.ptree.config import Coord, ParallelConfig


def test_megatron_rank_order():
    c = ParallelConfig(dp=2, tp=2, pp=2)
    assert [tuple(c.coord(r)) for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
       st.permutations(["tp", "dp", "pp"]))
def test_rank_coord_round_trip(dp, tp, pp, order):
    c = ParallelConfig(dp, tp, pp, tuple(order))
    assert sorted(c.rank(c.coord(r)) for r in range(c.world_size)) == list(range(c.world_size))
    assert all(c.rank(c.coord(r)) == r for r in range(c.world_size))


def test_parse():
    assert ParallelConfig.parse("dp=2,tp=4,pp=2") == ParallelConfig(2, 4, 2)
    assert ParallelConfig.parse("tp=2") == ParallelConfig(1, 2, 1)
    assert ParallelConfig.parse("pp=2,stages=1:3").stage_layers == (1, 3)
    assert str(ParallelConfig.parse("dp=2,tp=4,pp=2")) == "dp=2,tp=4,pp=2"
    for bad, message in [("dp=0", "dp must be an integer >= 1"),
                         ("tp=2,tp=4", "tp is given twice"),
                         ("cp=2", "unknown key"),
                         ("dp2", "expected key=value"),
                         ("pp=2,stages=1:2:3", "stage_layers must list pp=2")]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig.parse(bad)


def test_json_round_trip():
    c = ParallelConfig(2, 2, 2, ("tp", "pp", "dp"), (1, 3))
    assert ParallelConfig.from_json(c.to_json()) == c


def test_stages():
    c = ParallelConfig(pp=2, stage_layers=(1, 3))
    assert [c.stage_of_layer(i, 4) for i in range(4)] == [0, 1, 1, 1]
    assert c.first_layer(1, 4) == 1
    with pytest.raises(ConfigError, match="sum to 4, expected num_layers=5"):
        c.layers_per_stage(5)


def test_validation_names_the_constraint():
    tree = gpt_tree(GPTSpec(num_layers=4, heads=8, query_groups=8, hidden=64, ffn=96))
    with pytest.raises(ConfigError, match=r"tp=3 does not divide num_query_groups=8"):
        tree.validate(ParallelConfig(tp=3))
    with pytest.raises(ConfigError, match=r"pp=3 does not divide num_layers=4"):
        tree.validate(ParallelConfig(pp=3))
    with pytest.raises(ConfigError, match=r"tp=16 does not divide num_query_groups=8"):
        tree.validate(ParallelConfig(tp=16))
    tree.validate(ParallelConfig(tp=8, pp=4))
    with pytest.raises(ConfigError, match="rank 8 is outside"):
        ParallelConfig(tp=8).coord(8)
    with pytest.raises(ConfigError, match="dp=2 is outside"):
        ParallelConfig(dp=2).rank(Coord(2, 0, 0))
