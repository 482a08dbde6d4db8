"""tenplex: device-independent training state under dp/tp/pp/cp/ep/etp/vpp parallelism.

A job's state is a :class:`PTree` of leaves with declared layouts. The
planner works out which part of which tensor each rank of a new parallel
config needs and where it can be found; executors move exactly those bytes.
"""

from tenplex.errors import (AlreadyExistsError, ConfigError, CorruptShardError, LayoutError,
                            ManifestError, MissingDataError, PathError, PlanError,
                            ReplicaMismatchError, ShardError, StoreError, TenplexError,
                            TransferError, UnsafePickleError)
from tenplex.ptree import (Box, Bucketing, Coord, DPShard, Expert, FlatBuffer, Layout, Padding,
                           ParallelConfig, PTree, Scope, Sharding, Split, Stage, StageKind,
                           TensorLeaf, ValueLeaf, materialize)
from tenplex.transform import (Device, ExecStats, Link, OpKind, Placement, Plan, execute_local,
                               make_plan)

from tenplex.api import ReshardReport, load, load_global, reshard, save, verify
from tenplex import models
from tenplex.elastic import ReconfigureReport, reconfigure, recover
from tenplex.distributed_save import save_distributed
from tenplex.snapshot import Snapshotter, snapshot
from tenplex.snapshot_recover import Restored, recover_from_snapshots

__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError", "Box", "Bucketing", "ConfigError", "Coord", "CorruptShardError", "DPShard",
    "Device", "ExecStats", "Expert", "FlatBuffer", "Layout", "LayoutError", "Link", "ManifestError",
    "MissingDataError", "OpKind", "PTree", "Padding", "ParallelConfig", "PathError", "Placement",
    "Plan", "PlanError", "ReplicaMismatchError", "Scope", "ShardError", "Sharding", "Split",
    "Stage", "StageKind", "StoreError", "TenplexError", "TensorLeaf", "TransferError",
    "UnsafePickleError", "ValueLeaf", "ReshardReport", "execute_local", "load", "load_global", "make_plan", "materialize",
    "models", "reshard", "save", "verify", "ReconfigureReport", "reconfigure", "recover",
    "save_distributed", "Snapshotter", "snapshot", "Restored", "recover_from_snapshots",
]
