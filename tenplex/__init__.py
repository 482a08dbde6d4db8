"""tenplex: device-independent training state under dp/tp/pp/cp/ep/etp/vpp parallelism.

A job's state is a :class:`PTree` of leaves with declared layouts. The
planner works out which part of which tensor each rank of a new parallel
config needs and where it can be found; executors move exactly those bytes.

This facade holds the verbs, the tree and layout vocabulary,
:class:`ParallelConfig` and the errors. Planner and executor types stay in
their packages (:mod:`tenplex.transform`: ``Plan``, ``Placement``, ...;
:mod:`tenplex.formats`: the format protocol and its records;
:mod:`tenplex.store`), and so do reports (``tenplex.api.ReshardReport``,
``tenplex.elastic.ReconfigureReport``).
"""

from tenplex.errors import (AlreadyExistsError, ConfigError, CorruptShardError, LayoutError,
                            ManifestError, MissingDataError, PathError, PlanError,
                            ReplicaMismatchError, ShardError, StoreError, TenplexError,
                            TransferError, UnsafePickleError)
from tenplex.ptree import (Bucketing, DPShard, Expert, FlatBuffer, Layout, Padding, ParallelConfig,
                           PTree, Scope, Split, Stage, StageKind, TensorLeaf, ValueLeaf, materialize)
from tenplex.transform import execute_local, make_plan

from tenplex.api import load, load_global, reshard, save, verify
from tenplex.elastic import reconfigure, recover
from tenplex.distributed_save import save_distributed
from tenplex.snapshot import Snapshotter, snapshot
from tenplex.snapshot_recover import Restored, recover_from_snapshots

__version__ = "0.1.0"

__all__ = [
    # verbs
    "save", "load", "load_global", "reshard", "verify", "reconfigure", "recover", "save_distributed",
    "snapshot", "recover_from_snapshots", "Snapshotter", "Restored",
    "materialize", "make_plan", "execute_local",
    # the tree and layout vocabulary
    "PTree", "TensorLeaf", "ValueLeaf", "Scope", "Layout", "Split", "Stage", "StageKind", "Padding",
    "DPShard", "FlatBuffer", "Bucketing", "Expert", "ParallelConfig",
    # errors
    "TenplexError", "ConfigError", "LayoutError", "PlanError", "StoreError", "ManifestError",
    "ShardError", "CorruptShardError", "MissingDataError", "PathError", "AlreadyExistsError",
    "ReplicaMismatchError", "TransferError", "UnsafePickleError",
]
