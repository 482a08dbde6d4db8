"""``fully_sharded_model_space`` (formats/dist/model_space.py): unit cases.

The end-to-end check, megatron-core 0.13.1's own checkpoints resharded and trained on, is
``test_megatron_core_013.py``.
"""

import pytest
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.layout import Layout, Split
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Piece, Sharding
from tenplex.ptree.tree import PTree, TensorLeaf
from tenplex_megatron.formats.dist.model_space import check_steps, model_space_pieces, model_space_shape
from tenplex_megatron.formats.dist.read import _optim_type


def _sharding(leaf, tp):
    return Sharding(PTree({"w": leaf}, 0), ParallelConfig(tp=tp))


def test_gate_and_up_shards_are_rows_of_the_item():
    """SwiGLU's fc1 ``[gate; up]`` at tp 2: tp rank 1 holds gate shard 1 (item row 1) then up shard 1
    (row 3), each 2 x 4 elements, at local offsets 0 and 8."""
    leaf = TensorLeaf((8, 4), "float32", Layout(split=Split(0, parts=(4, 4))))
    sharding = _sharding(leaf, 2)
    assert model_space_shape(sharding, leaf) == (4, 1, 8)
    pieces = model_space_pieces((8, 4), sharding.tp_local(leaf, 1)[1], "w")
    assert pieces == (Piece(Box((1, 0, 0), (1, 1, 8)), 0, (1, 1, 8), Box((0, 0, 0), (1, 1, 8))),
                      Piece(Box((3, 0, 0), (1, 1, 8)), 8, (1, 1, 8), Box((0, 0, 0), (1, 1, 8))))


def test_a_row_parallel_shard_and_an_unsplit_tensor():
    leaf = TensorLeaf((4, 6), "float32", Layout(split=Split(1)))
    assert model_space_shape(_sharding(leaf, 2), leaf) == (1, 2, 12)
    norm = TensorLeaf((6,), "float32", Layout())
    assert model_space_shape(_sharding(norm, 2), norm) == (1, 6)


def test_pieces_it_cannot_hold_are_refused():
    uneven = Piece(Box((0, 1), (2, 2)), 0, (2, 2), Box((0, 0), (2, 2)))
    with pytest.raises(ManifestError, match="does not tile"):
        model_space_pieces((4, 4), (uneven,), "w")
    strided = Piece(Box((0, 0), (2, 2)), 0, (2, 4), Box((0, 0), (2, 2)))
    with pytest.raises(ManifestError, match="not contiguous"):
        model_space_pieces((4, 4), (strided,), "w")


def test_per_parameter_steps_must_agree_with_the_groups():
    groups = [{"step": 2.0}, {"step": 2.0}]
    check_steps({0: {"step": torch.tensor(2.0)}, 1: {"step": 2}}, groups, "c")  # torch's Adam
    check_steps({0: {}, 1: {}}, groups, "c")  # fused Adams keep the step in the groups
    check_steps(None, groups, "c")
    with pytest.raises(ManifestError, match=r"steps differ: per parameter \[2.0, 3.0\]"):
        check_steps({0: {"step": 2.0}, 1: {"step": 3.0}}, groups, "c")
    with pytest.raises(ManifestError, match=r"steps differ: per parameter \[3.0\], per param group \[2.0\]"):
        check_steps({0: {"step": 3.0}}, groups, "c")
    with pytest.raises(ManifestError, match="expected per-parameter"):
        check_steps({0: {"step": 2.0, "exp_avg": 1}}, groups, "c")
    with pytest.raises(ManifestError, match="expected a number"):
        check_steps({0: {"step": "2"}}, groups, "c")


def test_other_sharding_types_are_named():
    common = {"optimizer": {"param_state_sharding_type": "fully_sharded_bucket_space"}}  # deprecated in 0.13
    with pytest.raises(ManifestError, match="ckpt: distributed optimizer state of sharding type "
                                            "'fully_sharded_bucket_space' is not supported"):
        _optim_type(common, [], "ckpt")
    for kind in ("fully_sharded_model_space", "dp_zero_gather_scatter"):
        assert _optim_type({"optimizer": {"param_state_sharding_type": kind}}, [], "ckpt") == kind
