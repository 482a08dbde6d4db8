"""What the state is: configs, layouts, regions, the tree, shards."""

from tenplex.ptree.config import Coord, ParallelConfig
from tenplex.ptree.buffer import Bucketing, FlatBuffer
from tenplex.ptree.layout import DPShard, Expert, Layout, Padding, Split, Stage, StageKind
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Holding, Piece, Sharding
from tenplex.ptree.shards import assemble, materialize
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf

__all__ = [
    "Box", "Bucketing", "Coord", "DPShard", "Expert", "FlatBuffer", "Holding", "Layout", "PTree", "Padding",
    "ParallelConfig", "Piece", "Scope", "Sharding", "Split", "Stage", "StageKind",
    "TensorLeaf", "ValueLeaf", "assemble", "materialize",
]
