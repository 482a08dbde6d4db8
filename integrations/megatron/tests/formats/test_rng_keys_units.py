"""RNG object keys on the (pp, tp) and (pp, tp, dp) grids: what is written, what is accepted.

The real checkpoints (megatron-core 0.16.1 at ep 2, loaded back by 0.16.1 and 0.19.2) are in
``test_rng_per_dp.py``; these check the key arithmetic and the refusals without a run.
"""

from types import SimpleNamespace

import pytest

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.formats.dist.keys import RNG_KEY, classify, rng_key, rng_objects
from tenplex_megatron.formats.dist.read import _check_object, _check_rng_ranks, rng_coords

CFG = SimpleNamespace(num_layers=2)
EP2 = ParallelConfig(dp=2, tp=1, pp=2, ep=2)


def _md(*keys):
    return SimpleNamespace(state_dict_metadata=dict.fromkeys(keys))


def test_both_grids_are_rng_keys():
    assert rng_key(1, 0, 2, 2) == "rng_state/shard_0.1_2.2"
    assert rng_key(1, 0, 2, 2, 3, 4) == "rng_state/shard_0.1.3_2.2.4"
    assert classify("rng_state/shard_0.1.3_2.2.4") == classify("rng_state/shard_0.1_2.2") == "rng"
    assert RNG_KEY.match("rng_state/shard_0.1.3_2.2.4").groups() == ("0", "1", "3", "2", "2", "4")


def test_objects_at_ep_1_and_above():
    """Every dp-cp rank's state under its own key at ep > 1, rank 0's under the (pp, tp) key; with
    data_parallel_random_init each object holds every dp rank's states."""
    states = ["s0", "s1"]
    assert rng_objects(states[:1], 0, 1, ParallelConfig(dp=2, tp=1, pp=2), False) == \
        [("rng_state/shard_1.0_2.1", ["s0"])]
    assert rng_objects(states, 0, 1, EP2, False) == [
        ("rng_state/shard_1.0_2.1", ["s0"]), ("rng_state/shard_1.0.0_2.1.2", ["s0"]),
        ("rng_state/shard_1.0.1_2.1.2", ["s1"])]
    assert [data for _, data in rng_objects(states, 0, 1, EP2, True)] == [states] * 3


@pytest.mark.parametrize("key", [
    "rng_state/shard_0.0.0_2.1.4",   # a dp grid of 4 where dp*cp is 2
    "rng_state/shard_0.0.2_2.1.2",   # a dp rank outside the grid
    "rng_state/shard_0.0.1_2.1",     # a dp offset without a dp size
    "rng_state/shard_0.0_2.1.2",     # a dp size without a dp offset
    "rng_state/shard_2.0_2.1",       # a pp rank outside the grid
])
def test_keys_that_do_not_fit_the_grid_are_refused(key):
    with pytest.raises(ManifestError, match=rf"object {key} does not fit the model .*dp\*cp=2"):
        _check_object(key, "rng", CFG, EP2, "/ckpt")


def test_fitting_keys_pass():
    for key in ("rng_state/shard_1.0_2.1", "rng_state/shard_1.0.1_2.1.2"):
        _check_object(key, "rng", CFG, EP2, "/ckpt")


def test_per_rank_states_must_cover_every_dp_rank():
    """Stored per rank, a coordinate lacking a rank's state is refused (that rank could not load);
    where both grids are stored, the per-rank keys are the coordinate's, in rank order."""
    both = _md("rng_state/shard_0.0_2.1", "rng_state/shard_0.0.1_2.1.2", "rng_state/shard_0.0.0_2.1.2",
               "rng_state/shard_1.0_2.1")
    assert rng_coords(both) == {"tp=0,pp=0": ["rng_state/shard_0.0.0_2.1.2", "rng_state/shard_0.0.1_2.1.2"],
                                "tp=0,pp=1": ["rng_state/shard_1.0_2.1"]}
    _check_rng_ranks(both, EP2, "/ckpt")
    with pytest.raises(ManifestError, match=r"RNG state of tp=0,pp=0 is stored per dp-cp rank .* ranks \[1\]"):
        _check_rng_ranks(_md("rng_state/shard_0.0.0_2.1.2"), EP2, "/ckpt")
